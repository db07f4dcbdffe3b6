"""``python -m bench.profiled OUT ARGS…``: ``jobplane ARGS…`` under cProfile, timed by
the process's CPU clock (not the wall clock: a process waiting on the network
costs nothing), its stats written to OUT when the command ends (SIGTERM ends it
in order)."""

from __future__ import annotations

import cProfile
import sys
import time

from jobplane.cli import main


def run(out: str, args: list[str]) -> None:
    profile = cProfile.Profile(time.process_time)
    try:
        profile.runcall(main, args)  # ends by SystemExit with the command's status
    finally:
        profile.dump_stats(out)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
