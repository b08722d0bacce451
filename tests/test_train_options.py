"""train.optimizer, train.lr_schedule, train.report_to and peak memory: what fine-tuners set first.

- every LR schedule resumes bit for bit (the schedule is rebuilt from the config);
- adamw_fused equals adamw within 1e-6 after 5 steps; adamw_8bit trains and resumes;
- ZeRO-1 (2 gloo ranks) with adamw_fused and adamw_8bit equals the single-process step;
- report_to=[jsonl, tensorboard] writes event files that tensorboard's own reader reads back;
- metrics.jsonl carries peak memory, and config.yaml is in output_dir before step 0.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_overrides

import train
from dit.config import load_config, to_dict
from dit.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run) if "loss" in r}


# lr at step s (after s optimizer steps) with warm-up 1 and decay over 8 steps, by diffusers' formulas
EXPECTED_LR = {
    "constant": lambda s: 1.0,
    "cosine": lambda s: 0.5 * (1 + math.cos(math.pi * (s - 1) / 7)),
    "linear": lambda s: (8 - s) / 7,
}


# 'constant' (the default) is test_train.py's SIGKILL test; the decaying ones are checked here. Each
# stops after checkpoint 4 (in this process: a fresh train.main, so a fresh Trainer and scheduler, is
# what a restart after a kill runs) and resumes to 6: a SIGKILLed subprocess per schedule cost a torch
# import and a start-up each (~8 s a pass idle, 74-87 s under load 7) and tested nothing more (the kill
# itself, metrics past the checkpoint dropped: test_train.py). Planted: the trainer not loading the
# checkpoint's lr_schedule state on resume -> both schedules fail.
@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_every_lr_schedule_resumes_bitwise(schedule, tmp_path):
    # lr_decay_steps pins the curve, so the 4-step, resumed and 6-step runs share it
    extra = {"train.lr_schedule": schedule, "train.lr_decay_steps": 8, "train.checkpoint_every": 2,
             "train.val_every": 100}  # fmt: skip
    full_over = tiny_overrides(tmp_path / "full", **extra, **{"train.max_steps": 6})
    assert train.main(["--config", TINY, *full_over]) == 0
    over = tiny_overrides(tmp_path / "stopped", **extra)
    assert train.main(["--config", TINY, *over, "train.max_steps=4"]) == 0
    assert train.main(["--config", TINY, *over, "train.max_steps=6", "--resume"]) == 0
    full, resumed = _losses(tmp_path / "full" / "run"), _losses(tmp_path / "stopped" / "run")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert all(full[s] == resumed[s] for s in full), (full, resumed)  # exact equality
    lr = {r["step"]: r["lr"] for r in _records(tmp_path / "stopped" / "run") if "lr" in r}
    base = load_config(TINY).train.lr
    for s in range(1, 7):  # the schedule is the one asked for, not the old constant one
        assert lr[s] == pytest.approx(base * EXPECTED_LR[schedule](s), rel=1e-9), (s, lr[s])


def _five_steps(tmp_path: Path, optimizer: str) -> dict[str, torch.Tensor]:
    cfg = load_config(TINY, tiny_overrides(tmp_path / optimizer, **{"train.optimizer": optimizer}))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    clips = trainer.prepare([trainer.train_set[i] for i in range(4)], step=0)
    for _ in range(5):
        trainer.train_step(clips)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_adamw_fused_equals_adamw_after_five_steps(tmp_path):
    plain, fused = _five_steps(tmp_path, "adamw"), _five_steps(tmp_path, "adamw_fused")
    start = Trainer(load_config(TINY, tiny_overrides(tmp_path / "init"))).model.state_dict()
    assert any(not torch.equal(plain[n], start[n]) for n in plain)  # the steps moved the weights
    for n in plain:
        torch.testing.assert_close(fused[n], plain[n], rtol=0, atol=1e-6, msg=n)


def _needs_bitsandbytes() -> None:
    # not pytest.importorskip: importing dit hides bitsandbytes from diffusers and peft (data/quiet_imports.py)
    from data.quiet_imports import import_bitsandbytes

    try:
        import_bitsandbytes()
    except ImportError:
        pytest.skip("bitsandbytes is not installed")


def test_adamw_8bit_trains_and_keeps_8bit_moments(tmp_path):
    _needs_bitsandbytes()
    cfg = load_config(TINY, tiny_overrides(tmp_path, **{"train.optimizer": "adamw_8bit", "train.lr": 3e-3}))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    clips = trainer.prepare([trainer.train_set[i] for i in range(4)], step=0)
    first = trainer.train_step(clips)["loss"]
    for _ in range(15):
        last = trainer.train_step(clips)["loss"]
    assert last < 0.8 * first
    dtypes = {
        v.dtype for state in trainer.optimizer.state.values() for k, v in state.items() if k == "state1"
    }
    assert torch.uint8 in dtypes  # the large matrices really hold 8-bit moments


def test_adamw_8bit_missing_library_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    from dit.config import TrainConfig
    from dit.optim import optimizer_class

    # a bitsandbytes that fails to import, found before the real one
    (tmp_path / "bitsandbytes.py").write_text("raise ImportError('No module named bitsandbytes')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    with pytest.raises(ValueError, match=r'pip install -e "\.\[quant\]"'):
        optimizer_class(TrainConfig(optimizer="adamw_8bit"))


# ----------------------------------------------------------------------------- ZeRO-1 with each optimizer


def _zero_worker(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from dynamic_cp.runtime.launch import train_distributed

    try:
        out = {}
        for optimizer in ZERO_OPTIMIZERS:
            cfg = load_config(TINY, _zero_over(f"{root}/{optimizer}", optimizer, "dynamic"))
            trainer = train_distributed(cfg, dist.group.WORLD)
            assert isinstance(trainer.optimizer, ZeroRedundancyOptimizer)
            out[optimizer] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return out
    except Exception:
        return {"error": traceback.format_exc()}


ZERO_OPTIMIZERS = ["adamw_fused", "adamw_8bit"]


def _zero_over(out: str, optimizer: str, mode: str) -> list[str]:
    return [
        *tiny_overrides(Path(out), **{"train.optimizer": optimizer, "train.max_steps": 2}),
        f"parallel.mode={mode}",
        "train.val_every=100",
        "train.checkpoint_every=1",  # ZeRO-1 consolidates the (8-bit) states into the checkpoint
    ]


def test_zero1_with_each_optimizer_equals_single_process(tmp_path):
    _needs_bitsandbytes()
    from dynamic_cp.runtime.testing import run_gloo

    out = run_gloo(_zero_worker, 2, str(tmp_path), timeout_s=240)
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    for optimizer in ZERO_OPTIMIZERS:
        cfg = load_config(TINY, _zero_over(str(tmp_path / f"ref-{optimizer}"), optimizer, "none"))
        ref = Trainer(cfg, device=torch.device("cpu"))
        ref.train()
        # the ZeRO run's checkpoint holds the consolidated optimizer state: one entry per parameter
        saved = torch.load(
            tmp_path / optimizer / "run" / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False
        )
        assert len(saved["optimizer"]["state"]) == len(list(ref.model.parameters()))
        assert _losses(tmp_path / optimizer / "run") == pytest.approx(
            _losses(tmp_path / f"ref-{optimizer}" / "run"), rel=1e-4
        )
        for n, p in ref.model.named_parameters():
            for r in range(2):
                torch.testing.assert_close(out[r][optimizer][n], p.detach(), rtol=1e-4, atol=1e-5, msg=n)


# ----------------------------------------------------------------------------- trackers and memory


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracked")
    over = tiny_overrides(tmp, **{"train.max_steps": 3, "train.report_to": "[jsonl, tensorboard]"})
    assert train.main(["--config", TINY, *over]) == 0
    return tmp / "run", over


def test_tensorboard_events_hold_the_logged_losses(tracked):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = tracked
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("loss")}
    jsonl = _losses(run)
    assert sorted(tb) == sorted(jsonl) == [1, 2, 3]
    assert all(tb[s] == pytest.approx(jsonl[s], rel=1e-6) for s in tb)  # float32 in the event file
    assert {e.step for e in acc.Scalars("val_loss")} == {0, 2, 3}


def test_peak_memory_in_metrics(tracked):
    run, _ = tracked
    steps = [r for r in _records(run) if "loss" in r]
    key = "mem_alloc_gb" if torch.cuda.is_available() else "peak_rss_gb"
    assert steps and all(r[key] > 0.05 for r in steps), steps  # a Python process with torch: > 50 MB


def test_config_yaml_in_output_dir_before_step_0(tmp_path, monkeypatch):
    seen = {}
    validation_loss = Trainer.validation_loss

    def spy(self):  # the first thing train() runs is step 0's validation loss
        seen.setdefault("config", (self.out / "config.yaml").is_file())
        return validation_loss(self)

    monkeypatch.setattr(Trainer, "validation_loss", spy)
    cfg = load_config(TINY, tiny_overrides(tmp_path, **{"train.max_steps": 1}))
    Trainer(cfg).train()
    assert seen["config"] is True
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()) == to_dict(cfg)


def test_missing_tracker_stops_at_start_up_naming_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    )
    over = tiny_overrides(tmp_path, **{"train.report_to": "[jsonl, wandb]"})
    assert train.main(["--config", TINY, *over]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install -e ".[tracking]"' in err[0] and "wandb" in err[0], err
    assert not (tmp_path / "run").exists()  # stopped before anything was built or written


def test_tracker_video_hook_writes_mp4_and_tensorboard_image(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dit.tracking import Tracker

    tracker = Tracker(tmp_path, ["tensorboard"])
    video = torch.linspace(-1, 1, 3 * 5 * 8 * 12).reshape(3, 5, 8, 12)  # (c, f, h, w)
    path = tracker.log_video("val/clip0", video, step=7, fps=4)
    tracker.close()
    assert path.is_file() and path.stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    (image,) = acc.Images("val/clip0")
    assert image.step == 7 and (image.width, image.height) == (5 * 12, 8)  # frames side by side
