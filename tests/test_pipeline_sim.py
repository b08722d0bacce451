"""dynamic_cp/planning/pipeline_sim.py and planning/pipeline_memory.py: hand-computed pipeline
steps, the op order the runtime runs, the bound under every order, per-stage memory."""

from __future__ import annotations

import itertools
import random

import pytest

from dynamic_cp.planning import memory, pipeline_memory
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.fsdp_cost import simulate_mode
from dynamic_cp.planning.model_dims import MODELS
from dynamic_cp.planning.pipeline_schedule import rank_ops, stage_ops
from dynamic_cp.planning.pipeline_sim import (
    StageCosts,
    default_stage_layers,
    gantt_pipeline,
    order_lower_bound,
    pipeline_ops,
    simulate_pipeline,
    stage_costs,
    stage_extras,
    stage_shares,
)
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.planner import plan as dynamic_plan
from dynamic_cp.planning.workloads import workload

CM = CostModel.from_name("wan-1.3b", "h100")
TWO = [15, 15]  # wan-1.3b has 30 blocks

# Tolerances: every time below is a sum of at most a few hundred float64 terms of size <= 1e3 s, so
# rounding stays under 1e-10 s; 1e-9 relative leaves room and is still far below any planted bug.
REL = 1e-9


def _two_by_two(sync=(1.0, 7.0), p2p=(0.5, 0.25)):
    """2 stages, 2 micro-batches on one rank, with costs set by hand."""
    plan = Plan([((0,), [0]), ((0,), [1])], 1, 1e9)
    costs = StageCosts([[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]], [list(p2p)], list(sync))
    return plan, costs


def test_two_stages_two_micro_batches_by_hand():
    plan, costs = _two_by_two()
    s = simulate_pipeline(plan, [10, 20], CM, TWO, "1f1b", costs=costs)
    # stage 0: F0 0-1, F1 1-3; stage 1: F0 1.5-4.5, B0 4.5-11.5, F1 11.5-15.5, B1 15.5-23.5;
    # stage 0: B0 (11.5 + 0.5) 12-17, B1 (23.5 + 0.25) 23.75-29.75
    assert s.segments[0][0] == [(0, 1, 0, "F"), (1, 3, 1, "F"), (12, 17, 0, "B"), (23.75, 29.75, 1, "B")]
    assert s.segments[1][0] == [
        (1.5, 4.5, 0, "F"),
        (4.5, 11.5, 0, "B"),
        (11.5, 15.5, 1, "F"),
        (15.5, 23.5, 1, "B"),
    ]
    assert s.compute_s == 29.75 and s.stage_end == [29.75, 23.5]
    assert s.step_s == max(29.75 + 1.0, 23.5 + 7.0)
    assert s.busy_s == 36.0 and s.bubble_fraction() == pytest.approx(1 - 36 / (2 * 29.75), rel=REL)
    assert s.peak_tokens == [30.0, 20.0]  # stage 0 holds both micro-batches, stage 1 one at a time
    # bound: stage 1 waits 1.5 (F0 + p2p), works 22, then max(tail 5.5, its sync 7)
    assert order_lower_bound(plan, costs) == 1.5 + 22 + 7


def test_gpipe_by_hand_and_its_memory():
    plan, costs = _two_by_two()
    s = simulate_pipeline(plan, [10, 20], CM, TWO, "gpipe", costs=costs)
    assert s.segments[1][0] == [
        (1.5, 4.5, 0, "F"),
        (4.5, 8.5, 1, "F"),
        (8.5, 15.5, 0, "B"),
        (15.5, 23.5, 1, "B"),
    ]
    assert s.segments[0][0][2:] == [(16, 21, 0, "B"), (23.75, 29.75, 1, "B")]
    assert s.peak_tokens == [30.0, 30.0]


