"""Sessions in signed cookies, CSRF tokens, and the sign-in throttle.

A session cookie holds the API key's SHA-256 (what the database stores), never
the key: a stolen cookie opens the dashboard until it expires, not the API.
Every request resolves that hash through the server's key cache, so a revoked
key ends its sessions within the cache's notification, as it ends API calls.
The cookie is signed with HMAC-SHA256 (the standard library's ``hmac``; the
signature is compared in constant time) under ``JOBPLANE_UI_SECRET``.

CSRF: each session has a token, an HMAC of the session's random id, which
every form carries and every POST must present; the cookie is SameSite=Strict
besides. The sign-in form, before any session, is bound the same way to a
short-lived random cookie of its own (login CSRF).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jobplane.config import Network

SESSION_COOKIE = "jobplane_session"
SIGNIN_COOKIE = "jobplane_signin"
#: How long a sign-in form stays usable.
SIGNIN_SECONDS = 600.0
# Past this size a cookie is not one we made.
_MAX_COOKIE = 1024
# Sessions ended by sign-out in this process, remembered until they expire.
_ENDED_ENTRIES = 100_000


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Session:
    """A signed-in browser: its random id, its key (by hash and id), when it began."""

    sid: str
    key_hash: bytes
    key_id: str
    issued: float


class SessionCodec:
    """Makes and checks session cookies and CSRF tokens under one secret."""

    def __init__(
        self, secret: bytes, *, max_age: float, clock: Callable[[], float] = time.time
    ) -> None:
        self._secret = secret
        self.max_age = max_age
        self._clock = clock
        self._ended: OrderedDict[str, float] = OrderedDict()

    def _sign(self, purpose: str, value: str) -> str:
        mac = hmac.new(self._secret, f"{purpose}.{value}".encode(), hashlib.sha256)
        return _b64(mac.digest())

    def new(self, key_hash: bytes, key_id: str) -> Session:
        """A new session of the key."""
        return Session(_b64(secrets.token_bytes(16)), key_hash, key_id, self._clock())

    def encode(self, session: Session) -> str:
        """The cookie value."""
        body = _b64(
            json.dumps(
                [session.sid, session.key_hash.hex(), session.key_id, session.issued],
                separators=(",", ":"),
            ).encode()
        )
        return f"{body}.{self._sign('session', body)}"

    def decode(self, value: str | None) -> Session | None:
        """The session of a cookie value; None when it is not ours, expired or ended."""
        if not value or len(value) > _MAX_COOKIE:
            return None
        body, _, signature = value.partition(".")
        if not hmac.compare_digest(signature.encode(), self._sign("session", body).encode()):
            return None
        try:
            sid, key_hex, key_id, issued = json.loads(_unb64(body))
            session = Session(str(sid), bytes.fromhex(key_hex), str(key_id), float(issued))
        except (ValueError, TypeError):
            return None
        return session if self.still_valid(session) else None

    def still_valid(self, session: Session) -> bool:
        """True while ``session`` is within its age and not signed out (in this process)."""
        now = self._clock()
        return session.issued <= now < session.issued + self.max_age and (
            session.sid not in self._ended
        )

    def end(self, session: Session) -> None:
        """Refuse the cookie of this sign-in from now on (sign-out), in this process."""
        now = self._clock()
        while self._ended and next(iter(self._ended.values())) <= now:
            self._ended.popitem(last=False)
        self._ended[session.sid] = session.issued + self.max_age
        if len(self._ended) > _ENDED_ENTRIES:
            self._ended.popitem(last=False)

    def csrf(self, session: Session) -> str:
        """The session's CSRF token."""
        return self._sign("csrf", session.sid)

    def csrf_ok(self, session: Session, token: str) -> bool:
        """True when ``token`` is the session's (constant-time)."""
        return hmac.compare_digest(token.encode(), self.csrf(session).encode())

    def signin_nonce(self, current: str | None = None) -> tuple[str, str]:
        """A sign-in form's cookie value and the token its form carries.

        The browser's ``current`` one is kept while it has half its life left:
        two sign-in pages open at once (or one fetched twice) both work.
        """
        if not self._fresh(current, SIGNIN_SECONDS / 2):
            current = f"{_b64(secrets.token_bytes(16))}~{int(self._clock())}"
        assert current is not None
        return current, self._sign("signin", current)

    def signin_ok(self, nonce: str | None, token: str) -> bool:
        """True when the form's token belongs to the browser's sign-in cookie, still fresh."""
        if not self._fresh(nonce, SIGNIN_SECONDS) or nonce is None:
            return False
        return hmac.compare_digest(token.encode(), self._sign("signin", nonce).encode())

    def _fresh(self, nonce: str | None, seconds: float) -> bool:
        if not nonce or len(nonce) > 100:
            return False
        _, _, stamp = nonce.partition("~")
        return stamp.isdigit() and len(stamp) < 12 and self._clock() - int(stamp) < seconds


