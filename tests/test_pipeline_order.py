"""dynamic_cp/planning/pipeline_order.py, compare_pipeline.py and ``simulate --pp``: the order keeps
every micro-batch, never steps slower than the input, and the CLI prints the pipeline table."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamic_cp import simulate as cli
from dynamic_cp.planning import pipeline_order
from dynamic_cp.planning.baselines import static_plan
from dynamic_cp.planning.compare_pipeline import compare_pipeline, format_pipeline_rows, work_bound
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.pipeline_order import (
    WARMUPS,
    _mountain,
    _runs,
    apply_move,
    candidate_orders,
    order_for_pipeline,
    plan_for_pipeline,
    round_trips,
    search_moves,
)
from dynamic_cp.planning.pipeline_sim import (
    StageCosts,
    default_stage_layers,
    order_lower_bound,
    simulate_pipeline,
    stage_costs,
)
from dynamic_cp.planning.plan_types import Plan, plan_violations
from dynamic_cp.planning.planner import plan as dynamic_plan
from dynamic_cp.planning.workloads import workload
from tests.test_pipeline_schedule import _runs_to_the_end

CM = CostModel.from_name("wan-1.3b", "h100")
REL = 1e-9  # sums of a few hundred float64 seconds: rounding far below this (see test_pipeline_sim)


def test_mountain_and_runs_by_hand():
    assert _mountain([0, 1, 2, 3, 4], [5.0, 1.0, 3.0, 2.0, 4.0]) == [3, 4, 0, 2, 1]  # trips 2 4 5 3 1
    assert _mountain([7], [0] * 8) == [7] and _mountain([2, 5], [0, 0, 3, 0, 0, 1]) == [2, 5]
    p = Plan([((0,), [0]), ((0,), [1]), ((1,), [2]), ((0,), [3])], 2, 1e9)
    assert _runs(p) == [[0, 1], [2], [3]]


@pytest.mark.parametrize("pp, layers, world", [(2, [15, 15], 8), (3, [10, 10, 10], 4)])
def test_order_keeps_every_micro_batch_and_never_slows(pp, layers, world):
    lengths = workload("openvid", 40, seed=5)
    for p in (dynamic_plan(lengths, world, 30_000, CM), static_plan(lengths, world, 30_000, CM)):
        before = simulate_pipeline(p, lengths, CM, layers).step_s
        out = order_for_pipeline(p, lengths, CM, layers, evals=12)
        assert sorted(map(repr, out.micro_batches)) == sorted(map(repr, p.micro_batches))
        assert [p.micro_batches[i] for i in out.info["pp_order"]] == out.micro_batches
        assert plan_violations(out, lengths, 30_000) == []
        assert out.predicted_step_s <= before * (1 + REL)
        assert out.predicted_step_s == pytest.approx(
            simulate_pipeline(out, lengths, CM, layers).step_s, rel=REL
        )
        assert out.info["pp_evals"] <= 12
        assert order_for_pipeline(p, lengths, CM, layers, evals=12).micro_batches == out.micro_batches


def test_order_beats_the_input_where_runs_can_be_shaped():
    # one rank, a long micro-batch first and last: the shaped run puts short ones at the ends
    lengths = [20_000, 2_000, 8_000, 2_500, 20_000]
    p = Plan([((0,), [i]) for i in range(5)], 1, 1e9)
    out = order_for_pipeline(p, lengths, CM, [15, 15])
    assert out.predicted_step_s < simulate_pipeline(p, lengths, CM, [15, 15]).step_s * 0.97
    assert [lengths[ids[0]] for _, ids in out.micro_batches][-1] == 2_000  # the shortest drains


def test_plan_for_pipeline_is_valid_and_no_slower_than_the_planner_ordered():
    lengths = workload("openvid", 48, seed=2)
    layers = [15, 15]
    out = plan_for_pipeline(lengths, 8, 20_000, CM, layers, evals=10)
    assert plan_violations(out, lengths, 20_000) == [] and out.cap_tokens == 20_000
    plain = order_for_pipeline(dynamic_plan(lengths, 8, 20_000, CM), lengths, CM, layers, evals=10)
    assert out.predicted_step_s <= plain.predicted_step_s * (1 + REL)
    with pytest.raises(ValueError, match="sample"):
        plan_for_pipeline([500_000], 8, 20_000, CM, layers)


def test_compare_pipeline_rows_and_table():
    lengths = workload("openvid", 32, seed=4)
    rows = compare_pipeline(lengths, 2, 4, 30_000, CM, [15, 15], methods=("static", "dynamic-cp", "nope"))
    static, dyn, bad = rows
    assert bad.error and static.error == ""
    for r in (static, dyn):
        c = stage_costs(r.plan, lengths, CM, [15, 15])
        assert r.bound_s == pytest.approx(order_lower_bound(r.plan, c), rel=REL) and r.bound_s <= r.step_s
        assert len(r.stage_bytes) == 2 and r.stage_bytes[0] >= r.stage_bytes[1]  # stage 0 holds more
    assert dyn.step_s <= static.step_s
    bound = work_bound(lengths, CM, 2, 4, 30_000)
    assert bound <= min(static.bound_s, dyn.bound_s)
    text = format_pipeline_rows(rows, bound, CM.hw.memory_bytes)
    assert "nope             failed" in text and "dynamic-cp GB per GPU by stage: stage 0" in text


def test_cli_pp_table_and_gantt(tmp_path, capsys):
    argv = [
        "--model",
        "wan-1.3b",
        "--gpus",
        "16",
        "--pp",
        "2",
        "--workload",
        "openvid",
        "--samples-per-gpu",
        "1",
    ]
    assert cli.main(argv + ["--methods", "static", "dynamic-cp", "--gantt", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "16 GPUs = 2 stages x 8 ranks (1f1b, blocks [15, 15])" in out
    assert "bubble" in out and "order bd" in out and "static " in out and "dynamic-cp " in out
    assert (tmp_path / "g_dynamic-cp_16_pp2.png").stat().st_size > 5_000


def test_cli_pp_errors(capsys):
    base = ["--model", "wan-1.3b", "--workload", "openvid", "--samples-per-gpu", "1", "--methods", "static"]
    assert cli.main(base + ["--gpus", "8", "--pp", "3"]) != 0
    assert "does not divide the world of 8 ranks" in capsys.readouterr().err
    assert cli.main(base + ["--gpus", "8", "--pp", "2", "--pp-layers", "30"]) != 0
    assert "--pp-layers lists 1 stages" in capsys.readouterr().err
    assert cli.main(base + ["--gpus", "4", "--pp", "4", "--cap", "2000"]) != 0
    assert "a CP group has at most 1 ranks: add --checkpointing" in capsys.readouterr().err


def test_dry_run_shows_the_pipeline_estimate(tmp_path, capsys):
    from conftest import tiny_overrides

    import train

    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    over = tiny_overrides(tmp_path, **{"parallel.mode": "dynamic", "parallel.pp_size": 2})
    assert train.main(["--config", tiny, *over, "--dry-run", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages x 2 ranks, blocks [1, 1], parallel.pp_schedule=1f1b; first step" in out
    assert "bubble" in out and "stage 0 (ranks 0-1):" in out and "stage 1 (ranks 2-3):" in out
    assert "first step's plan:" not in out  # the plan over the whole world is not what runs
    assert train.main(["--config", tiny, *over, "--dry-run", "--world-size", "3"]) == 1
    assert "pipeline: parallel.pp_size=2 does not divide the world of 3 ranks" in capsys.readouterr().out


def test_round_trips_by_hand():
    costs = StageCosts(
        [[1.0, 9.0], [2.0, 9.0], [4.0, 9.0]], [[8.0, 1], [16.0, 1], [32.0, 1]], [[0.25, 0], [0.5, 1]], [0] * 3
    )
    assert round_trips(costs) == [2 + 4 + 16 + 32 + 2 * 0.75, 9 + 9 + 1 + 1 + 2 * 1]


def _mixed_plan():
    # runs: (0, 1) x3, then (0,) x2, then (1,) x1
    groups = [(0, 1)] * 3 + [(0,)] * 2 + [(1,)]
    return Plan([(g, [5, 6] if i == 5 else [i]) for i, g in enumerate(groups)], 2, 1e9)


def test_candidate_orders_by_hand():
    trip = [3.0, 1.0, 2.0, 5.0, 4.0, 0.5]
    assert candidate_orders(_mixed_plan(), trip) == [
        [0, 1, 2, 3, 4, 5],
        [2, 0, 1, 3, 4, 5],  # run [0, 1, 2] by trip 1 < 2 < 3: second shortest first, shortest last
        [3, 4, 5, 2, 0, 1],  # CP 1 runs first (by size, then planner order), then the CP 2 run
    ]


def test_search_moves_and_apply_by_hand():
    runs = [[0, 1, 2, 3], [4], [5, 6, 7]]
    trip = [1.0, 1.0, 1.0, 1.0, 0.5, 2.0, 0.1, 0.1]
    assert search_moves(runs, trip) == [
        ("swap", 7, 6), ("swap", 5, 6),  # the run with the longest trip first
        ("swap", 3, 1), ("swap", 0, 1), ("swap", 3, 2), ("swap", 0, 2),
        ("runs", 0), ("runs", 1),
    ]  # fmt: skip
    order = [10, 11, 12, 13, 14, 15, 16, 17]
    assert apply_move(order, ("swap", 3, 1), runs) == [10, 13, 12, 11, 14, 15, 16, 17]
    assert apply_move(order, ("runs", 0), runs) == [14, 10, 11, 12, 13, 15, 16, 17]
    assert apply_move(order, ("runs", 1), runs) == [10, 11, 12, 13, 15, 16, 17, 14]
    assert order == [10, 11, 12, 13, 14, 15, 16, 17]  # not changed in place


def test_order_takes_the_best_candidate_then_searches_within_budget():
    lengths = [30_000, 2_000, 9_000, 4_000, 25_000, 1_000, 7_000]
    p = _mixed_plan()
    layers = [10, 10, 10]
    trip = round_trips(stage_costs(p, lengths, CM, layers))
    steps = [
        simulate_pipeline(Plan([p.micro_batches[i] for i in o], 2, 1e9), lengths, CM, layers).step_s
        for o in candidate_orders(p, trip)
    ]
    quick = order_for_pipeline(p, lengths, CM, layers, evals=3)
    assert quick.info["pp_evals"] == 3 and quick.predicted_step_s == pytest.approx(min(steps), rel=REL)
    assert quick.info["pp_order"] == candidate_orders(p, trip)[steps.index(min(steps))]
    full = order_for_pipeline(p, lengths, CM, layers, evals=1000)
    assert full.info["pp_evals"] == 3 + 2 + 2  # two swaps in the 3-long run, two run swaps
    assert full.predicted_step_s <= quick.predicted_step_s
    four = order_for_pipeline(p, lengths, CM, layers, evals=4)
    assert four.info["pp_evals"] == 4


def test_plan_for_pipeline_tries_each_size_set_and_cap(monkeypatch):
    import dynamic_cp.planning.planner as planner

    calls, real = [], planner.plan
    monkeypatch.setattr(
        planner, "plan", lambda L, R, cap, cm, cp=None: calls.append((cap, cp)) or real(L, R, cap, cm, cp)
    )
    lengths = workload("openvid", 24, seed=6)
    plan_for_pipeline(lengths, 16, 32_000, CM, [15, 15], evals=4)
    caps = [32_000 * f for f in (1.0, 0.5, 0.375, 0.25, 0.125)]
    tried = [(c, (1, 2, 4, 8, 16)) for c in caps] + [(c, (8, 16)) for c in caps]
    assert calls[: len(tried)] == tried[: len(calls)] and len(calls) >= 5
    calls.clear()
    plan_for_pipeline(lengths, 4, 32_000, CM, [15, 15], evals=4)  # a stage inside a node: the whole stage
    assert {cp for _, cp in calls} == {(1, 2, 4), (4,)} and pipeline_order.NUM_CANDIDATES == 3
    calls.clear()
    plan_for_pipeline([1_000] * 4, 1, 32_000, CM, [15, 15], evals=4)  # one rank: one size set
    assert calls == [(32_000 * f, (1,)) for f in (1.0, 0.5, 0.375, 0.25, 0.125)]
    calls.clear()
    plan_for_pipeline(lengths, 16, 32_000, CM, [15, 15], evals=4, cp_sizes=[1, 2, 16])  # the run's sizes
    assert {cp for _, cp in calls} == {(1, 2, 16), (16,)}


def _small_random(seed):
    import random

    rng = random.Random(seed)
    n = rng.randint(4, 7)
    lengths = [rng.choice([1_000, 4_000, 9_000, 20_000, 30_000]) for _ in range(n)]
    return Plan([(rng.choice([(0,), (1,), (0, 1)]), [i]) for i in range(n)], 2, 1e9), lengths


def test_local_search_on_random_plans():
    improved = 0
    for seed in range(25):
        p, lengths = _small_random(seed)
        before = simulate_pipeline(p, lengths, CM, [15, 15]).step_s
        quick = order_for_pipeline(p, lengths, CM, [15, 15], evals=3)
        full = order_for_pipeline(p, lengths, CM, [15, 15], evals=1000)  # every move, runs joining
        assert sorted(full.info["pp_order"]) == list(range(len(lengths)))
        assert full.predicted_step_s <= quick.predicted_step_s <= before * (1 + REL)
        improved += full.predicted_step_s < quick.predicted_step_s * (1 - 1e-6)
    assert improved >= 5  # the swaps do find better orders than the shaped candidates
    p, lengths = _small_random(4)  # seed 4: swaps take 1.04 s to 0.81 s
    assert order_for_pipeline(p, lengths, CM, [15, 15]).predicted_step_s < 0.8 * (
        order_for_pipeline(p, lengths, CM, [15, 15], evals=3).predicted_step_s
    )


def test_ties_keep_the_input_order_and_the_default_budget():
    same = Plan([((0,), [i]) for i in range(4)], 1, 1e9)
    out = order_for_pipeline(same, [5_000] * 4, CM, [15, 15], evals=1000)
    assert out.info["pp_order"] == [0, 1, 2, 3]  # no equal-step swap taken
    # one run of 26 one-clip micro-batches: 48 swaps + 3 candidates > the default 24 replays
    lengths = [20_000 + 100 * i for i in range(26)]
    long_run = Plan([((0,), [i]) for i in range(26)], 1, 30_000, solver_ms=1.0)
    out = order_for_pipeline(long_run, lengths, CM, [15, 15])
    assert out.info["pp_evals"] == 24 and out.solver_ms > 1.0
    # one cap fits; the winner's 24 replays, then its warm-ups 2 and 3 (too deep for these sizes)
    planned = plan_for_pipeline(lengths, 1, 30_000, CM, [15, 15])
    assert planned.info["pp_evals"] == 24 + len(WARMUPS) - 1 and planned.pp_warmup == 1


def test_one_stage_has_no_round_trip_and_keeps_a_valid_order():
    p, lengths = _small_random(3)
    out = order_for_pipeline(p, lengths, CM, [30])
    assert round_trips(stage_costs(p, lengths, CM, [30])) == [0.0] * len(lengths)
    assert out.predicted_step_s <= simulate_pipeline(p, lengths, CM, [30]).step_s * (1 + REL)


def test_plan_for_pipeline_keeps_the_best_candidate_under_the_pipeline(monkeypatch):
    import time

    import dynamic_cp.planning.planner as planner

    lengths = workload("openvid", 48, seed=2)
    layers = [15, 15]
    made, real = [], planner.plan
    monkeypatch.setattr(planner, "plan", lambda *a: made.append(real(*a)) or made[-1])
    t0 = time.perf_counter()
    out = plan_for_pipeline(lengths, 8, 30_000, CM, layers, evals=3)
    wall_ms = (time.perf_counter() - t0) * 1e3
    quick = [
        order_for_pipeline(
            p, lengths, CM, layers, evals=3, warmups=WARMUPS, memory_cap=30_000
        ).predicted_step_s
        for p in made
    ]
    assert out.predicted_step_s == pytest.approx(min(quick), rel=REL)  # priced on the stages, not flat
    assert len(set(round(q, 9) for q in quick)) > 1  # the candidates differ, so the choice matters
    assert 0 < out.solver_ms <= wall_ms  # milliseconds of this call


def test_plan_for_pipeline_raises_the_planners_error_when_nothing_fits():
    with pytest.raises(ValueError, match="sample 0 has 500000 tokens.*cap 20000 tokens/rank x CP 8"):
        plan_for_pipeline([500_000], 8, 20_000, CM, [15, 15])


def test_work_bound_terms_and_row_memory():
    from dynamic_cp.planning.pipeline_memory import stage_memory
    from dynamic_cp.planning.simulator import best_single_time

    many = [2_000] * 64
    assert work_bound(many, CM, 2, 4, 30_000) == pytest.approx(CM.ideal_time(many).sum() / 8, rel=REL)
    one = [60_000, 1_000]
    assert work_bound(one, CM, 2, 4, 30_000) == best_single_time(60_000, CM, 4, 30_000)
    lengths = workload("openvid", 16, seed=8)
    (row,) = compare_pipeline(lengths, 2, 8, 30_000, CM, [15, 15], methods=("static",))
    for p, tokens in enumerate(row.schedule.peak_tokens):
        states, act = stage_memory(CM.dims, [15, 15], p, 8, False)
        assert row.stage_bytes[p] == pytest.approx(states + tokens * act, rel=REL)
    assert row.gb_per_gpu == pytest.approx(max(row.stage_bytes) / 1e9, rel=REL)
    assert row.stage_bytes[0] != row.stage_bytes[1]
    empty = compare_pipeline(lengths, 2, 8, 30_000, CM, [15, 15], methods=("nope-" + "x" * 100,))[0]
    assert len(empty.error) == 120 and empty.gb_per_gpu != empty.gb_per_gpu  # truncated; NaN


def test_table_columns():
    lengths = workload("openvid", 16, seed=8)
    rows = compare_pipeline(lengths, 2, 8, 30_000, CM, [15, 15], methods=("dynamic-cp", "static"))
    dyn, static = rows
    peak = max(dyn.stage_bytes)
    text = format_pipeline_rows(rows, 1.0, peak / 0.95)  # 95% of HBM: over the 90% budget
    line = next(x for x in text.splitlines() if x.startswith("dynamic-cp "))
    assert f"{static.step_s / dyn.step_s:.2f}x" in line and " no " in line
    assert line.endswith(" ".join(f"{c}:{n}" for c, n in dyn.cp_sizes.items()))
    assert " yes " in format_pipeline_rows(rows, 1.0, peak / 0.85).splitlines()[2]
    # the per-stage line is dynamic-cp's even when another row comes first
    last = format_pipeline_rows([static, dyn], 1.0, peak).splitlines()[-1]
    assert (
        last
        == "dynamic-cp GB per GPU by stage: "
        + ", ".join(f"stage {p} {b / 1e9:.1f}" for p, b in enumerate(dyn.stage_bytes))
        + f"; 1F1B warm-up {dyn.plan.pp_warmup} x (pp - stage - 1)"
    )
    assert "by stage" not in format_pipeline_rows([static], 1.0, peak)


@st.composite
def _pipeline_cases(draw):
    R, pp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([2, 3, 4]))
    n = draw(st.integers(1, 9))
    lengths = draw(st.lists(st.sampled_from([500, 2_000, 6_000, 15_000, 30_000]), min_size=n, max_size=n))
    groups = [g for c in (1, 2, 4) if c <= R for g in (tuple(range(s, s + c)) for s in range(0, R, c))]
    plan = Plan(
        [(draw(st.sampled_from(groups)), [i]) for i in range(n)], R, draw(st.sampled_from([3e4, 1e5]))
    )
    return plan, lengths, default_stage_layers(CM.dims, pp)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_pipeline_cases(), st.sampled_from(["1f1b", "gpipe"]), st.integers(3, 20))
def test_warm_ups_never_slow_the_order_and_keep_1f1b_memory(case, schedule, evals):
    plan, lengths, layers = case
    pp, cap = len(layers), plan.cap_tokens
    old = order_for_pipeline(plan, lengths, CM, layers, schedule, evals)
    new = order_for_pipeline(plan, lengths, CM, layers, schedule, evals, WARMUPS, cap)
    assert new.info["pp_order"] == old.info["pp_order"]  # the searched order, then a warm-up
    assert sorted(new.info["pp_order"]) == list(range(len(lengths)))  # every micro-batch once
    assert [plan.micro_batches[i] for i in new.info["pp_order"]] == new.micro_batches
    assert new.info["pp_evals"] <= old.info["pp_evals"] + len(WARMUPS) - 1
    s = simulate_pipeline(new, lengths, CM, layers, schedule)
    assert s.step_s == pytest.approx(new.predicted_step_s, rel=REL)
    if new.pp_warmup == 1:
        assert new.predicted_step_s == old.predicted_step_s
    else:  # deeper only where faster, under 1F1B, within plain 1F1B's memory at the cap
        assert schedule == "1f1b" and new.predicted_step_s < old.predicted_step_s
        assert all(held <= (pp - p) * cap for p, held in enumerate(s.peak_tokens))
    groups = [ranks for ranks, _ in new.micro_batches]
    assert _runs_to_the_end(groups, plan.world_size, pp, schedule, new.pp_warmup)  # no deadlock


def test_a_deeper_warm_up_where_small_micro_batches_leave_memory():
    # one rank, 3 stages, small and large micro-batches alternating, each far under a 40,000 cap:
    # plain 1F1B stalls stage 0 on each large one's round trip, a deeper warm-up covers it
    lengths = [2_000, 12_000] * 5
    p = Plan([((0,), [i]) for i in range(10)], 1, 40_000)
    layers = default_stage_layers(CM.dims, 3)
    plain = order_for_pipeline(p, lengths, CM, layers, evals=3)
    deep = order_for_pipeline(p, lengths, CM, layers, evals=3, warmups=WARMUPS)
    assert deep.pp_warmup > 1 and deep.predicted_step_s < plain.predicted_step_s * 0.99
    s = simulate_pipeline(deep, lengths, CM, layers)
    assert max(s.peak_tokens) > 3 * 12_000  # more in flight than plain 1F1B's 3 on stage 0 ...
    assert all(held <= (3 - q) * 40_000 for q, held in enumerate(s.peak_tokens))  # ... within its memory
    # a cap of the largest micro-batch leaves no room: plain 1F1B it stays
    tight = order_for_pipeline(p, lengths, CM, layers, evals=3, warmups=WARMUPS, memory_cap=12_000)
    assert tight.pp_warmup == 1 and tight.predicted_step_s == plain.predicted_step_s
    assert order_for_pipeline(p, lengths, CM, layers, "gpipe", 3, WARMUPS).pp_warmup == 1  # 1F1B only
    # plan_for_pipeline keeps the warm-up it found, and its cap, for the runtime to run
    planned = plan_for_pipeline(lengths, 1, 40_000, CM, layers)
    assert planned.pp_warmup > 1 and planned.cap_tokens == 40_000
    assert planned.predicted_step_s == pytest.approx(
        simulate_pipeline(planned, lengths, CM, layers).step_s, rel=REL
    )


def test_which_warm_up_fits_which_memory():
    # one rank, 3 stages, micro-batches of at most 20,000 tokens; memory_cap 40,000 (packs at half
    # the cap). A: warm-up 2 is the fastest that fits (3 is no faster). B: warm-up 3 is, holding
    # 64,000 tokens on stage 0 (3 x 21,333) and 50,000 on stage 1 (2 x 25,000): a cap of exactly
    # 25,000 still holds it (stage 1 at its limit), 24,000 does not on stage 1 alone (stage 0 has
    # 3 x 24,000 = 72,000), so warm-up 2 (56,000 and 44,000) is kept.
    layers = default_stage_layers(CM.dims, 3)

    def warmup_of(lengths, memory_cap):
        p = Plan([((0,), [i]) for i in range(len(lengths))], 1, 20_000)
        return order_for_pipeline(p, lengths, CM, layers, evals=3, warmups=WARMUPS, memory_cap=memory_cap)

    a = [20_000, 2_000, 6_000, 20_000, 12_000, 20_000, 1_000, 20_000, 1_000]
    assert warmup_of(a, 40_000).pp_warmup == 2
    b = [2_000, 20_000, 6_000, 6_000, 1_000, 1_000, 12_000, 12_000, 1_000, 6_000]
    deep = warmup_of(b, 40_000)
    assert deep.pp_warmup == 3
    assert simulate_pipeline(deep, b, CM, layers).peak_tokens == [64_000, 50_000, 20_000]
    assert warmup_of(b, 25_000).pp_warmup == 3
    assert warmup_of(b, 24_000).pp_warmup == 2