def test_p2p_delays_the_receiver():
    plan, costs = _two_by_two(p2p=(0.0, 0.0))
    quick = simulate_pipeline(plan, [10, 20], CM, TWO, costs=costs)
    slow = simulate_pipeline(plan, [10, 20], CM, TWO, costs=_two_by_two(p2p=(2.0, 2.0))[1])
    assert quick.segments[1][0][0][0] == 1.0 and slow.segments[1][0][0][0] == 3.0
    assert slow.compute_s > quick.compute_s


def test_one_stage_is_the_plain_simulator_plus_the_all_reduce():
    lengths = workload("openvid", 24, seed=3)
    p = dynamic_plan(lengths, 8, 27_000, CM)
    s = simulate_pipeline(p, lengths, CM, [30])
    assert s.step_s == pytest.approx(simulate_mode(p, lengths, CM, "none").step_s, rel=REL)
    assert s.peak_tokens[0] == max(sum(lengths[i] for i in ids) / len(r) for r, ids in p.micro_batches)


def test_stage_costs_split_the_cost_model():
    lengths = [9_000, 3_000, 40_000]
    p = Plan([((0, 1), [0, 1]), ((2, 3), [2])], 4, 40_000)
    c = stage_costs(p, lengths, CM, TWO)
    total = CM.micro_batch_times([[9_000, 3_000], [40_000]], [2, 2])
    fwd = CM.forward().micro_batch_times([[9_000, 3_000], [40_000]], [2, 2])
    for m in range(2):
        assert sum(c.fwd[q][m] for q in range(2)) == pytest.approx(fwd[m], rel=REL)
        assert sum(c.fwd[q][m] + c.bwd[q][m] for q in range(2)) == pytest.approx(total[m], rel=REL)
        assert 1.5 < c.bwd[0][m] / c.fwd[0][m] < 3  # about 1:2, from the FLOPs
    hw, d = CM.hw, CM.dims.d
    # stage 0 ranks 0-3 and stage 1 ranks 4-7 share a node of 8: the intra-node link
    nbytes = (12_000 / 2 + 2 * CM.dims.context_tokens) * d * 2
    assert c.p2p[0][0] == pytest.approx(hw.intra_node_latency_s + nbytes / hw.intra_node_bandwidth, rel=REL)
    far = stage_costs(Plan(p.micro_batches, 8, 40_000), lengths, CM, TWO)  # stage 1 = ranks 8-15
    assert far.p2p[0][0] == pytest.approx(hw.inter_node_latency_s + nbytes / hw.inter_node_bandwidth, rel=REL)
    params = pipeline_memory.stage_params(CM.dims, TWO, 0)
    assert c.sync[0] == pytest.approx(
        2 * (15 * hw.intra_node_latency_s + 4 * params * 3 / 4 / hw.intra_node_bandwidth), rel=REL
    )


def test_stage_shares_and_extras():
    first, last = stage_extras(CM.dims)
    assert first == last == 2 * 1536 * 128 / 2 / (12 * 1536**2 + 4 * 1536 * 8960)
    shares = stage_shares(CM.dims, TWO)
    assert sum(shares) == pytest.approx(1.0, rel=REL) and shares[0] == shares[1]
    uneven = stage_shares(CM.dims, [10, 20])
    assert uneven[0] == pytest.approx((10 + first) / (30 + 2 * first), rel=REL)
    assert default_stage_layers(CM.dims, 4) in ([8, 7, 7, 8], [7, 8, 8, 7])
    with pytest.raises(ValueError, match="sum to the model's 30 blocks"):
        stage_shares(CM.dims, [10, 10])
    with pytest.raises(ValueError, match="positive"):
        stage_shares(CM.dims, [30, 0])


def _random_plan(rng, R, n):
    groups = [g for c in (1, 2, 4) if c <= R for g in (tuple(range(s, s + c)) for s in range(0, R, c))]
    return Plan([(rng.choice(groups), [m]) for m in range(n)], R, 1e9)


