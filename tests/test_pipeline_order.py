"""dynamic_cp/planning/pipeline_order.py, compare_pipeline.py and ``simulate --pp``: the order keeps
every micro-batch, never steps slower than the input, and the CLI prints the pipeline table."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamic_cp import simulate as cli
from dynamic_cp.planning.baselines import static_plan
from dynamic_cp.planning.compare_pipeline import compare_pipeline, format_pipeline_rows, work_bound
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.pipeline_order import _mountain, _runs, order_for_pipeline, plan_for_pipeline
from dynamic_cp.planning.pipeline_sim import order_lower_bound, simulate_pipeline, stage_costs
from dynamic_cp.planning.plan_types import Plan, plan_violations
from dynamic_cp.planning.planner import plan as dynamic_plan
from dynamic_cp.planning.workloads import workload

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
