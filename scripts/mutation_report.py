"""Summarise a mutmut run: counts by outcome, the kill rate, and every survivor.

Usage: python scripts/mutation_report.py [GLOB ...]   (default: every mutant)

The kill rate counts killed and timed-out mutants (a mutant that hangs the
suite is caught by it) over every mutant that was tried; "no tests" mutants
(no selected test reaches the code) count as not killed. Mutants not tried
yet are reported but left out of the rate.
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from collections import Counter
from pathlib import Path


def main(patterns: list[str]) -> int:
    mutmut = Path(sys.executable).with_name("mutmut")
    listing = subprocess.run(
        [str(mutmut), "results", "--all", "true"], capture_output=True, text=True, check=True
    ).stdout
    outcomes: dict[str, str] = {}
    for line in listing.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and (not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)):
            outcomes[name] = status
    counts = Counter(outcomes.values())
    tried = sum(n for status, n in counts.items() if status not in ("not checked", "skipped"))
    caught = counts["killed"] + counts["timeout"]
    for status, n in sorted(counts.items()):
        print(f"{status:>12}: {n}")
    print(f"{'mutants':>12}: {len(outcomes)} ({tried} tried)")
    if tried:
        print(f"{'kill rate':>12}: {caught}/{tried} = {100 * caught / tried:.1f}%")
    for name, status in sorted(outcomes.items()):
        if status in ("survived", "no tests", "suspicious"):
            print(f"  {status}: {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
