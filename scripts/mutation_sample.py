"""Estimate the kill rate from a random sample of mutants, with a 95 % interval.

Usage: python scripts/mutation_sample.py [--size N] [--seed S] [--jobs J]
                                         [--report-only] [GLOB ...]

A whole run of store/, workers/ and server/ takes days on a small machine;
a uniform sample of a few hundred mutants gives the same figure within a
few points in about an hour. The script has mutmut generate the mutants,
draws N of their names with a fixed seed (the same seed draws the same
mutants, so a run can be stopped and resumed, and a later run after new
tests compares like with like), runs only those (`mutmut run NAME ...`) and
prints the kill rate with its Wilson score interval and the survivors.

The draw is stratified by module with proportional allocation: each module
gets its share of N (largest remainders), so the sample stays uniform (every
mutant has the same chance) while no module is over- or under-drawn by luck.
A module whose share rounds to zero may get no mutant.

Counting follows scripts/mutation_report.py: killed and timed-out mutants
over every tried one; "no tests" counts as not killed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from fnmatch import fnmatch
from pathlib import Path

CAUGHT = frozenset({"killed", "timeout"})
UNTRIED = frozenset({"not checked", "skipped", "check was interrupted by user"})
# mutmut names a mutant `module.x_function__mutmut_N` or
# `module.xǁClassǁmethod__mutmut_N`.
_MODULE = re.compile(r"^(?P<module>.+?)\.x[_ǁ]")


def module_of(name: str) -> str:
    """The dotted module a mutant belongs to."""
    match = _MODULE.match(name)
    return match["module"] if match else name.rpartition(".")[0]


def allocate(sizes: dict[str, int], n: int) -> dict[str, int]:
    """Split n over the strata in proportion to their sizes (largest remainders)."""
    total = sum(sizes.values())
    if n >= total:
        return dict(sizes)
    quotas = {key: n * size / total for key, size in sizes.items()}
    shares = {key: math.floor(q) for key, q in quotas.items()}
    # Ties broken by name so the allocation does not depend on dict order.
    by_remainder = sorted(quotas, key=lambda key: (shares[key] - quotas[key], key))
    for key in by_remainder[: n - sum(shares.values())]:
        shares[key] += 1
    return shares


def draw(names: Iterable[str], n: int, seed: int, *, stratify: bool = True) -> list[str]:
    """n mutant names drawn without replacement, the same for the same seed and names."""
    pool = sorted(set(names))
    rng = random.Random(seed)
    if not stratify:
        return sorted(rng.sample(pool, min(n, len(pool))))
    strata: dict[str, list[str]] = defaultdict(list)
    for name in pool:
        strata[module_of(name)].append(name)
    shares = allocate({module: len(members) for module, members in strata.items()}, n)
    sample: list[str] = []
    for module in sorted(strata):
        sample.extend(rng.sample(strata[module], shares[module]))
    return sorted(sample)


def wilson(successes: int, trials: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % for the default z).

    Unlike p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and keeps its coverage
    near 0 % and 100 %, where a kill rate lives.
    """
    if trials <= 0:
        return (0.0, 1.0)
    p = successes / trials
    z2n = z * z / trials
    centre = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / trials + z2n / (4 * trials))
    return (max(0.0, centre - half), min(1.0, centre + half))


def outcomes(mutmut: Path) -> dict[str, str]:
    """Every generated mutant's name and status, as `mutmut results` lists them."""
    listing = subprocess.run(
        [str(mutmut), "results", "--all", "true"], capture_output=True, text=True, check=True
    ).stdout
    result: dict[str, str] = {}
    for line in listing.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            result[name] = status
    return result


def with_children(status: dict[str, str]) -> dict[str, str]:
    """``status`` with the verdicts of scripts/mutation_children.py for the
    mutants mutmut did not kill (code run in the processes tests start)."""
    verdicts = Path("mutants/children.json")
    if not verdicts.exists():
        return status
    merged = dict(status)
    for name, verdict in json.loads(verdicts.read_text()).items():
        if merged.get(name) not in CAUGHT:
            merged[name] = verdict
    return merged


def generate(jobs: int) -> None:
    """Have mutmut write (or refresh) the mutants, as `mutmut run` does first.

    mutmut has no command that only generates; these are the steps its `run`
    starts with (mutmut 3.8), without the test run that follows.
    """
    from mutmut.__main__ import create_mutants
    from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir

    Path("mutants").mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    stats = create_mutants(jobs)
    print(f"mutants: {stats.mutated} files mutated, {stats.unmodified} unchanged since last time")


def report(
    sample: Sequence[str],
    status: dict[str, str],
    population: int,
    mutmuts: dict[str, str] | None = None,
) -> list[str]:
    """Lines summarising the sample: counts, the rate with its interval, survivors.

    ``mutmuts``: mutmut's own statuses, when ``status`` holds the verdicts of
    scripts/mutation_children.py too (a line says how many those caught)."""
    counts = Counter(status.get(name, "not checked") for name in sample)
    tried = sum(n for s, n in counts.items() if s not in UNTRIED)
    caught = sum(counts[s] for s in CAUGHT)
    lines = [f"{s:>12}: {n}" for s, n in sorted(counts.items())]
    if mutmuts is not None:
        later = [n for n in sample if status.get(n) in CAUGHT and mutmuts.get(n) not in CAUGHT]
        lines.append(f"{'of them':>12}: {len(later)} killed by tests mutmut did not run")
    lines.append(f"{'sample':>12}: {len(sample)} of {population} mutants ({tried} tried)")
    if tried:
        low, high = wilson(caught, tried)
        lines.append(
            f"{'kill rate':>12}: {caught}/{tried} = {100 * caught / tried:.1f}%"
            f" (95% CI {100 * low:.1f}% to {100 * high:.1f}%, Wilson)"
        )
    for name in sample:
        if status.get(name) in ("survived", "no tests", "suspicious"):
            lines.append(f"  {status[name]}: {name}")
    return lines


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=300, help="mutants to draw (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="the draw's seed (default 1)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--no-stratify", action="store_true", help="a simple random sample")
    parser.add_argument(
        "--report-only", action="store_true", help="report the sample's results so far, run nothing"
    )
    parser.add_argument("patterns", nargs="*", metavar="GLOB", help="draw only from these")
    args = parser.parse_args(argv)

    mutmut = Path(sys.executable).with_name("mutmut")
    if not args.report_only:
        generate(args.jobs)
    status = outcomes(mutmut)
    names = [n for n in status if not args.patterns or any(fnmatch(n, p) for p in args.patterns)]
    if not names:
        print("no mutants: run `make mutate` once, or check the globs", file=sys.stderr)
        return 1
    sample = draw(names, args.size, args.seed, stratify=not args.no_stratify)
    if not args.report_only:
        # mutmut skips mutants it already tried, so a stopped run resumes.
        subprocess.run([str(mutmut), "run", "--max-children", str(args.jobs), *sample], check=True)
        status = outcomes(mutmut)
    print("\n".join(report(sample, with_children(status), len(names), status)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
