"""Checkpoint faults under FSDP (``parallel.fsdp=per_layer``) on 2 gloo ranks (forked, trainers in
process, so a worker can patch DCP's file writer): asynchronous saves (``train.async_checkpoint``:
DCP's ``async_save``) and a full disk during a DCP save.

One uninterrupted sync run (4 steps, a checkpoint every step) serves every test. The killed-rank
cases (a rank SIGKILLed mid-step, or during a sync or async save) run under torchrun in
tests/test_faults_torchrun.py.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import traceback
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
RUN = {
    "parallel.mode": "dynamic",
    "parallel.fsdp": "per_layer",
    "parallel.hardware": "h100",  # fixed prices and no refit: the same plans in every run
    "parallel.learn_costs": "false",
    "train.max_steps": 4,
    "train.checkpoint_every": 1,
    "train.keep_checkpoints": 4,
}


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run) if "loss" in r}


def _patch_writer(rank: int, fault: str) -> None:
    """Patch DCP's per-item file writer in this worker. 'hold': step 2's shards are written only
    after step 3's optimizer step changed the live weights (the save must have staged a copy).
    'enospc': rank 1's first shard of checkpoint 3 is written, then the disk is full."""
    import torch.distributed.checkpoint.filesystem as fs

    from dynamic_cp.runtime.fsdp_trainer import FSDPTrainer

    real_write = fs._write_item
    stepped = threading.Event()

    def write_item(transforms, stream, data, write_item, storage_key, serialization_format):
        path = str(getattr(stream, "name", ""))
        if fault == "hold" and "step_000002" in path:
            assert stepped.wait(timeout=120)
        out = real_write(transforms, stream, data, write_item, storage_key, serialization_format)
        if fault == "enospc" and rank == 1 and "step_000003" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return out

    fs._write_item = write_item
    if fault == "enospc":
        # async: the failed save has ended on every rank before the next step's check (a disk that
        # fails at once), so that check must be the one to stop the run: at the next step, not later
        from dynamic_cp.runtime.fsdp_checkpoint import AsyncFSDPCheckpointer

        check = AsyncFSDPCheckpointer.check

        def check_when_done(self):
            if self._thread is not None:
                assert self._done.wait(timeout=120)
            return check(self)

        AsyncFSDPCheckpointer.check = check_when_done
    if fault == "hold":
        finish = FSDPTrainer.finish_step

        def finish_step(self, loss):
            out = finish(self, loss)
            if self.step == 2:  # step 3 (self.step counts finished steps)
                stepped.set()
            return out

        FSDPTrainer.finish_step = finish_step


def train_worker(rank: int, world_size: int, out: str, extra: dict, fault: str | None, resume: bool) -> dict:
    """One run; -> {"ok"} or {"stopped": the RunStopped line} or {"error": a traceback}."""
    import torch.distributed as dist

    import train
    from data.cli import RunStopped
    from dit.config import load_config
    from dynamic_cp.runtime.launch import train_distributed

    try:
        if fault:
            _patch_writer(rank, fault)
        cfg = load_config(TINY, tiny_overrides(Path(out), **RUN, **extra))
        step_dir = train.resolve_resume(cfg, "auto" if resume else None, overwrite=False)
        try:
            train_distributed(cfg, dist.group.WORLD, resume=step_dir)
        except RunStopped as err:
            return {"stopped": str(err)}
        return {"ok": True}
    except Exception:  # the spawn error shows only the last frame; keep the whole trace
        return {"error": traceback.format_exc()}


def _train(
    out: Path, extra: dict | None = None, fault: str | None = None, resume: bool = False
) -> list[dict]:
    from dynamic_cp.runtime.testing import run_gloo

    return run_gloo(train_worker, 2, str(out), extra or {}, fault, resume, timeout_s=240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted sync per_layer run."""
    tmp = tmp_path_factory.mktemp("reference")
    assert _train(tmp) == [{"ok": True}] * 2
    return tmp / "run"


def _dcp_state(sharded: Path, tmp: Path) -> dict:
    """A DCP folder as one plain state dict (every rank's shards joined), read without processes."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(sharded, tmp / "joined.pt")
    return torch.load(tmp / "joined.pt", weights_only=False)


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_async_fsdp_checkpoints_equal_sync_ones(reference, tmp_path):
    """DCP's async_save, with step 2's shards written only after step 3 changed the live weights:
    every checkpoint holds the same shards (weights, AdamW moments, EMA), exports and torch RNG as the sync
    run's, and the losses are bitwise the same. Planted: the sharded state handed to async_save
    without staging (DCP's DefaultStager replaced by one returning the live tensors) -> step 2's
    shards hold step 3's weights and this test fails."""
    assert _train(tmp_path, {"train.async_checkpoint": "true"}, fault="hold") == [{"ok": True}] * 2
    run = tmp_path / "run"
    assert _losses(run) == _losses(reference)
    for step in (2, 4):
        want, got = (r / "checkpoints" / f"step_{step:06d}" for r in (reference, run))
        for sub in ("model", "ema"):
            a = load_file(want / sub / "diffusion_pytorch_model.safetensors")
            b = load_file(got / sub / "diffusion_pytorch_model.safetensors")
            _assert_same(a, b, f"step {step} {sub}")
        _assert_same(
            _dcp_state(want / "sharded", tmp_path),
            _dcp_state(got / "sharded", tmp_path),
            f"step {step} sharded",
        )
        a, b = (torch.load(d / "trainer.pt", weights_only=True) for d in (want, got))
        assert a["step"] == b["step"] == step
        # torch's generator (noise, timesteps) is seeded by the run; python's and numpy's are not (a
        # forked worker inherits pytest's), and training draws nothing from them
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]), f"step {step} rng"


@pytest.mark.parametrize("async_checkpoint", ["false", "true"])
def test_disk_full_during_a_dcp_save_stops_and_resume_auto_continues(reference, tmp_path, async_checkpoint):
    """Rank 1's writer fails with ENOSPC partway through checkpoint 3's shards. Every rank stops with
    one line naming the shard file and the bytes needed, before step 4 (async: at the next step's
    check, the save's failure being known by then); step 2 stays whole and ``--resume auto``
    resumes it and ends on the reference's losses. Planted: save_fsdp_checkpoint's
    stop_on_full_disk removed -> DCP's CheckpointException escapes instead of the one line, and
    step_000003.tmp stays. Planted: the training loop's per-step ``check()`` dropped, so the failure
    surfaces only in the final wait -> step 4 is trained and logged (caught)."""
    extra = {"train.async_checkpoint": async_checkpoint}
    results = _train(tmp_path, extra, fault="enospc")
    for rank, res in enumerate(results):
        assert "stopped" in res, f"rank {rank}: {res}"
        line = res["stopped"]
        assert "\n" not in line, line
        assert "disk full while saving checkpoint step_000003" in line, line
        assert "step_000003.tmp/sharded/__1_" in line and ".distcp" in line, line
        assert "needs about " in line and "it takes step_000002" in line, line
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert [r["step"] for r in _rows(tmp_path / "run")] == [0, 1, 2, 3]  # stopped before step 4

    assert _train(tmp_path, extra, resume=True) == [{"ok": True}] * 2  # space freed
    assert [r["step"] for r in _rows(tmp_path / "run")] == [0, 1, 2, 3, 4]
    assert _losses(tmp_path / "run") == _losses(reference)
