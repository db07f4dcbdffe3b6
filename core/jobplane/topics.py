"""AMQP topic routing as jobplane uses it: the events exchange's default name,
topic-pattern matching, and the lifecycle event types a topology may publish.

Its own module, free of any broker library, because the SDK matches event
types to subscription patterns too (:mod:`jobplane.events.envelope`);
:mod:`jobplane.topology` re-exports both names.
"""

from __future__ import annotations

from functools import lru_cache

# The events exchange when the topology file names none; the same default as
# jobplane.events.EXCHANGE, the consumers' default.
EVENTS_EXCHANGE = "jobplane.events"

#: The lifecycle events job transitions write (docs/events.md, "Lifecycle
#: events"; ``jobplane.store.machine.Lifecycle`` holds the same), in the order
#: the docs list them. A topology's ``[events] publish_lifecycle`` patterns
#: choose among them which reach the events exchange.
LIFECYCLE_EVENT_TYPES = (
    "job.queued",
    "job.started",
    "job.retry_scheduled",
    "job.cancel_requested",
    "job.stage_succeeded",
    "job.succeeded",
    "job.failed",
    "job.cancelled",
)


@lru_cache(maxsize=4096)
def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: ``*`` is one word, ``#`` zero or more.

    Cached: every submit routes its type through the topology's bindings,
    and a deployment has few of both.
    """
    return _match(pattern.split("."), key.split("."))


def _match(pattern: list[str], words: list[str]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    if head in ("*", words[0]):
        return _match(rest, words[1:])
    return False


def topic_regex(pattern: str) -> str:
    """A POSIX regular expression that matches ``'.' + key`` iff ``pattern`` matches ``key``.

    Every word of the key becomes ``.word``: ``*`` is one such piece, ``#``
    any number of them. Pattern words are letters, digits, ``_`` and ``-``
    (the topology refuses others), which stand for themselves.
    """
    pieces = {"*": r"\.[^.]+", "#": r"(\.[^.]+)*"}
    return "^" + "".join(pieces.get(word, r"\." + word) for word in pattern.split(".")) + "$"
