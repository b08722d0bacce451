"""Training under pipeline stages plans what the simulator and --dry-run price: the plan function the
runtime calls is ``plan_for_pipeline`` over one stage's ranks with the run's CP sizes, and the stage
split the runtime builds is the one the planner priced (``default_stage_layers``)."""

from __future__ import annotations

import pytest

from dit.config import load_config
from dit.setup import model_config_of
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.pipeline_order import plan_for_pipeline
from dynamic_cp.planning.pipeline_sim import default_stage_layers
from dynamic_cp.runtime.fsdp import model_dims_of
from dynamic_cp.runtime.step_plans import build_cost_model, make_plan_fn, stage_layers_of

LENGTHS = [780, 120, 64, 700, 300, 40, 520, 96, 250, 610]


def _cfg(*extra):
    return load_config(
        "configs/tiny.yaml",
        ["parallel.mode=dynamic", "parallel.pp_size=2", "parallel.hardware=h100", "parallel.cap_tokens=400",
         "parallel.cp_sizes=[1,2]", *extra],
    )  # fmt: skip


def test_training_plans_with_the_pipeline_planner():
    cfg = _cfg()
    dims = model_dims_of(cfg)
    cm = build_cost_model(cfg, model_config_of(cfg.model), Hardware.load("h100"))
    layers = stage_layers_of(cfg, dims)
    assert layers == default_stage_layers(dims, 2) == default_stage_layers(cm.dims, 2)
    got = make_plan_fn(cfg, cm, 4)(LENGTHS)
    want = plan_for_pipeline(LENGTHS, 4, 400, cm, layers, "1f1b", cp_sizes=[1, 2])
    assert got.micro_batches == want.micro_batches and got.info["pp_order"] == want.info["pp_order"]
    assert got.predicted_step_s == want.predicted_step_s and got.pp_warmup == want.pp_warmup
    assert {len(r) for r, _ in got.micro_batches} <= {1, 2}  # the run's parallel.cp_sizes hold


def test_given_split_is_kept_and_checked():
    dims = model_dims_of(_cfg())  # the tiny config: 4 blocks
    assert stage_layers_of(_cfg("parallel.pp_layers=[1,3]"), dims) == [1, 3]
    with pytest.raises(ValueError, match=r"pp_layers=\[1, 1\] sums to 2 blocks but the model has 4"):
        stage_layers_of(_cfg("parallel.pp_layers=[1,1]"), dims)