class SignInThrottle:
    """Slows and then refuses a client's failed sign-ins.

    ``free`` failures a client address may make in ``window`` seconds; past
    them it is refused until the window has passed. Each failure is answered
    after ``delay`` seconds. Keys are 256 random bits,
    so this is not what protects them: it keeps a client from making the
    server look keys up as fast as it can send forms.
    """

    def __init__(
        self,
        *,
        free: int = 5,
        window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        entries: int = 10_000,
        delay: float = 0.5,
    ) -> None:
        #: How long a failed sign-in waits before it is answered.
        self.delay = delay
        self._free = free
        self._window = window
        self._clock = clock
        self._entries = entries
        self._failures: OrderedDict[str, list[float]] = OrderedDict()

    def retry_after(self, client: str) -> float:
        """Seconds until ``client`` may try again; 0 when it may now."""
        now = self._clock()
        times = [t for t in self._failures.get(client, ()) if now - t < self._window]
        if len(times) < self._free:
            return 0.0
        return max(0.1, self._window - (now - times[-self._free]))

    def attempt(self, client: str) -> float:
        """Count a sign-in of ``client`` before it is checked; 0 when it may go on,
        else the seconds until it may try again (nothing counted then).

        Counted first, so that sign-ins sent at once cannot all pass the check
        while the first of them is still looking its key up;
        :meth:`succeeded` undoes it.
        """
        wait = self.retry_after(client)
        if wait == 0:
            self.failed(client)
        return wait

    def failed(self, client: str) -> None:
        """Count a failed sign-in of ``client``."""
        now = self._clock()
        times = [t for t in self._failures.pop(client, []) if now - t < self._window]
        times.append(now)
        self._failures[client] = times[-self._free :]
        while len(self._failures) > self._entries:
            self._failures.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """Forget the client's failures."""
        self._failures.pop(client, None)


def client_address(
    remote: str | None, forwarded_for: Sequence[str], trusted: tuple[Network, ...]
) -> str:
    """The client a request came from: ``remote``, or, when ``remote`` is a trusted
    proxy, the nearest address of ``X-Forwarded-For`` (read from the right) that is
    not a trusted proxy itself. Without trusted proxies the header is ignored: a
    client could write anything in it."""
    networks = trusted

    def is_trusted(text: str) -> bool:
        try:
            address = ipaddress.ip_address(text.strip().strip("[]"))
        except ValueError:
            return False
        return any(address in network for network in networks)

    client = remote or "?"
    if not networks or not is_trusted(client):
        return client
    hops = [h.strip() for value in forwarded_for for h in value.split(",") if h.strip()]
    for hop in reversed(hops):
        if not is_trusted(hop):
            try:
                return str(ipaddress.ip_address(hop.strip("[]")))
            except ValueError:
                return client  # not an address: trust the proxy's own
        client = hop
    return client
