"""Runs that survive faults, in one process: ``--resume auto``, checkpoints that are not whole, a full disk.

A reference run of 4 steps keeps a checkpoint of every step. Each fault case copies it, damages
its newest checkpoint (step 4) in one way, and resumes with ``--resume auto`` (or
``train.resume=auto``): the run must say it skips step 4, resume from step 3, and log a step-4 loss
bitwise equal to the reference's, each step once in metrics.jsonl. (The multi-process faults, a
killed rank and a hung collective, are in tests/test_faults_torchrun.py.)
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import tiny_overrides

import train
from dit.checkpoint import is_disk_full

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = {"train.max_steps": 4, "train.checkpoint_every": 1, "train.keep_checkpoints": 4}


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run) if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, started with --resume auto on a fresh output_dir (which must not fail)."""
    tmp = tmp_path_factory.mktemp("reference")
    assert train.main(["--config", TINY, *tiny_overrides(tmp, **STEPS), "--resume", "auto"]) == 0
    return tmp / "run"


def test_fresh_output_dir_under_resume_auto_starts_at_step_0(reference):
    steps = [r["step"] for r in _rows(reference)]
    assert steps == [0, 1, 2, 3, 4], steps
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == [
        "latest", "step_000001", "step_000002", "step_000003", "step_000004",
    ]  # fmt: skip


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _damage(step_dir: Path, kind: str) -> None:
    if kind == "truncated_safetensors":
        _truncate(step_dir / "model" / "diffusion_pytorch_model.safetensors")
    elif kind == "truncated_trainer_pt":
        _truncate(step_dir / "trainer.pt")
    elif kind == "unreadable_trainer_pt":
        (step_dir / "trainer.pt").write_bytes(b"not a torch file at all")
    elif kind == "dcp_without_metadata":
        # the folder DCP's save leaves before its last act, writing .metadata
        (step_dir / "sharded").mkdir()
        (step_dir / "sharded" / "__0_0.distcp").write_bytes(b"\0" * 64)
    elif kind == "crash_temp_folder":  # a save killed before its rename
        step_dir.rename(step_dir.with_name(step_dir.name + ".tmp"))
    else:
        raise AssertionError(kind)


KINDS = {
    "truncated_safetensors": "model/diffusion_pytorch_model.safetensors is truncated",
    "truncated_trainer_pt": "trainer.pt is ",
    "unreadable_trainer_pt": "trainer.pt is unreadable",
    "dcp_without_metadata": "sharded/.metadata is missing",
    "crash_temp_folder": "left by a save that did not finish",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_newest_checkpoint_not_whole_is_skipped(reference, tmp_path, capsys, kind):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    _damage(run / "checkpoints" / "step_000004", kind)
    capsys.readouterr()
    # the config's train.resume=auto, not the flag: the two are one setting
    assert train.main(["--config", TINY, *tiny_overrides(tmp_path, **STEPS), "train.resume=auto"]) == 0
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and KINDS[kind] in out, out
    assert "resumed from" in out and "step_000003 at step 3" in out, out
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3, 4]  # each step once
    assert _losses(run) == _losses(reference)  # bitwise: step 4 recomputed from step 3
    assert not (run / "checkpoints" / "step_000004.tmp").exists()


