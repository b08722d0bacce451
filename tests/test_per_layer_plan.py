"""Under FSDP per_layer, training plans with the rounds planner that ``simulate --fsdp per_layer`` prices.

Before issue 40, training planned barrier-free (``planner.plan``) and cut the plan into greedy rounds,
while the simulator and docs/planner.md reported the rounds planner (``plan_rounds``): the figures
described a planner training did not run. Now ``make_plan_fn`` (what the trainer's learner calls) and
``compare_modes`` (what ``python -m dynamic_cp.simulate --fsdp per_layer`` prints) go through the
one function ``plan_for_mode``, so for the same clips and prices the predicted steps are equal.

Planted and seen to fail: ``make_plan_fn`` ignoring its ``fsdp`` argument (a barrier-free plan, its
step priced without weight traffic): all four tests. Planted and equivalent: the trainer recutting a
plan that has rounds (``with_rounds`` always calling ``lockstep_rounds``) passes, because
``plan_rounds`` lists micro-batches round by round and greedy rounds in that order are the planner's
own (checked on 600 random batches at W = 3, 4, 5, 8); the second test keeps that so.
"""

from __future__ import annotations

import random

import pytest

from dit.config import load_config
from dit.setup import model_config_of
from dynamic_cp.planning.compare_modes import compare_modes
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.rounds import round_violations
from dynamic_cp.runtime.step_plans import build_cost_model, make_plan_fn

CAP = 4096


def _setup(world: int):
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "parallel.mode=dynamic",
            "parallel.fsdp=per_layer",
            "parallel.hardware=h100",
            f"parallel.cap_tokens={CAP}",
        ],
    )
    cm = build_cost_model(cfg, model_config_of(cfg.model), Hardware.load("h100"))
    rng = random.Random(world)
    lengths = [rng.choice([256, 1024, 3000, 6000, 11000]) for _ in range(3 * world + 1)]  # some need CP > 1
    return cfg, cm, lengths


@pytest.mark.parametrize("world", [3, 4, 8])
def test_training_and_the_simulator_predict_the_same_per_layer_step(world):
    cfg, cm, lengths = _setup(world)
    trained = make_plan_fn(cfg, cm, world, "per_layer")(lengths)
    _, (row,) = compare_modes(lengths, world, cm, cap=CAP, modes=("per_layer",), methods=("dynamic-cp",))
    assert row.fits
    assert trained.fsdp == "per_layer" and trained.rounds is not None
    assert round_violations(trained) == []
    assert trained.predicted_step_s == pytest.approx(row.steps["dynamic-cp"], rel=1e-12)
    assert max(len(r) for r, _ in trained.micro_batches) > 1  # the case is not CP-1 only


def test_the_per_layer_trainer_runs_the_plans_own_rounds():
    from dynamic_cp.runtime.step_strategies import with_rounds

    cfg, cm, lengths = _setup(4)
    plan = make_plan_fn(cfg, cm, 4, "per_layer")(lengths)
    assert with_rounds(plan, False, 4).rounds == plan.rounds
    barrier_free = make_plan_fn(cfg, cm, 4, "per_step")(lengths)
    assert barrier_free.rounds is None and round_violations(with_rounds(barrier_free, False, 4)) == []
