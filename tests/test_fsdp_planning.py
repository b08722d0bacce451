"""Pricing plans under FSDP modes, the per_layer rounds planner, and the per-mode simulate table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamic_cp import simulate as cli
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.fsdp_cost import (
    WeightTraffic,
    collective_s,
    mode_lower_bound,
    round_maxima,
    simulate_mode,
)
from dynamic_cp.planning.groups_layout import normalize_cp_sizes
from dynamic_cp.planning.plan_types import Plan, plan_violations
from dynamic_cp.planning.planner import min_cp_index, plan
from dynamic_cp.planning.rounds import lockstep_rounds, round_violations
from dynamic_cp.planning.rounds_planner import (
    _rounds_to_plan,
    _shelves,
    _time_table,
    plan_for_mode,
    plan_rounds,
)
from dynamic_cp.planning.simulator import simulate

CM = CostModel.from_name("wan-1.3b", "h100")


def test_collectives_follow_bandwidth():
    hw, P = CM.hw, CM.dims.num_params
    assert collective_s(1e9, 1, CM) == 0.0
    # in a node: NVLink bandwidth; across nodes: the inter-node one; (W-1)/W of the buffer moves
    assert collective_s(1e9, 8, CM) == pytest.approx(
        hw.intra_node_latency_s + 1e9 * 7 / 8 / hw.intra_node_bandwidth
    )
    assert collective_s(1e9, 16, CM, calls=3) == pytest.approx(
        3 * hw.inter_node_latency_s + 1e9 * 15 / 16 / hw.inter_node_bandwidth
    )
    t = WeightTraffic.of(CM, 64)
    assert t.gather_s == pytest.approx(collective_s(2 * P, 64, CM, CM.dims.layers))
    assert t.reduce_scatter_s == pytest.approx(collective_s(4 * P, 64, CM, CM.dims.layers))
    assert t.round_s == pytest.approx(2 * t.gather_s + t.reduce_scatter_s)


def test_modes_price_a_hand_plan():
    lengths = [30_000, 9_000, 4_000, 4_000]
    p = Plan([((0, 1), [0]), ((2,), [1]), ((3,), [2]), ((3,), [3])], 4, 20_000.0)
    t = WeightTraffic.of(CM, 4)
    base = simulate(p, lengths, CM).step_s
    assert simulate_mode(p, lengths, CM, "none").step_s == pytest.approx(base + 2 * t.reduce_scatter_s)
    assert simulate_mode(p, lengths, CM, "per_step").step_s == pytest.approx(
        base + t.gather_s + t.reduce_scatter_s
    )
    # per_layer: rounds [[0, 1, 2], [3]]; rank 3's second micro-batch is a round of its own
    s = simulate_mode(p, lengths, CM, "per_layer")
    assert p.rounds is None and s.num_rounds == 2
    m = [CM.micro_batch_time([30_000], 2), CM.micro_batch_time([4_000], 1)]
    m[0] = max(m[0], CM.micro_batch_time([9_000], 1), CM.micro_batch_time([4_000], 1))
    assert s.step_s == pytest.approx(sum(max(x, t.round_s) + t.round_s / t.layers for x in m))
    with pytest.raises(ValueError, match="fsdp mode"):
        simulate_mode(p, lengths, CM, "zero3")


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    cap = draw(st.integers(2_000, 40_000))
    lengths = draw(st.lists(st.integers(1, cap * world), min_size=1, max_size=40))
    return lengths, world, cap


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_rounds_planner_invariants(case):
    lengths, world, cap = case
    p = plan_rounds(lengths, world, cap, CM)
    assert p.fsdp == "per_layer"
    assert plan_violations(p, lengths, cap) == []
    assert round_violations(p) == []
    step = simulate_mode(p, lengths, CM, "per_layer").step_s
    assert p.predicted_step_s == pytest.approx(step)
    assert step >= mode_lower_bound(lengths, CM, world, cap, "per_layer") * (1 - 1e-9)
    # never worse than cutting the barrier-free plan into greedy rounds (one of its candidates)
    greedy = lockstep_rounds(plan(lengths, world, cap, CM), world)
    assert step <= simulate_mode(greedy, lengths, CM, "per_layer").step_s * (1 + 1e-9)
    assert len(round_maxima(p, lengths, CM)) == len(p.rounds)
    # every shelf candidate is valid, not only the one that wins
    L = np.asarray(lengths)
    sizes = normalize_cp_sizes(world)
    kmin = min_cp_index(L, cap, sizes)
    table = _time_table(L, sizes, kmin, cap, CM, world)
    for k in (kmin, np.full_like(kmin, len(sizes) - 1), np.maximum(kmin, (np.arange(L.size) % len(sizes)))):
        for slack in (1.0, 1.3):
            cand = _rounds_to_plan(_shelves(L, k, table, sizes, world, cap, 0.0, slack), world, cap)
            assert plan_violations(cand, lengths, cap) == [] and round_violations(cand) == []


def test_rounds_planner_beats_greedy_rounds_on_a_long_tail():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.choice([2_000, 6_000, 30_000, 120_000], size=48, p=[0.5, 0.3, 0.15, 0.05])]
    lengths[0] = 120_000
    greedy = lockstep_rounds(plan(lengths, 16, 60_000, CM), 16)
    ours = plan_rounds(lengths, 16, 60_000, CM)
    assert ours.predicted_step_s < 0.9 * simulate_mode(greedy, lengths, CM, "per_layer").step_s


def test_plan_for_mode():
    lengths = [5_000, 700, 12_000, 3_000]
    for mode in ("none", "per_step"):
        p = plan_for_mode(lengths, 4, 8_000, CM, mode)
        assert p.fsdp == mode and p.rounds is None
        assert p.micro_batches == plan(lengths, 4, 8_000, CM).micro_batches
    p = plan_for_mode(lengths, 4, 8_000, CM, "per_layer")
    assert p.fsdp == "per_layer" and round_violations(p) == []
    with pytest.raises(ValueError, match="resolve 'auto'"):
        plan_for_mode(lengths, 4, 8_000, CM, "auto")
    # restricted CP sizes are honoured (the world itself is not among them here)
    lengths = [30_000, 900, 2_000, 15_000, 700, 5_000, 31_000]
    p = plan_rounds(lengths, 8, 8_000, CM, cp_sizes=(1, 2, 4))
    assert plan_violations(p, lengths, 8_000, (1, 2, 4)) == [] and round_violations(p) == []
    empty = plan_rounds([], 4, 8_000, CM)
    assert empty.micro_batches == [] and empty.rounds == []


def test_cli_prints_every_mode(capsys):
    argv = ["--workload", "openvid", "--gpus", "16", "--model", "wan-14b", "--batch", "24", "--checkpointing"]
    assert cli.main([*argv, "--methods", "static", "dynamic-cp"]) == 0
    out = capsys.readouterr().out
    assert "weight sharding" in out and "auto picks per_layer" in out
    lines = {
        ln.split()[0]: ln
        for ln in out.splitlines()
        if ln.split() and ln.split()[0].rstrip("*") in ("none", "per_step", "per_layer")
    }
    assert lines["none"].split()[3] == "no" and lines["per_layer*"].split()[3] == "yes"
    assert cli.main([*argv, "--methods", "dynamic-cp", "--fsdp", "off"]) == 0
    assert "weight sharding" not in capsys.readouterr().out