def test_disk_full_during_a_save_stops_with_one_line_and_resume_auto_continues(
    reference, tmp_path, capsys, monkeypatch
):
    """A writer that fails with ENOSPC halfway through step 3's weights: one line naming the file and
    the bytes needed, exit code 2, step 2 whole; ``--resume auto`` then finishes the run."""
    real = safetensors.torch.save_file
    calls = []

    def fills_the_disk(tensors, filename, metadata=None):
        calls.append(filename)
        real(tensors, filename, metadata=metadata)
        if len(calls) == 5:  # steps 1 and 2 write model/ and ema/; step 3's model/ fails partway
            _truncate(Path(filename))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    monkeypatch.setattr(safetensors.torch, "save_file", fills_the_disk)
    over = tiny_overrides(tmp_path, **STEPS)
    capsys.readouterr()
    assert train.main(["--config", TINY, *over, "--resume", "auto"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    assert "disk full while saving checkpoint step_000003" in err[0], err
    assert "step_000003.tmp/model/diffusion_pytorch_model.safetensors" in err[0], err
    assert "needs about " in err[0] and "it takes step_000002" in err[0], err
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001", "step_000002"]

    monkeypatch.setattr(safetensors.torch, "save_file", real)  # space freed
    assert train.main(["--config", TINY, *over, "--resume", "auto"]) == 0
    assert [r["step"] for r in _rows(tmp_path / "run")] == [0, 1, 2, 3, 4]
    assert _losses(tmp_path / "run") == _losses(reference)


def test_disk_full_is_recognized_through_wrappers():
    assert is_disk_full(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
    # safetensors' Rust error and DCP's CheckpointException carry the OS error only in their text
    assert is_disk_full(
        RuntimeError('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')
    )
    try:
        try:
            raise OSError(errno.ENOSPC, "x")
        except OSError as inner:
            raise RuntimeError("file write failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(OSError(errno.EACCES, os.strerror(errno.EACCES)))
    assert not is_disk_full(ValueError("shape mismatch"))


def test_keep_checkpoints_below_2_warns(tmp_path, capsys):
    over = tiny_overrides(tmp_path, **{"train.max_steps": 1, "train.keep_checkpoints": 1})
    from dit.config import load_config
    from dit.trainer import Trainer

    Trainer(load_config(TINY, over), device=torch.device("cpu"))
    assert "warning: train.keep_checkpoints=1" in capsys.readouterr().out


def _trainer_state(step_dir: Path) -> dict:
    return torch.load(step_dir / "trainer.pt", weights_only=True)


def test_async_checkpoints_equal_sync_ones(reference, tmp_path, monkeypatch):
    """Staged at the step, written by a thread while training goes on: the same files as a
    synchronous save (weights, EMA, optimizer, RNG of the step, not of the writer's moment). The
    writer of step 2 is held until step 3's optimizer step has changed the live weights."""
    import threading

    from dit.trainer import Trainer

    stepped = threading.Event()
    finish, real = Trainer.finish_step, safetensors.torch.save_file

    def finish_step(self, loss):
        out = finish(self, loss)
        if self.step == 2:  # step 3 (self.step counts finished steps)
            stepped.set()
        return out

    def held_writer(tensors, filename, metadata=None):
        if "step_000002" in str(filename):
            assert stepped.wait(timeout=120)
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(Trainer, "finish_step", finish_step)
    monkeypatch.setattr(safetensors.torch, "save_file", held_writer)
    over = tiny_overrides(tmp_path, **STEPS, **{"train.async_checkpoint": "true"})
    assert train.main(["--config", TINY, *over]) == 0
    assert _losses(tmp_path / "run") == _losses(reference)
    for step in (2, 4):
        want, got = (run / "checkpoints" / f"step_{step:06d}" for run in (reference, tmp_path / "run"))
        for sub in ("model", "ema"):
            a = safetensors.torch.load_file(want / sub / "diffusion_pytorch_model.safetensors")
            b = safetensors.torch.load_file(got / sub / "diffusion_pytorch_model.safetensors")
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        a, b = _trainer_state(want), _trainer_state(got)
        assert a["step"] == b["step"] == step
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
        assert all(
            torch.equal(a["optimizer"]["state"][k]["exp_avg_sq"], b["optimizer"]["state"][k]["exp_avg_sq"])
            for k in a["optimizer"]["state"]
        )


def test_failed_async_save_stops_the_run_and_resume_auto_continues(reference, tmp_path, capsys, monkeypatch):
    real = safetensors.torch.save_file
    calls = []

    def fills_the_disk(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:  # step 2's model/, in the writer thread
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_the_disk)
    over = tiny_overrides(tmp_path, **STEPS, **{"train.async_checkpoint": "true"})
    capsys.readouterr()
    assert train.main(["--config", TINY, *over]) == 2  # at the next step, or at the end at the latest
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "disk full while saving checkpoint step_000002" in err[0], err
    ckpts = tmp_path / "run" / "checkpoints"
    assert not (ckpts / "step_000002.tmp").exists() and (ckpts / "step_000001").is_dir()
    assert not (ckpts / "step_000004").exists()  # stopped before the end

    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert train.main(["--config", TINY, *over, "--resume", "auto"]) == 0
    assert [r["step"] for r in _rows(tmp_path / "run")] == [0, 1, 2, 3, 4]
    assert _losses(tmp_path / "run") == _losses(reference)


def test_resume_auto_before_any_checkpoint_starts_fresh_and_drops_the_dead_runs_lines(tmp_path, capsys):
    """A run killed before its first checkpoint left metrics.jsonl only: ``--resume auto`` is not
    refused ("already holds a run"), starts at step 0 and drops those lines (they would repeat)."""
    from dit.config import load_config

    cfg = load_config(TINY, tiny_overrides(tmp_path))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "val_loss": 1.0}\n{"step": 1, "loss": 2.0}\n{"ste')
    (run / "checkpoints" / "step_000002.tmp").mkdir(parents=True)  # killed during its first save
    assert train.resolve_resume(cfg, "auto", overwrite=False) is None
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and "starting fresh" in out, out
    assert (run / "metrics.jsonl").read_text() == ""
    with pytest.raises(ValueError, match="drop one of the two"):
        train.resolve_resume(cfg, "auto", overwrite=True)
    with pytest.raises(ValueError, match="already holds a run"):  # no resume: refused as before
        train.resolve_resume(cfg, None, overwrite=False)


def test_nccl_flight_recorder_env_sets_the_dump_and_keeps_the_users_values(tmp_path, monkeypatch):
    """Before an NCCL process group starts: async error handling (abort a timed-out collective), a
    dump of each rank's last collectives on a timeout into <output_dir>/flight_recorder/rank_<N>,
    and a value the user set kept. No GPU here, so this checks the environment the process group
    will read, not a dump. Planted: TORCH_NCCL_DUMP_ON_TIMEOUT not set -> fails."""
    from dynamic_cp.runtime.timeouts import nccl_flight_recorder_env

    names = ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
             "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_BUFFER_SIZE"]  # fmt: skip
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")  # the user's
    folder = nccl_flight_recorder_env(str(tmp_path / "run"))
    assert folder == tmp_path / "run" / "flight_recorder" and folder.is_dir()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(folder / "rank_")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50"


@pytest.mark.parametrize(("lora", "idle"), [(False, "cpu"), (True, "sharded")])
def test_resume_auto_finds_the_checkpoints_of_both_a14b_experts(tmp_path, capsys, lora, idle):
    """model.expert=both saves a diffusers folder, one subfolder per expert (model/transformer,
    model/transformer_2; LoRA: their adapter files), which ``--resume auto`` once took for "no
    weights" and restarted from step 0. Step 4's folder gone and step 3's second expert truncated:
    the resume skips step 3 naming that file, continues from step 2 and logs steps 3 and 4 bitwise
    as the uninterrupted run (step 4's loss reads step 3's update, made with the restored AdamW
    moments); the full run keeps its idle expert on the host (model.idle_expert=cpu) throughout.
    Planted: the old check of model/*.safetensors alone -> "starting fresh", and this test fails.

    The LoRA case trains on a random two-expert Wan folder: on the seeded init (adaLN-zero's zero
    output layer) every adapter gradient is zero and the losses ignore the adapters, so the resume
    check held even with the adapters never restored (planted: ``load_adapters`` skipping the copy
    into the model -> passed before, fails now)."""
    from test_wan22_both import _a14b_folder

    lora_items = {"model.lora": "{}", "model.overrides": "{}",
                  "model.pretrained": str(_a14b_folder(tmp_path / "a14b"))}  # fmt: skip
    items = {**STEPS, "model.expert": "both", "model.boundary_ratio": 0.875,
             "train.global_batch_size": 4, "model.idle_expert": idle,
             **(lora_items if lora else {})}  # fmt: skip
    argv = ["--config", TINY, *tiny_overrides(tmp_path, **items), "--resume", "auto"]
    assert train.main(argv) == 0
    run = tmp_path / "run"
    want = _losses(run)
    assert all(r["grad_norm"] > 0 for r in _rows(run) if "loss" in r)  # every step trains something
    name = "pytorch_lora_weights" if lora else "diffusion_pytorch_model"
    if lora:  # each expert's adapters moved off peft's zero B
        for folder in ("transformer", "transformer_2"):
            saved = safetensors.torch.load_file(
                str(run / "checkpoints" / "step_000004" / "model" / folder / f"{name}.safetensors")
            )
            assert any(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k), folder
    shutil.rmtree(run / "checkpoints" / "step_000004")
    _truncate(run / "checkpoints" / "step_000003" / "model" / "transformer_2" / f"{name}.safetensors")
    capsys.readouterr()
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"model/transformer_2/{name}.safetensors is truncated" in out, out
    assert "resumed from" in out and "step_000002 at step 2" in out, out
    assert [r["step"] for r in _rows(run) if "loss" in r] == [1, 2, 3, 4] and _losses(run) == want
