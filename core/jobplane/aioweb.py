"""Starting an aiohttp application on a configured address (the ops listener, the dashboard)."""

from __future__ import annotations

import errno
from typing import Any

from aiohttp import web

from jobplane.config import ConfigError, ListenAddress


async def start_site(
    app: web.Application, address: ListenAddress, *, setting: str, **runner_options: Any
) -> tuple[web.AppRunner, int]:
    """Bind ``app`` on ``address`` and serve it; the runner and the port bound.

    An address that cannot be bound (a port in use, a host not of this machine)
    is a :class:`ConfigError` naming ``setting``, not a traceback.
    """
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, address.host, address.port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc})"
        raise ConfigError(f"{setting}: {address} {why}; choose another host:port or off") from exc
    except BaseException:
        await runner.cleanup()
        raise
    addresses = runner.addresses
    return runner, int(addresses[0][1]) if addresses else address.port
