"""Online cost learning in the runtime: refits take effect at a fixed step whatever the plan-ahead
thread does, exploration is bounded and keeps plans valid, and on 4 gloo ranks every rank fits
bitwise the same coefficients and plans identically; the learned profile feeds the simulator."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist

from dit.config import load_config
from dynamic_cp.planning.cost_fit import Observation
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.cost_recovery import true_cluster
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.plan_types import Plan, plan_violations
from dynamic_cp.planning.planner import plan as dynamic_plan
from dynamic_cp.runtime.cost_learning import PROFILE_FILE, CostLearner
from dynamic_cp.runtime.testing import run_gloo

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
PRIOR = CostModel.from_name("wan-1.3b", "h100")
W, CAP = 8, 40000


def _learner(**kw) -> CostLearner:
    return CostLearner(
        PRIOR,
        lambda model, lengths: dynamic_plan(lengths, W, CAP, model, cp_sizes=(1, 2, 4, 8)),
        cp_sizes=(1, 2, 4, 8),
        cap_tokens=CAP,
        **kw,
    )


def _measure(plan: Plan, lengths, true: CostModel) -> list[tuple[float, float, float]]:
    return [
        (0.0, true.micro_batch_time([lengths[i] for i in ids], len(r)), 0.0) for r, ids in plan.micro_batches
    ]


@pytest.mark.parametrize("plan_lag", [0, 1])
def test_refit_takes_effect_at_a_fixed_step(plan_lag):
    """A refit after step s is used by the plan of step s + 1 + lag, not before (with plan-ahead the
    plan of s + 1 may already have run), so every rank's thread plans with the same model."""
    true = true_cluster(PRIOR)
    learner = _learner(start_step=0, plan_lag=plan_lag, refit_every=2, skip_steps=0, explore=False)
    lengths = [30000, 20000, 9000, 5000, 3000, 2000, 1000, 800] * 2
    plans = [learner.plan(lengths) for _ in range(1 + plan_lag)]  # what is planned before step 0 ends
    for s in range(4):
        assert learner.observe(s, plans[s], lengths, _measure(plans[s], lengths, true)) == (s % 2 == 1)
        plans.append(learner.plan(lengths))
    versions = [p.info["model_step"] for p in plans]
    # refits after steps 1 and 3, effective at 2 + lag and 4 + lag; plans of steps 0 .. 4 + lag
    # (planted: plans counted two steps apart -> fails)
    assert versions == [0] * (2 + plan_lag) + [2 + plan_lag] * 2 + [4 + plan_lag]
    assert learner.model.hw != PRIOR.hw


def test_the_speed_factor_follows_a_cluster_that_slows_down():
    """The cluster runs 1.3x slower from step 8 (clocks, a neighbour job): the fit, refitted every
    4 steps over its whole window, would lag; the per-step speed factor (median of the last 3
    steps' measured / fitted ratio) has predictions track the slower truth from step 10 on (step 8
    and 9 observed, effective one step later), while the plans themselves stay the same."""
    import random

    from dynamic_cp.planning.simulator import simulate

    rng = random.Random(0)
    fast = true_cluster(PRIOR)
    slow = fast.scaled(1.3)
    learner = _learner(start_step=0, plan_lag=0, refit_every=4, skip_steps=0, explore=False)
    lengths = [30000, 20000, 9000, 5000, 3000, 2000, 1000, 800] * 2
    errors = {}
    for s in range(14):
        true = slow if s >= 8 else fast
        plan = learner.plan(lengths)
        errors[s] = abs(plan.predicted_step_s / simulate(plan, lengths, true).step_s - 1)
        measured = [
            (a, secs * (1 + 0.02 * rng.uniform(-1, 1)), c) for a, secs, c in _measure(plan, lengths, true)
        ]
        learner.observe(s, plan, lengths, measured)
        # what the Gantt chart draws as planned: the model this plan used, after newer ones came
        assert simulate(plan, lengths, learner.model_at(s)).step_s == pytest.approx(plan.predicted_step_s)
    assert max(errors[s] for s in (5, 6, 7)) < 0.03  # the fit alone, before the slow-down
    assert errors[8] > 0.2  # nothing could know yet
    assert max(errors[s] for s in range(10, 14)) < 0.03
    assert learner.plan(lengths).info["speed"] == pytest.approx(1.3, rel=0.05)
    # the newest model (what the saved profile holds) is the fit at the newest pace, as the plans use
    # (planted: the property without the speed factor -> fails)
    assert learner.model.hw == learner.model_at(15).hw != learner._models[-1][1].hw
    unscaled = learner.make_plan(learner._models[-1][1], lengths)
    assert learner.plan(lengths).micro_batches == unscaled.micro_batches


