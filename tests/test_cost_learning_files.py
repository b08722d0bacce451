"""cost_learning.py's files and wiring: the learner a config builds, the saved profile, the timeline
rows the Gantt chart reads, the prior on resume, and a layout's time (fast, one process)."""

from __future__ import annotations

import json

import pytest

from dit.config import load_config
from dit.setup import model_config_of
from dynamic_cp.planning.cost_model import CostModel, Hardware
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.simulator import simulate
from dynamic_cp.runtime.cost_learning import (
    PROFILE_FILE,
    STATE_FILE,
    TIMELINES_FILE,
    _layout_time,
    build_learner,
    load_prior,
    write_timeline,
)

PRIOR = CostModel.from_name("wan-1.3b", "h100")


def _cfg(*items):
    return load_config(None, ["parallel.mode=dynamic", "parallel.hardware=h100", *items])


def test_the_learner_follows_the_config():
    cfg = _cfg("parallel.refit_every=7", "parallel.explore_budget=0.25", "parallel.cap_tokens=5000")
    learner = build_learner(cfg, model_config_of(cfg.model), None, None, start_step=4, resume_dir=None)
    assert (learner.plan_lag, learner.learn, learner.refit_every, learner.explore) == (1, True, 7, True)
    assert (learner.explore_budget, learner.cap_tokens, learner.cp_sizes, learner.first_step) == (
        0.25,
        5000,
        (1,),
        4,
    )
    assert learner.prior.hw == Hardware.load("h100")
    off = _cfg("parallel.plan_ahead=false", "parallel.learn_costs=false", "parallel.explore_budget=0")
    learner = build_learner(off, model_config_of(off.model), None, None, start_step=0, resume_dir=None)
    assert (learner.plan_lag, learner.learn, learner.explore) == (0, False, False)
    assert (
        build_learner(
            _cfg("parallel.explore_budget=0"), model_config_of(off.model), None, None, 0, None
        ).explore
        is False
    )
    a100 = _cfg("parallel.hardware=a100")
    assert build_learner(a100, model_config_of(a100.model), None, None, 0, None).prior.hw == Hardware.load(
        "a100"
    )
    static = _cfg("parallel.mode=static")
    assert build_learner(static, model_config_of(static.model), None, None, 0, None).explore is False


def test_resume_restores_the_learners_state_and_profile(tmp_path):
    cfg = _cfg(f"output_dir={tmp_path}")
    learner = build_learner(cfg, model_config_of(cfg.model), None, None, 0, None)
    learner.num_refits = 3
    learner._speeds.append((2, 1.5))
    step_dir = tmp_path / "step"
    step_dir.mkdir()
    (step_dir / STATE_FILE).write_text(json.dumps(learner.state_dict()))
    resumed = build_learner(cfg, model_config_of(cfg.model), None, None, 2, step_dir)
    auto = _cfg(
        f"output_dir={tmp_path}", "parallel.hardware=auto"
    )  # the saved state is the prior: no measuring
    restored = build_learner(auto, model_config_of(auto.model), None, None, 2, step_dir)
    assert restored.prior.hw == learner.prior.hw and restored.num_refits == 3
    assert learner.model_at(2).hw != learner.prior.hw  # the fit at speed 1.5 from step 2
    assert resumed.num_refits == 3 and resumed.model_at(2).hw == learner.model_at(2).hw
    # the saved profile: the newest model, with a header naming the step and the window
    path = learner.save(tmp_path / "out" / "run", 12)  # folders made as needed
    assert path == tmp_path / "out" / "run" / PROFILE_FILE
    text = path.read_text()
    assert text.startswith("# Learned by the training run at step 12 from 0 micro-batches\n")
    assert Hardware.load(str(path)) == learner.model.hw
    # hardware: auto on --resume reads the run's learned profile back as the prior
    assert load_prior("auto", tmp_path / "out" / "run", resume=True) == learner.model.hw
    assert load_prior("auto", tmp_path / "out" / "run", resume=False) is None
    assert load_prior("h100", tmp_path / "out" / "run", resume=True) is None
    assert load_prior("auto", tmp_path / "elsewhere", resume=True) is None


def test_timeline_rows_hold_measured_and_planned_times(tmp_path):
    lengths = [3000, 1000, 500]
    plan = Plan([((0, 1), [0]), ((0,), [1]), ((1,), [2])], 2, 4000.0)
    plan.info["layouts"] = [(2, 1), (1, 1), (1, 1)]
    measured = [(0.0, 0.25, 0.125), (0.25, 0.0625, 0.0), (0.25, 0.03125, 0.0)]
    write_timeline(tmp_path, 7, plan, lengths, PRIOR, measured)
    write_timeline(tmp_path, 8, plan, lengths, PRIOR, measured)  # appended, one line a step
    lines = (tmp_path / TIMELINES_FILE).read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [7, 8]
    record = json.loads(lines[0])
    planned = simulate(plan, lengths, PRIOR)
    assert record["world_size"] == 2
    rows = record["micro_batches"]
    assert [r["ranks"] for r in rows] == [[0, 1], [0], [1]]
    assert [r["lengths"] for r in rows] == [[3000], [1000], [500]]
    assert [r["layout"] for r in rows] == [[2, 1], [1, 1], [1, 1]]
    assert [(r["start"], r["seconds"], r["comm_s"]) for r in rows] == measured
    assert [r["planned_s"] for r in rows] == [round(t, 6) for t in planned.mb_times]
    assert rows[0]["planned_start"] == 0.0 and rows[1]["planned_start"] == pytest.approx(
        planned.mb_times[0], abs=1e-6
    )


def test_a_layouts_time_is_the_cheapest_time_plus_its_extra_cost():
    L = [20000, 12000]
    best = PRIOR.micro_batch_time(L, 4, False)
    assert _layout_time(PRIOR, L, 1, (1, 1), False) == PRIOR.micro_batch_time(L, 1, False)
    times = {lay: _layout_time(PRIOR, L, 4, lay, False) for lay in PRIOR.cp_layout(4)}
    assert min(times.values()) == pytest.approx(best, rel=1e-12)
    assert times[PRIOR.layout(L, 4)] == pytest.approx(best, rel=1e-12)
    assert len(set(times.values())) == len(times)  # each layout priced on its own
