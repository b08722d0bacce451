"""The single-process step's guards and side paths: gradient clipping, the non-finite guard and
max_bad_steps, the EMA update, and resuming a checkpoint saved without ema/.

Each test builds the shrunken tiny config (seconds); the distributed runtime reuses this
``finish_step``, so these hold there too.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from dit.config import load_config
from dit.ema import EMA
from dit.trainer import Trainer
from dynamic_cp.runtime.testing import record_step_grads

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _trainer(tmp_path, **extra) -> Trainer:
    # no warm-up: diffusers' warm-up runs the first step at lr 0, and these tests need it to move weights
    extra = {"train.warmup_steps": 0, **extra}
    return Trainer(load_config(TINY, tiny_overrides(tmp_path, **extra)), device=torch.device("cpu"))


def _clips(trainer: Trainer, step: int = 0):
    return trainer.prepare([trainer.train_set[i] for i in range(4)], step)


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.double().norm() ** 2) for g in grads))


def _grads_at_optimizer_step(trainer: Trainer) -> list[list[torch.Tensor]]:
    """The gradients the optimizer actually applies (after clipping), at every optimizer.step()."""
    seen = []
    step = trainer.optimizer.step

    def recording(*args, **kwargs):
        seen.append([p.grad.clone() for p in trainer.trainable_parameters() if p.grad is not None])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording
    return seen


@pytest.mark.parametrize("clip", [1e-3, 0.0])
def test_grad_clip_scales_the_applied_gradient_to_the_clip_value(tmp_path, clip):
    trainer = _trainer(tmp_path, **{"train.grad_clip": clip})
    before = record_step_grads(trainer)
    applied = _grads_at_optimizer_step(trainer)
    metrics = trainer.train_step(_clips(trainer))
    raw = _norm(g for k, g in before[0].items() if k != "__loss__")
    assert metrics["grad_norm"] == pytest.approx(raw, rel=1e-5)  # the log shows the norm before clipping
    if clip:
        assert raw > 10 * clip, "the clip must bind for this test to test it"
        assert _norm(applied[0]) == pytest.approx(clip, rel=1e-4)
    else:  # 0 disables clipping: the optimizer gets the raw gradient
        assert _norm(applied[0]) == pytest.approx(raw, rel=1e-6)


def test_non_finite_steps_are_skipped_and_max_bad_steps_stops_the_run(tmp_path):
    trainer = _trainer(tmp_path, **{"train.max_bad_steps": 3})
    params = trainer.trainable_parameters()
    ema_before = [p.clone() for p in trainer.ema.model.parameters()]

    def bad_step(loss: float, grad: float) -> dict:
        for p in params:
            p.grad = torch.full_like(p, grad)
        return trainer.finish_step(loss)

    start = [p.detach().clone() for p in params]
    lr = trainer.lr_schedule.get_last_lr()
    out = bad_step(float("nan"), 1.0)  # non-finite loss
    assert out["skipped"] and trainer.bad_steps == 1
    out = bad_step(1.0, float("inf"))  # finite loss, non-finite gradient
    assert out["skipped"] and trainer.bad_steps == 2
    # skipped steps change nothing: weights, optimizer moments, LR schedule, EMA; gradients dropped
    assert all(torch.equal(p, s) for p, s in zip(params, start))
    assert not trainer.optimizer.state and trainer.lr_schedule.get_last_lr() == lr
    assert all(torch.equal(e, b) for e, b in zip(trainer.ema.model.parameters(), ema_before))
    assert all(p.grad is None for p in params)

    out = trainer.train_step(_clips(trainer))  # a finite step resets the count
    assert "skipped" not in out and trainer.bad_steps == 0
    assert not all(torch.equal(p, s) for p, s in zip(params, start))

    bad_step(float("inf"), 1.0)
    bad_step(float("nan"), 1.0)
    with pytest.raises(RuntimeError, match=r"3 steps in a row had a non-finite loss.*lower train\.lr"):
        bad_step(float("nan"), 1.0)


def test_ema_update_is_decay_times_ema_plus_rest_times_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ema = EMA(model, decay=0.9)
    old = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    new = [p.detach().clone() for p in model.parameters()]
    ema.update(model)
    for e, a, b in zip(ema.model.parameters(), old, new):
        torch.testing.assert_close(e, 0.9 * a + 0.1 * b, rtol=1e-6, atol=1e-7)
    ema.update(model)  # again at the same weights: another 10% of the way
    for e, a, b in zip(ema.model.parameters(), old, new):
        torch.testing.assert_close(e, 0.81 * a + 0.19 * b, rtol=1e-6, atol=1e-7)
    assert not any(p.requires_grad for p in ema.model.parameters())


def test_trainer_updates_ema_after_each_optimizer_step(tmp_path):
    trainer = _trainer(tmp_path, **{"train.ema_decay": 0.75})
    ema_before = [p.detach().clone() for p in trainer.ema.model.parameters()]
    trainer.train_step(_clips(trainer))
    for e, b, p in zip(trainer.ema.model.parameters(), ema_before, trainer.model.parameters()):
        torch.testing.assert_close(e, 0.75 * b + 0.25 * p.detach(), rtol=1e-6, atol=1e-7)


def test_resume_without_ema_starts_the_ema_at_the_resumed_weights(tmp_path):
    trainer = _trainer(tmp_path)
    init = [p.detach().clone() for p in trainer.model.parameters()]  # a fresh EMA would hold these
    trainer.train_step(_clips(trainer))
    trainer.step = 1
    step_dir = trainer.save()
    shutil.rmtree(step_dir / "ema")  # e.g. a checkpoint written with ema_decay=0, or exported weights
    cfg = load_config(TINY, tiny_overrides(tmp_path))
    resumed = Trainer(cfg, resume=str(tmp_path / "run"), device=torch.device("cpu"))
    assert resumed.step == 1
    trained = [p.detach() for p in trainer.model.parameters()]
    assert all(torch.equal(e, p) for e, p in zip(resumed.ema.model.parameters(), trained))
    assert any(not torch.equal(p, i) for p, i in zip(trained, init))  # so the check above can fail


def test_a_failed_run_ends_its_data_loader_workers_with_it(tmp_path):
    """train() ends its DataLoader workers also when a step raises, although the exception's traceback
    keeps the iterator alive (issue 58). Planted: the finally of Trainer.train without
    ``shut_down_workers`` -> the workers still run here."""
    import multiprocessing

    trainer = _trainer(tmp_path, **{"data.num_workers": 2})
    seen = []

    def failing(samples):
        seen.append(len(multiprocessing.active_children()))  # the workers run: the check is not vacuous
        raise RuntimeError("a step fails on purpose")

    trainer.run_step = failing
    with pytest.raises(RuntimeError, match="on purpose") as failed:
        trainer.train()
    assert seen == [2] and failed.traceback and not multiprocessing.active_children()