def test_the_speed_factor_is_relative_to_the_fit_in_use():
    """A prior 50x too fast: after step 0 the speed factor is above 30 (measured / prior); the refit
    after step 1 explains what steps 0 and 1 measured, so the factor is about 1 again (the recent
    steps are re-priced under the new fit, not kept at the prior's seconds)."""
    true = true_cluster(PRIOR)
    learner = CostLearner(
        PRIOR.scaled(1 / 50),
        lambda model, lengths: dynamic_plan(lengths, W, CAP, model, cp_sizes=(1, 2, 4, 8)),
        cp_sizes=(1, 2, 4, 8),
        cap_tokens=CAP,
        start_step=0,
        plan_lag=0,
        refit_every=4,
        skip_steps=0,
        explore=False,
    )
    lengths = [30000, 9000, 3000, 800] * 4
    speeds = []
    for s in range(2):
        plan = learner.plan(lengths)
        speeds.append(plan.info["speed"])
        learner.observe(s, plan, lengths, _measure(plan, lengths, true))
    assert speeds[0] == 1.0 and speeds[1] > 30  # the prior alone, then the prior at the measured pace
    assert learner.plan(lengths).info["speed"] == pytest.approx(1.0, rel=0.02)  # the fit's own pace


def test_exploration_is_bounded_and_keeps_plans_valid():
    learner = _learner(start_step=0, plan_lag=0, explore_budget=0.5)
    lengths = [25000] * 32  # 4 clips a rank, each fits one: the planner alone runs them at CP 1
    plan = learner.plan(lengths)
    assert plan_violations(plan, lengths, CAP, (1, 2, 4, 8)) == []
    # one micro-batch runs a CP size the planner did not pick, to learn its cost
    assert plan.info["explored"].startswith("cp2 ")
    assert any(len(r) == 2 for r, _ in plan.micro_batches)
    assert 0 <= plan.info["explore_s"] <= 0.5 * (plan.predicted_step_s - plan.info["explore_s"]) + 1e-12
    # once every (size, layout) has been seen enough, exploration stops
    for c, layout in learner.wanted:
        learner._seen[(c, layout)] = 10
    learner.observe(0, plan, lengths, [(0.0, 0.0, 0.0)] * len(plan.micro_batches))
    assert "explored" not in learner.plan(lengths).info
    frozen = _learner(start_step=0, plan_lag=0, learn=False)
    assert "explored" not in frozen.plan(lengths).info  # learn_costs=false: no exploration either


def test_state_round_trips_for_exact_resume():
    learner = _learner(start_step=0, plan_lag=1, refit_every=1, skip_steps=0)
    lengths = [30000, 9000, 3000, 800] * 4
    true = true_cluster(PRIOR)
    for s in range(3):
        p = learner.plan(lengths)
        learner.observe(s, p, lengths, _measure(p, lengths, true))
    state = json.loads(json.dumps(learner.state_dict()))
    again = _learner(start_step=3, plan_lag=1)
    again.load_state_dict(state)
    assert again.model.hw == learner.model.hw and again.prior.hw == learner.prior.hw
    assert list(again.observations) == list(learner.observations)
    learner._next_plan_step = 3
    a, b = learner.plan(lengths), again.plan(lengths)
    assert a.micro_batches == b.micro_batches and a.info == b.info