def _random_costs(rng, pp, n, sync=True):
    rows = lambda: [[rng.uniform(0.1, 3.0) for _ in range(n)] for _ in range(pp)]  # noqa: E731
    p2p = [[rng.uniform(0.0, 0.5) for _ in range(n)] for _ in range(pp - 1)]
    return StageCosts(rows(), rows(), p2p, [rng.uniform(0, 4) if sync else 0.0 for _ in range(pp)])


def _permute(plan, costs, order):
    pick = lambda rows: [[row[i] for i in order] for row in rows]  # noqa: E731
    return (
        Plan(
            [plan.micro_batches[i] for i in order], plan.world_size, plan.cap_tokens, pp_warmup=plan.pp_warmup
        ),
        StageCosts(pick(costs.fwd), pick(costs.bwd), pick(costs.p2p), costs.sync),
    )


@pytest.mark.parametrize("schedule, warmup", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2)])
def test_bound_never_exceeds_any_order(schedule, warmup):
    rng = random.Random(7)
    for _ in range(12):
        pp, R, n = rng.choice([(2, 2, 4), (3, 2, 4), (2, 4, 5), (4, 1, 4), (2, 1, 5), (3, 1, 5)])
        plan, costs = _random_plan(rng, R, n), _random_costs(rng, pp, n)
        plan.pp_warmup = warmup
        bound = order_lower_bound(plan, costs, schedule)
        steps = []
        for order in itertools.permutations(range(n)):
            p, c = _permute(plan, costs, list(order))
            assert order_lower_bound(p, c, schedule) == pytest.approx(bound, rel=REL)  # order-free
            steps.append(simulate_pipeline(p, [1] * n, CM, [1] * pp, schedule, costs=c).step_s)
        assert bound <= min(steps) * (1 + REL)


def test_bound_counts_fill_and_drain_of_distinct_micro_batches_by_hand():
    # one rank, 2 stages, a tiny micro-batch and two big ones; f = 0.1, 1, 1 and b = 0.2, 2, 2 on
    # both stages, free p2p. Stage 1 (no round trip): the first and the last micro-batch differ, so
    # head + tail >= min(0.1 + 2, 1 + 0.2) = 1.2 over work 6.3: 7.5 (head and tail both of the tiny
    # one gave 6.6). Stage 0 (warm-up 1): a big one's round trip 3 less one forward 1 leaves 2 to wait
    # if first, less one backward 2 leaves 1 if last; the tiny one waits nothing: 6.3 + 1 = 7.3.
    plan = Plan([((0,), [m]) for m in range(3)], 1, 1e9)
    f, b = [0.1, 1.0, 1.0], [0.2, 2.0, 2.0]
    costs = StageCosts([f, f], [b, b], [[0.0] * 3], [0.0, 0.0])
    assert order_lower_bound(plan, costs) == pytest.approx(7.5, rel=REL)
    steps = []
    for order in itertools.permutations(range(3)):
        p, c = _permute(plan, costs, list(order))
        steps.append(simulate_pipeline(p, [1] * 3, CM, [1, 1], costs=c).step_s)
    assert min(steps) >= 7.5 * (1 - REL)
    # stage 0 binds when stage 1 is free and each boundary costs 1.5 each way: every round trip is
    # 3; under 1F1B the first waits 3 - 1 (one forward), the last 3 - 2 (one backward): 6.3 + 3; the
    # tiny one first and last would have waited nothing (the old bound: 6.3). Order 0, 1, 2 replays
    # at exactly 9.3. Stage 1: 0 work + min(0.1 + 2, 1 + 0.2) + 2 x 1.5 = 4.2.
    free = [0.0] * 3
    costs = StageCosts([f, free], [b, free], [[1.5] * 3], [0.0, 0.0])
    assert order_lower_bound(plan, costs) == pytest.approx(9.3, rel=REL)
    assert simulate_pipeline(plan, [1] * 3, CM, [1, 1], costs=costs).step_s == pytest.approx(9.3, rel=REL)
    # GPipe: the other two forwards cover the first's round trip but 1 (3 - 2), and the waits may
    # overlap, so only the larger counts: 6.3 + 1
    assert order_lower_bound(plan, costs, "gpipe") == pytest.approx(7.3, rel=REL)
    deep = Plan(plan.micro_batches, 1, 1e9, pp_warmup=2)  # 1F1B, warm-up 2 of 3: GPipe's op list
    assert order_lower_bound(deep, costs) == pytest.approx(7.3, rel=REL)
    assert simulate_pipeline(deep, [1] * 3, CM, [1, 1], costs=costs).step_s >= 7.3 * (1 - REL)
    for order in itertools.permutations(range(3)):
        p, c = _permute(plan, costs, list(order))
        for schedule, bound in (("1f1b", 9.3), ("gpipe", 7.3)):
            assert simulate_pipeline(p, [1] * 3, CM, [1, 1], schedule, costs=c).step_s >= bound * (1 - REL)
    # a single micro-batch waits its own round trip once
    one = Plan([((0,), [0])], 1, 1e9)
    assert order_lower_bound(one, StageCosts([[1.0], [2.0]], [[3.0], [4.0]], [[0.5]], [0.0, 0.0])) == 11.0
    # ... and a middle stage with a long all-reduce binds: head 1 + 0.25, work 2 + 16, its round
    # trip 4 + 32 + 2 x 0.5, then sync 100 (over its tail 8.25): 156.25, the replay's step
    costs = StageCosts([[1.0], [2.0], [4.0]], [[8.0], [16.0], [32.0]], [[0.25], [0.5]], [0.0, 100.0, 0.0])
    assert order_lower_bound(one, costs) == 156.25
    assert simulate_pipeline(one, [1], CM, [1, 1, 1], costs=costs).step_s == 156.25


