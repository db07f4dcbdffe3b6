"""The peers figure's arms: their job types have handlers, the dev arm loads what
``make dev`` loads, and the closed loop's two halves are read apart."""

from __future__ import annotations

import pytest

from bench import dev_handlers, handlers, peers
from bench.handlers import PEER_TYPES
from bench.peers import KINDS, WARMUP_JOBS, Submitted, halves
from bench.peers_variants import VARIANTS


@pytest.mark.parametrize("kind", sorted(KINDS.values()))
def test_every_jobplane_arm_s_types_have_a_no_op_handler_in_both_registries(kind: str) -> None:
    for round_ in range(1, PEER_TYPES + 1):
        for job_type in (
            f"bench.noop_peers_{kind}_{round_}",
            f"bench.noop_peers_{kind}_{round_}_warmup",
        ):
            assert handlers.registry.get(job_type) is handlers.noop
            assert dev_handlers.registry.get(job_type) is handlers.noop


def test_the_dev_arm_loads_make_dev_s_handlers_beside_the_no_op_types() -> None:
    from examples.reports import render

    assert dev_handlers.registry.get("reports.render") is render
    assert len(dev_handlers.registry) == len(handlers.registry) + 1


def test_the_halves_of_a_closed_loop_that_outruns_its_drain() -> None:
    # 3,000 submits in 5 s, of which 1,500 had completed by the last submit's return.
    accepted, during = halves(3000, Submitted(100.0, 105.0), 1500)
    assert accepted == pytest.approx(600.0)
    assert during == pytest.approx(300.0)


def test_a_drain_that_keeps_up_finishes_what_was_accepted() -> None:
    accepted, during = halves(WARMUP_JOBS, Submitted(0.0, 0.5), WARMUP_JOBS)
    assert accepted == during == pytest.approx(2 * WARMUP_JOBS)


def test_every_variant_passes_its_slots_so_none_follows_the_default() -> None:
    slots = {name: v.get("concurrency", peers.DEV_WIDE_CONCURRENCY) for name, v in VARIANTS.items()}
    assert None not in slots.values()
    assert slots["c8"] == slots["defaults"] == 8
    assert slots["c64"] == slots["defaults_c64"] == 64