# ---------------------------------------------------------------------------------------- 4 ranks


def _overrides(out: str) -> list[str]:
    items = {
        "output_dir": out,
        "model.overrides": "{num_layers: 2, patch_size: [1, 4, 4]}",
        "data.num_clips": 64,
        "data.num_val_clips": 1,
        "data.frame_counts": "[1, 5]",
        "data.resolutions": "[[16, 16], [32, 16]]",
        "flow.val_sigmas": "[0.5]",
        "train.global_batch_size": 8,
        "train.micro_batch_tokens": 200,
        "train.log_every": 1,
        "train.max_steps": 4,
        "train.checkpoint_every": 4,
        "parallel.mode": "dynamic",
        "parallel.cap_tokens": 96,
        "parallel.hardware": "auto",  # a CPU measurement at start-up, averaged over the ranks
        "parallel.refit_every": 1,
        "parallel.explore_budget": 1.0,
    }
    return [f"{k}={v}" for k, v in items.items()]


def _worker(rank: int, world_size: int, root: str) -> dict:
    from dynamic_cp.runtime.distributed_trainer import DistributedTrainer

    try:
        trainer = DistributedTrainer(load_config(CONFIG, _overrides(root)), dist.group.WORLD)
        batches = trainer.data_iterator()
        plans, models = [], []
        for _ in range(4):
            batch = next(batches)
            plans.append(json.dumps([batch.plan.micro_batches, batch.plan.info]))
            trainer.train_step(batch)
            trainer.step += 1
            state = trainer.learner.state_dict()
            models.append(json.dumps([state["models"], state["speeds"]]))
        batches.close()
        trainer.save()
        return {"plans": plans, "models": models, "refits": trainer.learner.num_refits}
    except Exception:
        return {"error": traceback.format_exc()}


@pytest.mark.timeout(900)  # 4 spawned ranks on a shared 2-core machine
def test_four_ranks_fit_bitwise_equal_coefficients_and_identical_plans(tmp_path):
    out = run_gloo(_worker, 4, str(tmp_path / "run"), timeout_s=400)
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    assert out[0]["refits"] >= 2
    for res in out[1:]:
        assert res["models"] == out[0]["models"]  # JSON of floats: repr round-trips, so bitwise
        assert res["plans"] == out[0]["plans"]
    # the learned profile is a hardware profile: the simulator and the cost model read it
    profile = tmp_path / "run" / PROFILE_FILE
    hw = Hardware.load(str(profile))
    assert hw.name.startswith("learned-")
    from dynamic_cp.simulate import main as simulate_main

    # (--cap: the profile's memory is this machine's RAM, too small for wan-1.3b's longest clips)
    args = ["--workload", "opensora", "--gpus", "8", "--cap", "100000", "--hardware", str(profile)]
    assert simulate_main(args) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004" / "cost_learning.json"
    assert json.loads(ckpt.read_text())["observations"]  # what a resumed run restores


def test_unused_observation_fields_are_checked():
    with pytest.raises(ValueError):
        Observation((), 1, (1, 1), False, 1.0)


