"""Summarise a mutmut run: counts by outcome, the kill rate, and every survivor.

Usage: python scripts/mutation_report.py [GLOB ...]   (default: every mutant)

The kill rate counts killed and timed-out mutants (a mutant that hangs the
suite is caught by it) over every mutant that was tried; "no tests" mutants
(no selected test reaches the code) count as not killed. Mutants not tried
yet are reported but left out of the rate.
"""

from __future__ import annotations

import fnmatch
import sys
from collections import Counter
from pathlib import Path

# Beside this file: `python scripts/mutation_report.py` has scripts/ on its path.
from mutation_sample import outcomes as all_outcomes


def main(patterns: list[str]) -> int:
    listed = all_outcomes(Path(sys.executable).with_name("mutmut"))
    outcomes = {
        name: status
        for name, status in listed.items()
        if not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)
    }
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