def test_bound_of_a_middle_stage_by_hand():
    # one rank, 3 stages; stage 1 binds: f = 0.1, 1, 1 and b = 0.2, 2, 2; stage 0 costs 0.01 each
    # way, stage 2 0.5; p2p 0.25 on boundary 0, 0.5 on boundary 1. Stage 1: head 0.01 + 0.25, tail
    # the same; every round trip 0.5 + 0.5 (stage 2) + 2 x 0.5 (boundary 1 only) = 2; warm-up 1:
    # one other forward (at most 1) covers 1 of the first's trip, one backward (2) all of the
    # last's: 6.3 + 0.26 + 1 + 0 + 0.26 = 7.82, which the best order replays exactly.
    f1, b1, tiny = [0.1, 1.0, 1.0], [0.2, 2.0, 2.0], [0.01] * 3

    def bound_and_best(f0, b0, warmup):
        costs = StageCosts([f0, f1, [0.5] * 3], [b0, b1, [0.5] * 3], [[0.25] * 3, [0.5] * 3], [0.0] * 3)
        plan = Plan([((0,), [m]) for m in range(3)], 1, 1e9, pp_warmup=warmup)
        steps = [
            simulate_pipeline(p, [1] * 3, CM, [1, 1, 1], costs=c).step_s
            for p, c in (_permute(plan, costs, list(o)) for o in itertools.permutations(range(3)))
        ]
        return order_lower_bound(plan, costs), min(steps)

    bound, best = bound_and_best(tiny, tiny, 1)
    assert bound == pytest.approx(7.82, rel=REL) and best == pytest.approx(7.82, rel=REL)
    # warm-up 2: two other forwards (1.1 or 2) cover the trip but 0.9 (micro-batch 0 first: 0), and
    # the waits may overlap (3 micro-batches, not more than 2 + 1): 6.3 + 0.26 + 0 + 0.26
    bound, best = bound_and_best(tiny, tiny, 2)
    assert bound == pytest.approx(6.82, rel=REL) and bound <= best
    # micro-batch 0 now has the shortest head and tail (0.26 against 0.55 and 0.85), but it cannot
    # be both first and last: 6.3 + min(0.26 + 0 + 0.85, 0.55 + 0.9 + 0.26) = 7.41
    bound, best = bound_and_best([0.01, 0.3, 0.3], [0.01, 0.6, 0.6], 2)
    assert bound == pytest.approx(7.41, rel=REL) and bound <= best