def test_one_slow_step_does_not_move_the_speed_factor():
    """A straggler step (3x slower: a hiccup on one node) between normal ones: the median of the last
    3 steps' ratios ignores it, so the next plans keep the fit's pace (a mean would predict 1.67x, a
    max 3x); two slow steps of the last three are followed. refit_every=100: refits after 2, 4 and 8
    steps only (the last one's window holds the straggler, so the fit's pace is a few percent off)."""
    true = true_cluster(PRIOR)
    learner = _learner(start_step=0, plan_lag=0, refit_every=100, skip_steps=0, explore=False)
    lengths = [30000, 9000, 3000, 800] * 4
    speeds = {}
    for s in range(11):
        slow = 3.0 if s in (4, 8, 9, 10) else 1.0
        plan = learner.plan(lengths)
        speeds[s] = plan.info["speed"]
        learner.observe(
            s, plan, lengths, [(a, secs * slow, c) for a, secs, c in _measure(plan, lengths, true)]
        )
    for s in (5, 6, 7):  # after the straggler of step 4
        assert speeds[s] == pytest.approx(1.0, rel=0.03)
    assert speeds[9] == pytest.approx(1.0, rel=0.03)  # one slow step of the last three
    assert 2.7 < speeds[10] < 3.3  # two of three: the cluster is slower now
    assert 2.7 < learner.plan(lengths).info["speed"] < 3.3


def test_refits_at_2_4_8_then_every_k_steps_and_skipped_steps_are_not_observed():
    learner = _learner(start_step=0, plan_lag=0, refit_every=10, skip_steps=2, explore=False)
    assert [s for s in range(1, 32) if learner.refit_due(s)] == [2, 4, 8, 10, 20, 30]
    true = true_cluster(PRIOR)
    lengths = [30000, 9000, 3000, 800] * 4
    refits, sizes = [], []
    for s in range(5):
        plan = learner.plan(lengths)
        measured = _measure(plan, lengths, true)
        if s == 3:  # a micro-batch whose timing was lost (0 s) is not an observation
            measured[0] = (0.0, 0.0, 0.0)
        refits.append(learner.observe(s, plan, lengths, measured))
        sizes.append(len(learner.observations))
    n = len(plan.micro_batches)
    assert sizes == [0, 0, n, 2 * n - 1, 3 * n - 1]  # steps 0 and 1 skipped (one-off start-up costs)
    assert refits == [False, False, False, True, False]  # after 2 steps there was nothing to fit yet
    assert learner.num_refits == 1
    late = _learner(start_step=5, plan_lag=0, refit_every=10, skip_steps=2, explore=False)  # a resumed run
    for s in range(5, 8):
        plan = late.plan(lengths)
        late.observe(s, plan, lengths, _measure(plan, lengths, true))
    assert len(late.observations) == n  # steps 5 and 6 are its start-up steps


def test_exploration_stops_at_three_observations_of_a_size_and_layout():
    learner = _learner(start_step=0, plan_lag=0, explore_budget=0.5)
    lengths = [25000] * 32
    for key in learner.wanted:
        learner._seen[key] = 3
    plan = learner.plan(lengths)
    learner.observe(0, plan, lengths, [(0.0, 0.0, 0.0)] * len(plan.micro_batches))
    assert "explored" not in learner.plan(lengths).info  # 3 of each seen: MIN_OBSERVATIONS
    learner._seen[learner.wanted[-1]] = 2
    learner.observe(1, plan, lengths, [(0.0, 0.0, 0.0)] * len(plan.micro_batches))
    assert "explored" in learner.plan(lengths).info


def test_frozen_costs_plan_with_the_prior_forever():
    learner = _learner(start_step=5, plan_lag=0, refit_every=1, skip_steps=0, learn=False)
    true = true_cluster(PRIOR)
    lengths = [30000, 9000, 3000, 800] * 4
    for s in range(5, 9):
        plan = learner.plan(lengths)
        assert (plan.info["model_step"], plan.info["speed"], plan.info["explore_s"]) == (5, 1.0, 0.0)
        assert learner.observe(s, plan, lengths, _measure(plan, lengths, true)) is False
    assert learner.model is PRIOR and learner.num_refits == 0


