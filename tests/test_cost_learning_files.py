"""cost_learning.py's files and wiring: the learner a config builds, the saved profile, the timeline
rows the Gantt chart reads, the prior on resume, and a layout's time (fast, one process)."""

from __future__ import annotations

import json

import pytest

from dit.config import load_config
from dit.setup import model_config_of
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.hardware import Hardware
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


def test_timeline_rows_are_rounded_to_microseconds_in_folders_made_as_needed(tmp_path):
    """Every time of a timeline row is rounded to 6 decimals (microseconds), planned ones too; a plan
    without recorded layouts writes 1x1 rows; the run folder and its parents are made as needed.
    Planted: each round(.., 6) as round(.., 7), the default layout (2, 1) or (1, 2), mkdir without
    parents -> this test fails."""
    lengths = [3000, 1000, 500]
    plan = Plan([((0,), [0]), ((0,), [1]), ((1,), [2])], 2, 4000.0)  # no plan.info["layouts"]
    measured = [(0.0, 0.123456789, 0.012345678), (0.123456789, 0.0654321987, 0.0), (0.0, 0.0312345678, 0.0)]
    run_dir = tmp_path / "a" / "b"
    write_timeline(run_dir, 3, plan, lengths, PRIOR, measured)
    rows = json.loads((run_dir / TIMELINES_FILE).read_text())["micro_batches"]
    assert [r["layout"] for r in rows] == [[1, 1]] * 3
    assert [(r["start"], r["seconds"], r["comm_s"]) for r in rows] == [
        (0.0, 0.123457, 0.012346),
        (0.123457, 0.065432, 0.0),
        (0.0, 0.031235, 0.0),
    ]
    planned = simulate(plan, lengths, PRIOR)
    assert rows[1]["planned_start"] == round(planned.mb_times[0], 6) != planned.mb_times[0]


def test_the_profile_is_saved_again_at_every_checkpoint(tmp_path):
    """Saving the learned profile into a run folder that holds one already overwrites it (every
    checkpoint saves it). Planted: mkdir without exist_ok -> FileExistsError here."""
    cfg = _cfg(f"output_dir={tmp_path}")
    learner = build_learner(cfg, model_config_of(cfg.model), None, None, 0, None)
    learner.save(tmp_path / "run", 10)
    path = learner.save(tmp_path / "run", 20)
    assert path.read_text().startswith("# Learned by the training run at step 20 ")


def test_a_learner_built_without_the_knobs_uses_the_documented_defaults():
    """CostLearner's keyword defaults are the config's: refits at 2, 4, 8, then every 10 steps, a
    10% exploration budget; it plans for CP 1 only; it skips one start-up step; the fit's window
    is the newest 1024 micro-batches. Planted: refit_every 11, budget 0.2, cp_sizes (2,), two skipped
    steps, MAX_OBSERVATIONS 1025, the window without maxlen -> this test fails."""
    from dit.config import ParallelConfig
    from dynamic_cp.runtime.cost_learning import MAX_OBSERVATIONS, CostLearner

    def one_clip_a_rank(model, lengths):
        plan = Plan([((i,), [i]) for i in range(len(lengths))], len(lengths), 4000.0)
        plan.predicted_step_s = 1.0
        return plan

    learner = CostLearner(PRIOR, one_clip_a_rank, start_step=0, plan_lag=0)
    defaults = ParallelConfig()
    assert (learner.refit_every, learner.explore_budget) == (defaults.refit_every, defaults.explore_budget)
    assert [s for s in range(1, 32) if learner.refit_due(s)] == [2, 4, 8, 10, 20, 30]
    assert learner.explore_budget == 0.1 and learner.wanted == [(1, (1, 1))]
    frozen = CostLearner(PRIOR, one_clip_a_rank, start_step=0, plan_lag=0, learn=False)
    lengths = [1000] * 100
    for s in range(12):  # 11 observed steps of 100 micro-batches: the first 76 drop out of the window
        plan = frozen.plan(lengths)
        frozen.observe(s, plan, lengths, [(0.0, s + m / 1000, 0.0) for m in range(100)])
    assert MAX_OBSERVATIONS == 1024 and len(frozen.observations) == 1024
    assert frozen.observations[0].seconds == 1 + 76 / 1000  # step 0 skipped, step 1's 77th is oldest
    assert frozen.observations[-1].seconds == 11 + 99 / 1000


def test_a_layouts_time_is_what_a_model_restricted_to_it_charges():
    """A packed micro-batch of clips of different lengths at a given layout costs what a model that
    only knows that layout (comm 'ring': 1 x c, 'ulysses': c x 1) charges: the layout's traffic is
    the whole micro-batch's tokens, the attention the ring hides behind is all its clips'. Planted:
    the attention or the tokens summed as a max, base + cheapest -> this test fails."""
    L = [3000, 500, 200]
    for comm, layout in (("ring", (1, 4)), ("ulysses", (4, 1))):
        only = CostModel(PRIOR.dims, PRIOR.hw, comm)
        assert _layout_time(PRIOR, L, 4, layout, False) == pytest.approx(
            only.micro_batch_time(L, 4, False), rel=1e-12
        )  # the same float operations up to base - cheapest + t: a few ulps
    assert _layout_time(PRIOR, L, 4, (1, 4), False) > PRIOR.micro_batch_time(L, 4, False)  # not the cheapest


def test_hardware_auto_on_resume_reads_the_runs_profile_else_measures(tmp_path):
    """parallel.hardware=auto, resuming from a checkpoint without the learner's state: the prior is
    the run's saved profile (learned_profile.yaml); without that either, this machine is measured
    (a 'cpu-auto' profile, a few seconds on the tiny model). Planted: the state check's 'and' as 'or',
    'is not' as 'is', the profile path used unread, the resume check's 'and' as 'or', the measuring
    given the config or the model's dims instead of the profile -> this test fails."""
    import torch

    tiny = ["model.size=tiny", "parallel.hardware=auto"]
    cfg = _cfg(f"output_dir={tmp_path / 'run'}", *tiny)
    profile = CostModel.from_name("wan-1.3b", "a100").hw
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / PROFILE_FILE).write_text(profile.to_yaml())
    step_dir = tmp_path / "run" / "checkpoints" / "step_000004"
    step_dir.mkdir(parents=True)  # a checkpoint written without cost_learning.json
    resumed = build_learner(cfg, model_config_of(cfg.model), None, torch.device("cpu"), 4, step_dir)
    assert resumed.prior.hw == profile
    fresh = _cfg(f"output_dir={tmp_path / 'other'}", *tiny)
    measured = build_learner(fresh, model_config_of(fresh.model), None, torch.device("cpu"), 4, step_dir)
    assert measured.prior.hw.name == "cpu-auto"


def test_the_learner_explores_the_cp_sizes_of_the_world():
    """On 4 ranks in dynamic mode the learner wants every allowed CP size (1, 2, 4) and its layouts,
    not CP 1 alone (a real one-process 'fake' process group of size 4 stands for the world).
    Planted: build_learner not passing cp_sizes -> this test fails."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = _cfg()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        learner = build_learner(cfg, model_config_of(cfg.model), dist.group.WORLD, None, 0, None)
    finally:
        dist.destroy_process_group()
    assert learner.cp_sizes == (1, 2, 4)
    assert {c for c, _ in learner.wanted} == {1, 2, 4}
