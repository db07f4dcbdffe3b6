"""The benchmark's paired comparisons: the arms' round ratios and the sampled shares' flag."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.paired import Arm, round_ratios
from bench.run import _shares

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