def test_exploration_moves_the_micro_batch_whose_move_the_model_prices_lowest():
    """4 ranks, one clip each at CP 1 (a hand-built plan); the missing key is CP 2 with a given layout.
    Moving clip 0 (the longest) onto ranks 0-1 shortens the step, clips 2 and 3 can move onto ranks
    2-3 without lengthening it, clip 1 lengthens it. Under the cheapest layout (1x2 for all of them)
    every free move costs 0 and the first is taken; a forced 2x1 layout costs each clip its own extra
    seconds, so the shortest free one (clip 3, 12000 tokens) is moved."""
    from dynamic_cp.planning.simulator import simulate
    from dynamic_cp.runtime.cost_learning import MIN_OBSERVATIONS

    lengths = [30000, 4000, 20000, 12000]

    def one_clip_a_rank(model, lengths):
        plan = Plan([((i,), [i]) for i in range(4)], 4, CAP)
        plan.predicted_step_s = simulate(plan, lengths, model, timeline=False).step_s
        return plan

    base = one_clip_a_rank(PRIOR, lengths).predicted_step_s
    assert PRIOR.cp_layout(2) == [(1, 2), (2, 1)] and all(PRIOR.layout([n], 2) == (1, 2) for n in lengths)
    plans = {}
    for layout in PRIOR.cp_layout(2):
        learner = CostLearner(PRIOR, one_clip_a_rank, start_step=0, plan_lag=0, explore_budget=1.0,
                              cp_sizes=(1, 2), cap_tokens=CAP)  # fmt: skip
        first = learner.plan(lengths)
        for key in learner.wanted:
            learner._seen[key] = 0 if key == (2, layout) else MIN_OBSERVATIONS
        learner.observe(0, first, lengths, [(0.0, 0.0, 0.0)] * 4)  # publishes the counts
        plans[layout] = learner.plan(lengths)
    cheap, forced = plans[(1, 2)], plans[(2, 1)]
    assert cheap.micro_batches[0] == ((0, 1), [0]) and cheap.info["explore_s"] == 0.0
    assert cheap.predicted_step_s == base
    assert forced.micro_batches == [((0,), [0]), ((1,), [1]), ((2,), [2]), ((2, 3), [3])]
    assert forced.info["explored"] == "cp2 2x1" and forced.info["explore_s"] > 0
    assert forced.predicted_step_s == base + forced.info["explore_s"]
    assert simulate(forced, lengths, PRIOR, timeline=False).step_s == base  # the move itself is free


def _fixed_plan(groups, world):
    """make_plan that always returns the hand-built plan ``groups`` (ranks, clip ids) on ``world`` ranks."""
    from dynamic_cp.planning.simulator import simulate

    def make(model, lengths):
        plan = Plan([(tuple(r), list(ids)) for r, ids in groups], world, CAP)
        plan.predicted_step_s = simulate(plan, lengths, model, timeline=False).step_s
        return plan

    return make


def test_exploring_another_layout_of_a_running_size_charges_that_layouts_extra_seconds():
    """One 12000-token clip on 2 ranks runs the cheapest layout (1x2); the other (2x1) is explored by
    switching that micro-batch, which costs exactly the layout's extra seconds over the cheapest
    (about 14 ms on a 0.18 s step). Planted: the extra as layout + cheapest, floored at 1 s instead
    of 0, or clipped to at most 0 -> this test fails."""
    from dynamic_cp.runtime.cost_learning import _layout_time

    lengths = [12000]
    learner = CostLearner(PRIOR, _fixed_plan([((0, 1), [0])], 2), start_step=0, plan_lag=0,
                          explore_budget=1.0, cp_sizes=(2,), cap_tokens=CAP)  # fmt: skip
    assert PRIOR.layout(lengths, 2) == (1, 2)
    plan = learner.plan(lengths)
    extra = _layout_time(PRIOR, lengths, 2, (2, 1), False) - PRIOR.micro_batch_time(lengths, 2, False)
    assert 0 < extra < 0.1 * plan.predicted_step_s
    assert (plan.info["explored"], plan.info["layouts"]) == ("cp2 2x1", [(2, 1)])
    assert plan.info["explore_s"] == extra