def test_replay_without_timeline_keeps_every_figure():
    rng = random.Random(11)
    for _ in range(6):
        plan, costs = _random_plan(rng, 4, 6), _random_costs(rng, 3, 6)
        full = simulate_pipeline(plan, [1] * 6, CM, [1] * 3, costs=costs)
        fast = simulate_pipeline(plan, [1] * 6, CM, [1] * 3, costs=costs, timeline=False)
        assert (fast.step_s, fast.stage_end, fast.busy_s, fast.peak_tokens) == (
            full.step_s, full.stage_end, full.busy_s, full.peak_tokens)  # fmt: skip
        assert fast.segments == [[[] for _ in range(4)] for _ in range(3)]
        assert all(full.segments[p][r] for p in range(3) for r in range(4) if any(
            r in g for g, _ in plan.micro_batches))  # fmt: skip


def test_bound_is_tight_for_equal_micro_batches():
    # one rank, n equal micro-batches, free p2p, 1F1B: (n + pp - 1)(f + b), which the bound reaches
    for pp, n in ((2, 3), (3, 5), (4, 4)):
        plan = Plan([((0,), [m]) for m in range(n)], 1, 1e9)
        costs = StageCosts([[1.0] * n] * pp, [[2.0] * n] * pp, [[0.0] * n] * (pp - 1), [0.0] * pp)
        s = simulate_pipeline(plan, [1] * n, CM, [1] * pp, costs=costs)
        assert s.step_s == pytest.approx((n + pp - 1) * 3.0, rel=REL)
        assert order_lower_bound(plan, costs) == pytest.approx(s.step_s, rel=REL)
    # one micro-batch crosses every stage and back: the bound counts each p2p both ways, once
    one = Plan([((0,), [0])], 1, 1e9)
    costs = StageCosts([[1.0], [2.0], [4.0]], [[8.0], [16.0], [32.0]], [[0.25], [0.5]], [0.0] * 3)
    s = simulate_pipeline(one, [1], CM, [1, 1, 1], costs=costs)
    assert s.step_s == order_lower_bound(one, costs) == 63 + 2 * 0.75
    assert [s.segments[p][0][0][0] for p in range(3)] == [0, 1.25, 3.75]  # each boundary its own p2p


@pytest.mark.parametrize("schedule, warmup", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2)])
def test_each_rank_runs_the_schedules_ops_in_order(schedule, warmup):
    rng = random.Random(1)
    for pp, R, n in ((2, 4, 9), (3, 2, 7), (4, 4, 11)):
        plan = _random_plan(rng, R, n)
        plan.pp_warmup = warmup
        s = simulate_pipeline(plan, [1] * n, CM, [1] * pp, schedule, costs=_random_costs(rng, pp, n))
        for p in range(pp):
            for r, runs in enumerate(plan.per_rank()):
                ran = [(kind, m) for _, _, m, kind in s.segments[p][r]]
                assert ran == rank_ops(stage_ops(n, pp, p, schedule, warmup), runs)
        busy = sum(e - b for stage in s.segments for segs in stage for b, e, _, _ in segs)
        assert s.busy_s == pytest.approx(busy, rel=REL)  # every rank of a group is busy
        want = [stage_ops(n, pp, p, schedule, warmup) for p in range(pp)]
        assert pipeline_ops(plan, pp, schedule) == want
        for p in range(pp):  # collectives: a micro-batch's ranks start and end it together
            for m, (ranks, _) in enumerate(plan.micro_batches):
                spans = {seg[:2] for r in ranks for seg in s.segments[p][r] if seg[2] == m and seg[3] == "F"}
                assert len(spans) == 1


