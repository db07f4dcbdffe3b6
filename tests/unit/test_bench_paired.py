"""The benchmark's paired comparisons: the arms' ratios, rounds and ports, and the shares' flag."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.paired import (
    DEFAULT_ROUNDS,
    Arm,
    cost_note,
    cost_ratio,
    cpu_change,
    cpu_split,
    round_ratios,
    rounds_of,
)
from bench.run import Bench, _shares

rates = st.lists(st.floats(min_value=1.0, max_value=1e4), min_size=1, max_size=20)


@given(rates, rates)
def test_a_round_ratio_compares_the_arms_within_each_round(a: list[float], b: list[float]) -> None:
    n = min(len(a), len(b))
    ratios = round_ratios(Arm("on", {}, rates=a[:n]), Arm("off", {}, rates=b[:n]))
    assert ratios == [x / y for x, y in zip(a[:n], b[:n], strict=True)]


def test_arms_with_unequal_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="shorter"):
        round_ratios(Arm("on", {}, rates=[1.0, 2.0]), Arm("off", {}, rates=[1.0]))


def test_sampled_shares_are_read_in_order() -> None:
    assert _shares("0.1,1") == [0.1, 1.0]
    assert _shares("0") == [0.0]


@pytest.mark.parametrize("value", ["", "x", "1.5", "-0.1", "0.1,0.1", "0.1,,1", "0,0.1,1"])
def test_a_share_out_of_range_repeated_or_not_a_number_is_refused(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _shares(value)


@pytest.fixture
def make_bench() -> Iterator[Callable[[int | None], Bench]]:
    made: list[Bench] = []

    def make(rounds: int | None) -> Bench:
        made.append(Bench(argparse.Namespace(rounds=rounds, profile=None)))
        return made[-1]

    yield make
    for bench in made:
        shutil.rmtree(bench.workdir, ignore_errors=True)


def test_a_paired_figure_runs_eight_rounds_unless_told(
    make_bench: Callable[[int | None], Bench],
) -> None:
    assert rounds_of(make_bench(None)) == DEFAULT_ROUNDS == 8
    assert rounds_of(make_bench(3)) == 3


@given(rates, rates)
def test_the_cost_ratio_is_the_median_of_the_rounds(a: list[float], b: list[float]) -> None:
    n = min(len(a), len(b))
    on, off = Arm("on", {}, rates=a[:n]), Arm("off", {}, rates=b[:n])
    ratios = sorted(x / y for x, y in zip(a[:n], b[:n], strict=True))
    middle = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    assert cost_ratio(on, off) == pytest.approx(middle)
    assert min(ratios) <= cost_ratio(on, off) <= max(ratios)


def test_the_cpu_change_compares_the_machines_cpu_a_job() -> None:
    off = Arm("off", {}, cpu={"server": 0.4, "worker": 0.6})
    on = Arm("on", {}, cpu={"server": 0.45, "worker": 0.65})
    assert cpu_change(on, off) == pytest.approx(0.1)
    assert cpu_change(off, off) == 0
    assert cpu_split(on, off) == "server 0.40 → 0.45, worker 0.60 → 0.65"


async def test_pinned_ops_ports_are_passed_to_each_serving_process(
    monkeypatch: pytest.MonkeyPatch, make_bench: Callable[[int | None], Bench]
) -> None:
    bench = make_bench(None)
    started: dict[str, list[str]] = {}

    async def spawn(name: str, argv: list[str], *_: object, **__: object) -> None:
        started[name] = argv

    monkeypatch.setattr(bench, "spawn", spawn)
    await bench.start("relay", "relay")
    assert "--metrics-listen" not in started["relay"]
    bench.pin_ops_ports = True
    for name, command in (("server", "serve"), ("relay", "relay"), ("worker0", "worker")):
        await bench.start(name, command, "--concurrency", "4")
        assert started[name][-2:] == ["--metrics-listen", f"127.0.0.1:{bench.ops_ports[name]}"]
    assert len(set(bench.ops_ports.values())) == 3
    await bench.start("sweep", "sweep")
    assert "sweep" not in bench.ops_ports


def test_the_cost_note_says_within_or_over_the_target() -> None:
    off = Arm("off", {}, rates=[100.0, 100.0, 100.0], cpu={"server": 1.0})
    cheap = Arm("on", {}, rates=[97.0, 98.0, 90.0], cpu={"server": 1.02})
    dear = Arm("on", {}, rates=[90.0, 91.0, 99.0], cpu={"server": 1.1})
    assert cost_note("metrics", cheap, off, 0.05) == (
        "metrics: costs 3.0% of the throughput (within the 5% target), machine CPU per job +2.0%"
    )
    assert cost_note("tracing", dear, off, 0.05) == (
        "tracing: costs 9.0% of the throughput (over the 5% target), machine CPU per job +10.0%"
    )