def test_exploration_never_moves_a_micro_batch_onto_fewer_ranks_than_its_tokens_need():
    """8 ranks, cap 40000 tokens a rank: two clips on ranks 0-3 move onto ranks 0-1 to explore CP 2
    when they hold exactly 2 x 40000 tokens (the cap allows it), never when they hold 2 more (each clip
    alone would fit on 2 ranks, the pair does not; another key on the same ranks may be explored
    instead). Planted: the cap checked on the longest clip
    (sum -> max), or at the cap excluded (> -> >=) -> this test fails."""
    for pair, explored in (([40000, 40000], True), ([40001, 40001], False)):
        lengths = pair + [80000, 80000]  # ranks 4-7: the longer micro-batch, so the move is free
        groups = [((0, 1, 2, 3), [0, 1]), ((4, 5, 6, 7), [2, 3])]
        learner = CostLearner(PRIOR, _fixed_plan(groups, 8), start_step=0, plan_lag=0,
                              explore_budget=1.0, cp_sizes=(2, 4), cap_tokens=CAP)  # fmt: skip
        plan = learner.plan(lengths)
        assert plan_violations(plan, lengths, CAP, (2, 4)) == []
        # with CP 2 out of reach the learner may still explore another key on the same ranks (a CP 4
        # layout); what it must not do is move the pair onto 2 ranks
        assert plan.info.get("explored", "").startswith("cp2") == explored
        assert all(len(r) == 4 for r, _ in plan.micro_batches) != explored
        if explored:
            assert plan.micro_batches[0] == ((0, 1), [0, 1]) and plan.info["explore_s"] == 0.0


def test_a_move_to_cp_1_is_priced_by_the_step_alone_and_a_free_move_fits_a_zero_budget():
    """CP 1 never ran: the short clip on ranks 0-1 moves to rank 0 alone, which leaves the step (the
    long clip on ranks 2-3) unchanged: the move costs 0 s, has no layout to pay for, and is taken even
    at a budget of 0 (at most the budget: 0 <= 0). Planted: a CP 1 move charged 1 s of layout, the
    budget's bound strict (> -> >=) -> this test fails."""
    from dynamic_cp.planning.simulator import simulate

    lengths = [2000, 30000]
    learner = CostLearner(PRIOR, _fixed_plan([((0, 1), [0]), ((2, 3), [1])], 4), start_step=0,
                          plan_lag=0, explore_budget=0.0, cp_sizes=(1, 2), cap_tokens=CAP)  # fmt: skip
    plan = learner.plan(lengths)
    assert plan.info["explored"] == "cp1 1x1" and plan.micro_batches[0] == ((0,), [0])
    assert plan.info["explore_s"] == 0.0
    assert plan.predicted_step_s == simulate(plan, lengths, PRIOR).step_s


def test_each_missing_layout_is_explored_until_it_was_observed_three_times():
    """4 ranks, one clip each at CP 1 (a fixed plan): CP 2's layouts never run unless explored. Each
    step explores the first missing one, 1x2 for three steps, then 2x1 for three, then nothing: an
    exploratory micro-batch counts once when observed. Planted: observations counted twice (+= 2) or
    subtracted (-=) -> this test fails."""
    lengths = [30000, 4000, 20000, 12000]
    learner = CostLearner(PRIOR, _fixed_plan([((i,), [i]) for i in range(4)], 4), start_step=0,
                          plan_lag=0, explore_budget=1.0, cp_sizes=(1, 2), cap_tokens=CAP,
                          refit_every=100, skip_steps=0)  # fmt: skip
    explored = []
    for s in range(8):
        plan = learner.plan(lengths)
        explored.append(plan.info.get("explored"))
        learner.observe(s, plan, lengths, _measure(plan, lengths, PRIOR))
    assert explored == ["cp2 1x2"] * 3 + ["cp2 2x1"] * 3 + [None] * 2


