"""dit/optim.py: the optimizer and LR schedule a run's config asks for (fast, one process)."""

from __future__ import annotations

import math

import pytest
import torch

from dit.config import TrainConfig
from dit.optim import build_lr_schedule, build_optimizer, check_optimizer_runs, optimizer_class


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def test_optimizer_gets_the_configured_hyperparameters():
    t = TrainConfig(lr=2e-3, betas=[0.8, 0.95], weight_decay=0.05)
    opt = build_optimizer(t, _params())
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (2e-3, (0.8, 0.95), 0.05)
    assert not group["fused"]
    fused = build_optimizer(TrainConfig(optimizer="adamw_fused"), _params())
    assert fused.param_groups[0]["fused"] is True


def test_adamw_8bit_is_bitsandbytes():
    # not pytest.importorskip: importing dit hides bitsandbytes from diffusers and peft (data/quiet_imports.py)
    from data.quiet_imports import import_bitsandbytes

    try:
        bnb = import_bitsandbytes()
    except ImportError:
        pytest.skip("bitsandbytes is not installed")
    assert optimizer_class(TrainConfig(optimizer="adamw_8bit")) is bnb.optim.AdamW8bit
    assert optimizer_class(TrainConfig(optimizer="adamw_fused")) is torch.optim.AdamW


def test_start_up_probe_names_an_optimizer_that_cannot_step(monkeypatch):
    check_optimizer_runs(TrainConfig(optimizer="adamw_fused"), torch.device("cpu"))  # fused runs on CPU
    stepped = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: stepped.append(self))
    check_optimizer_runs(TrainConfig(optimizer="adamw"), torch.device("cpu"))
    assert stepped == []  # plain AdamW runs everywhere: no probe
    check_optimizer_runs(TrainConfig(optimizer="adamw_fused"), torch.device("cpu"))
    (probe,) = stepped
    assert probe.param_groups[0]["fused"] is True and probe.param_groups[0]["params"][0].numel() == 4096

    def fail(self, *a, **k):
        raise RuntimeError("no kernel for this device\nsecond line")

    monkeypatch.setattr(torch.optim.AdamW, "step", fail)
    with pytest.raises(
        ValueError, match="^train.optimizer=adamw_fused cannot step on cpu: no kernel for this device; use"
    ):
        check_optimizer_runs(TrainConfig(optimizer="adamw_fused"), torch.device("cpu"))
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self: (_ for _ in ()).throw(RuntimeError()))
    with pytest.raises(ValueError, match="cannot step on cpu: RuntimeError; use"):  # an empty message
        check_optimizer_runs(TrainConfig(optimizer="adamw_fused"), torch.device("cpu"))


def _lrs(steps: int = 11, **kw) -> list[float]:
    t = TrainConfig(lr=1.0, warmup_steps=2, max_steps=10, **kw)
    opt = build_optimizer(t, _params())
    schedule = build_lr_schedule(t, opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return out


def test_lr_schedules_warm_up_linearly_then_follow_their_shape_to_the_decay_step():
    assert _lrs(lr_schedule="constant")[:4] == [0.0, 0.5, 1.0, 1.0]
    assert _lrs(lr_schedule="constant")[-1] == 1.0
    linear = _lrs(lr_schedule="linear")  # down to 0 at max_steps (10)
    assert linear == pytest.approx([0.0, 0.5] + [(10 - s) / 8 for s in range(2, 11)])
    cosine = _lrs(lr_schedule="cosine")
    assert cosine == pytest.approx(
        [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 11)]
    )
    early = _lrs(lr_schedule="linear", lr_decay_steps=6)  # lr_decay_steps replaces max_steps
    assert early[:7] == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_the_probe_steps_on_the_runs_device():
    # fused AdamW has no kernel for the meta device: the probe must run there, not on the CPU
    with pytest.raises(ValueError, match="^train.optimizer=adamw_fused cannot step on meta: "):
        check_optimizer_runs(TrainConfig(optimizer="adamw_fused"), torch.device("meta"))