def test_barriers_make_each_group_its_own_pipeline():
    rng = random.Random(2)
    plan = _random_plan(rng, 2, 6)
    plan.barriers_after = (2,)
    costs = _random_costs(rng, 2, 6, sync=False)
    s = simulate_pipeline(plan, [1] * 6, CM, [1, 1], costs=costs, barrier_s=0.125)
    first = max(e for stage in s.segments for segs in stage for _, e, m, _ in segs if m <= 2)
    later = min(st for stage in s.segments for segs in stage for st, _, m, _ in segs if m > 2)
    assert later == pytest.approx(first + 0.125, rel=REL)
    ops = pipeline_ops(plan, 2, "1f1b")
    assert ops[0] == stage_ops(3, 2, 0) + [(k, m + 3) for k, m in stage_ops(3, 2, 0)]
    free = Plan(plan.micro_batches, 2, 1e9)
    assert simulate_pipeline(free, [1] * 6, CM, [1, 1], costs=costs).step_s < s.step_s


def test_empty_plan():
    s = simulate_pipeline(Plan([], 2, 1e9), [], CM, TWO)
    assert s.step_s == 0.0 and s.bubble_fraction() == 0.0


def test_stage_memory_and_the_pipeline_cap():
    dims = MODELS["wan-14b"]
    layers = [20, 20]
    total = sum(pipeline_memory.stage_params(dims, layers, p) for p in range(2))
    assert total == pytest.approx(dims.num_params, rel=REL)
    assert pipeline_memory.stage_params(dims, [40], 0) == pytest.approx(dims.num_params, rel=REL)
    states, act = pipeline_memory.stage_memory(dims, layers, 1, 32)
    P = pipeline_memory.stage_params(dims, layers, 1)
    assert states == pytest.approx(2 * P + 14 * P / 32, rel=REL)
    assert act == pytest.approx(memory.activation_bytes_per_token(dims) / 2, rel=REL)
    gpu = 80e9
    cap = pipeline_memory.pipeline_token_cap(dims, gpu, layers, 32)
    # 1F1B: stage 0 holds 2 micro-batches in flight, stage 1 one; the tightest decides
    fits = [pipeline_memory.stage_memory(dims, layers, p, 32) for p in range(2)]
    assert all(s + (2 - p) * cap * a <= 0.9 * gpu for p, (s, a) in enumerate(fits))
    assert any(s + (2 - p) * (cap + 1) * a > 0.9 * gpu for p, (s, a) in enumerate(fits))
    with pytest.raises(ValueError, match="states do not fit.*parallel.pp_size"):
        pipeline_memory.pipeline_token_cap(dims, 20e9, layers, 1)