def test_the_speed_factor_is_the_median_of_the_last_three_steps_before_the_first_refit():
    """skip_steps=9: steps 9-15 are observed before the first refit (after 16 steps). Steps 12-14 run
    3x slow: after 11, 12, 13 two of the last three are slow, after 12, 13, 14 all three, so the plans
    of steps 14 and 15 run at 3x (over every observed step, 9-14, the median would be 2x). Planted:
    the window of recent steps without maxlen -> this test fails."""
    learner = _learner(start_step=0, plan_lag=0, refit_every=100, skip_steps=9, explore=False)
    lengths = [30000, 9000, 3000, 800] * 4
    speeds = {}
    for s in range(16):
        plan = learner.plan(lengths)
        speeds[s] = plan.info["speed"]
        slow = 3.0 if s in (12, 13, 14) else 1.0
        learner.observe(s, plan, lengths, [(a, t * slow, c) for a, t, c in _measure(plan, lengths, PRIOR)])
    assert learner.num_refits == 1  # after step 15
    assert speeds[13] == pytest.approx(1.0, rel=1e-9)  # measured by the prior itself: ratio 1
    assert speeds[14] == pytest.approx(3.0, rel=1e-9) and speeds[15] == pytest.approx(3.0, rel=1e-9)


def test_resuming_a_checkpoint_from_before_the_speed_factor_plans_at_pace_1():
    """A checkpoint without 'speeds' and 'recent' (written before the speed factor existed): plans
    run at pace 1 until a step measures one; a step whose timings were all lost measures none, so the
    pace stays 1; the next measured step sets it. The resumed learner keeps counting (size, layout)
    pairs it had not seen. Planted: the missing pace read as 2, the pace without measurements 2, the
    restored counts a dict (KeyError on a new pair) -> this test fails."""
    true = true_cluster(PRIOR)
    lengths = [30000, 9000, 3000, 800] * 4
    old = _learner(start_step=0, plan_lag=0, refit_every=100, skip_steps=0, explore=False)
    p = old.plan(lengths)
    old.observe(0, p, lengths, _measure(p, lengths, true))
    state = json.loads(json.dumps(old.state_dict()))
    del state["speeds"], state["recent"]
    state["seen"] = []  # pairs without a count are counted from 0
    resumed = _learner(start_step=1, plan_lag=0, refit_every=100, skip_steps=0, explore=False)
    resumed.load_state_dict(state)
    plan = resumed.plan(lengths)
    assert plan.info["speed"] == 1.0
    resumed.observe(1, plan, lengths, [(0.0, 0.0, 0.0)] * len(plan.micro_batches))  # timings lost
    plan = resumed.plan(lengths)
    assert plan.info["speed"] == 1.0
    resumed.observe(2, plan, lengths, [(a, 2 * t, c) for a, t, c in _measure(plan, lengths, true)])
    assert resumed.plan(lengths).info["speed"] > 1.5  # measured: twice the fit's pace
    assert sum(n for _, _, n in resumed.state_dict()["seen"]) == len(plan.micro_batches)


def test_a_late_plan_ahead_thread_still_plans_with_the_model_of_its_step():
    """With plan-ahead (lag 1) the plan of step 2 normally runs while step 1 computes; if its thread
    runs late, after step 1 was observed and refitted (effective from step 3), it must still plan
    with the fit effective at step 2, as the ranks whose thread ran on time did. Planted: the plan
    counter advancing by 2 per plan -> this test fails."""
    true = true_cluster(PRIOR)
    learner = _learner(start_step=0, plan_lag=1, refit_every=1, skip_steps=0, explore=False)
    lengths = [30000, 9000, 3000, 800] * 4
    plans = [learner.plan(lengths), learner.plan(lengths)]  # steps 0 and 1, before step 0 ends
    for s in range(2):
        assert learner.observe(s, plans[s], lengths, _measure(plans[s], lengths, true))
    late = learner.plan(lengths)  # step 2, after the refit of step 1 was published for step 3
    assert late.info["model_step"] == 2 and learner.plan(lengths).info["model_step"] == 3
