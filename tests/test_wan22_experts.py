"""Wan2.2 A14B: one expert trains on its own side of the pipeline's switch, on the *shifted* schedule.

diffusers' WanPipeline runs ``transformer`` (high noise) while its scheduler's timestep
t >= boundary_ratio * scheduler.config.num_train_timesteps, and ``transformer_2`` below; the
scheduler's t is 1000 x the shifted sigma. The tests take that rule from diffusers (the scheduler's
num_train_timesteps, the pipeline's ``t >= boundary``) and check every timestep an expert's training
feeds its model, through the trainer's own path (Trainer.prepare -> micro_batch_loss).

Planted and caught: splitting the unshifted draw at b (``lo, hi = (boundary, 1.0)`` in
``dit.flow.sample_expert_sigma``, maxdiffusion #470's bug) puts the low expert's timesteps up to
shift(b) = 988 at shift 12 (test_every_training_timestep_is_on_its_experts_side fails) and the high
expert's all above 988 (test_an_expert_sees_the_whole_flow_distribution_on_its_side fails).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from dit.config import load_config
from dit.flow import (
    model_timesteps,
    sample_expert_sigma,
    sample_sigmas,
    shift_sigmas,
)

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def pipeline_runs_high(t: torch.Tensor, boundary_ratio: float) -> torch.Tensor:
    """pipeline_wan.py: ``if boundary_timestep is None or t >= boundary_timestep: transformer``."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # after dit (data/quiet_imports.py)

    boundary_timestep = boundary_ratio * FlowMatchEulerDiscreteScheduler().config.num_train_timesteps
    return t >= boundary_timestep


def trainer(tmp_path, *extra):
    from dit.trainer import Trainer

    cfg = load_config(TINY, [*tiny_overrides(tmp_path, **{"train.ema_decay": 0}), *extra])
    return Trainer(cfg, device=torch.device("cpu"))


@pytest.mark.parametrize(
    "expert, ratio, flow",
    [
        ("high", 0.875, ["flow.shift=12", "flow.timestep_sampling=uniform"]),  # T2V-A14B's shift
        ("low", 0.875, ["flow.shift=12"]),
        ("low", 0.9, ["flow.shift=null"]),  # each clip shifted by its token count
    ],
)
def test_every_training_timestep_is_on_its_experts_side(tmp_path, expert, ratio, flow):
    t = trainer(tmp_path, f"model.expert={expert}", f"model.boundary_ratio={ratio}", *flow)
    timesteps = []  # what the model is fed, through micro_batch_loss
    t.model.register_forward_pre_hook(lambda _m, args: timesteps.append(args[3].clone()))
    samples = [t.train_set[i] for i in range(len(t.train_set))]
    t.train_step(t.prepare(samples[:4], 0))
    clips = [c for step in range(8) for c in t.prepare(samples, step)]  # 512 draws
    seen = torch.cat([*timesteps, model_timesteps([c.sigma for c in clips])])
    high = pipeline_runs_high(seen, ratio)
    assert bool(high.all() if expert == "high" else (~high).all()), (
        f"{int((high != (expert == 'high')).sum())} of {len(seen)} timesteps on the other expert's side"
    )


@pytest.mark.parametrize("expert", ["high", "low"])
def test_an_expert_sees_the_whole_flow_distribution_on_its_side(expert):
    """The expert's draws are the full (shifted) distribution restricted to its side: their mean equals
    that of full draws that land there. Tolerance: the two means of N=4000 draws each differ by
    sd * sqrt(2/N) ~ 0.022 sd in expectation; 6 of those (6 x 0.022 x 0.12 ~ 0.016 for sd <= 0.12
    here) fail only with probability ~1e-9, whatever the platform's float rounding."""
    shift, ratio, n = 12.0, 0.875, 4000
    g = torch.Generator().manual_seed(0)
    ours = torch.tensor(
        [sample_expert_sigma(g, "logit_normal", 0.0, 1.0, shift, expert, ratio) for _ in range(n)]
    )
    full = shift_sigmas(sample_sigmas(40 * n, torch.Generator().manual_seed(1)), shift)
    side = pipeline_runs_high(model_timesteps(full), ratio)
    ref = full[side if expert == "high" else ~side][:n]
    assert len(ref) == n
    sd = float(ref.std())
    assert abs(float(ours.mean()) - float(ref.mean())) < 6 * sd * (2 / n) ** 0.5
    assert abs(float(ours.std()) - sd) < 0.1 * sd


def test_expert_config_errors_are_one_line(tmp_path):
    with pytest.raises(
        ValueError, match=r"model.expert='mid' is not an expert; choose 'high' .*, 'low' .* or 'both'"
    ):
        load_config(TINY, ["model.expert=mid"])
    with pytest.raises(ValueError, match=r"model.boundary_ratio=1.5 must be in \(0, 1\)"):
        load_config(TINY, ["model.expert=high", "model.boundary_ratio=1.5"])
    with pytest.raises(ValueError, match="set model.expert=high, low or both too"):
        load_config(TINY, ["model.boundary_ratio=0.9"])
    with pytest.raises(
        ValueError, match=r"model.expert=low needs the experts' switch: set model.boundary_ratio"
    ):
        trainer(tmp_path, "model.expert=low")
    with pytest.raises(
        ValueError, match=r"flow.val_sigmas=\[0.1, 0.5\] has no sigma on the high expert's side"
    ):
        trainer(tmp_path, "model.expert=high", "model.boundary_ratio=0.875", "flow.val_sigmas=[0.1, 0.5]")
    with pytest.raises(
        ValueError, match="train.sample_every=5 with model.expert=high: .* set train.sample_every=0"
    ):
        trainer(tmp_path, "model.expert=high", "model.boundary_ratio=0.875", "train.sample_every=5",
                "train.sample_prompts=[a]")  # fmt: skip


def test_validation_keeps_the_experts_sigmas(tmp_path):
    t = trainer(tmp_path, "model.expert=high", "model.boundary_ratio=0.875")
    assert t.val_sigmas == [0.9]  # of the default 0.1 ... 0.9
    assert t.validation_loss() > 0