def test_gantt_has_a_row_per_stage_and_rank(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    plan, costs = _two_by_two()
    s = simulate_pipeline(plan, [10, 20], CM, TWO, costs=costs)
    gantt_pipeline(s, plan, str(tmp_path / "g.png"), "pp")
    ax = kept[0].axes[0]
    assert len(ax.collections) == 2 and [t.get_text() for t in ax.get_yticklabels()] == ["s0 r0", "s1 r0"]
    faces = ax.collections[0].get_facecolor()
    assert list(faces[:, 3]) == [0.45, 0.45, 1.0, 1.0]  # forwards light, backwards solid
    assert (tmp_path / "g.png").stat().st_size > 3_000
    plt.close(kept[0])


def test_p2p_link_per_boundary_and_one_row_per_boundary():
    # 4 stages of 4 ranks, 8 GPUs a node: stages 0-1 on node 0, 2-3 on node 1
    lengths = [4_000, 4_000]
    p = Plan([((1, 2), [0]), ((0,), [1])], 4, 40_000)
    c = stage_costs(p, lengths, CM, [8, 7, 7, 8])
    assert len(c.p2p) == 3 and len(c.fwd) == len(c.bwd) == len(c.sync) == 4
    hw = CM.hw
    near, far = hw.intra_node_latency_s, hw.inter_node_latency_s
    nbytes = (2_000 + CM.dims.context_tokens) * CM.dims.d * 2
    assert [c.p2p[b][0] for b in range(3)] == pytest.approx(
        [
            near + nbytes / hw.intra_node_bandwidth,
            far + nbytes / hw.inter_node_bandwidth,
            near + nbytes / hw.intra_node_bandwidth,
        ],
        rel=REL,
    )


def test_packed_micro_batch_peak_and_small_bubble():
    plan = Plan([((0,), [0, 1])], 1, 1e9)
    s = simulate_pipeline(plan, [10, 20], CM, TWO)
    assert s.peak_tokens == [30.0, 30.0] and s.compute_s < 1
    busy = sum(e - b for stage in s.segments for segs in stage for b, e, _, _ in segs)
    assert (
        s.bubble_fraction() == pytest.approx(1 - busy / (2 * s.compute_s), rel=REL)
        and s.bubble_fraction() > 0.4
    )


def test_barrier_edges_and_default_cost():
    rng = random.Random(3)
    plan = _random_plan(rng, 2, 5)
    costs = _random_costs(rng, 2, 5, sync=False)

    def step(*b, **kw):
        p = Plan(plan.micro_batches, 2, 1e9, barriers_after=b)
        return simulate_pipeline(p, [1] * 5, CM, [1, 1], costs=costs, **kw).step_s

    free = step()
    assert step(4) == free  # after the last micro-batch: nothing waits
    assert step(0) > free and step(3) > free
    assert step(2, 2, barrier_s=0.5) == step(2, barrier_s=0.5)
    assert step(2) == step(2, barrier_s=CM.hw.intra_node_latency_s)  # 2 stages x 2 ranks: one node
    node = Plan(plan.micro_batches, 4, 1e9, barriers_after=(2,))  # 2 x 4 ranks: a full node of 8
    assert (
        simulate_pipeline(node, [1] * 5, CM, [1, 1], costs=costs).step_s
        == simulate_pipeline(
            node, [1] * 5, CM, [1, 1], costs=costs, barrier_s=CM.hw.intra_node_latency_s
        ).step_s
    )
    big = Plan(plan.micro_batches, 8, 1e9, barriers_after=(2,))
    kw = dict(costs=_random_costs(random.Random(4), 2, 5, sync=False))
    assert (
        simulate_pipeline(big, [1] * 5, CM, [1, 1], **kw).step_s
        == simulate_pipeline(big, [1] * 5, CM, [1, 1], barrier_s=CM.hw.inter_node_latency_s, **kw).step_s
    )  # 16 ranks span two nodes


def test_bound_of_idle_ranks_small_and_empty_plans():
    plan = Plan([((0,), [0])], 3, 1e9)  # ranks 1 and 2 run nothing
    costs = StageCosts([[0.125], [0.25]], [[0.0625], [0.03125]], [[0.0]], [0.0, 0.0])
    assert order_lower_bound(plan, costs) == 0.125 + 0.25 + 0.03125 + 0.0625
    assert order_lower_bound(Plan([], 2, 1e9), StageCosts([[], []], [[], []], [[]], [0.0, 0.0])) == 0.0


def test_gantt_colours_by_cp_size_and_titles_itself(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    plan = Plan([((0, 1), [0])], 2, 1e9)
    s = simulate_pipeline(plan, [4_000], CM, TWO)
    gantt_pipeline(s, plan, str(tmp_path / "g.png"))
    ax = kept[0].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["CP 2"]
    assert ax.get_title() == f"step {s.step_s:.3f} s" and len(ax.collections) == 4
    plt.close(kept[0])


def test_one_block_stage_and_empty_peaks():
    assert stage_shares(CM.dims, [1, 29])[0] < 0.05
    assert simulate_pipeline(Plan([], 2, 1e9), [], CM, TWO).peak_tokens == [0.0, 0.0]
