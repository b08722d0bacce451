"""fsdp_checkpoint.py on a one-rank gloo world, in this process (the mutation tool's fast subset).

Save then load restores the sharded weights, AdamW moments and EMA exactly, writes the diffusers
exports and the trainer state, and resuming from a replicated checkpoint (fsdp=none) or from one
saved without EMA works. Resharding across world sizes is in tests/test_fsdp.py (spawned ranks).
"""

# ruff: noqa: F811 (tests take the imported `world` fixture as an argument)
from __future__ import annotations

import pytest
import torch
from test_fsdp_one_rank import (
    CPU,
    _full,
    _loss,
    _model,
    world,  # noqa: F401 (the one-rank gloo fixture, shared)
)

from dit.checkpoint import save_checkpoint
from dit.model import VideoDiT
from dynamic_cp.runtime import fsdp
from dynamic_cp.runtime.fsdp_checkpoint import (
    AsyncFSDPCheckpointer,
    load_fsdp_checkpoint,
    save_fsdp_checkpoint,
)

STATE = {"lr_schedule": {"last_epoch": 3}, "bad_steps": 1}


def _trained(world, seed: int = 0):
    """A sharded model, its AdamW after one step, and an EMA that differs from the weights."""
    torch.manual_seed(seed)
    model = fsdp.apply_fsdp(_model(), world, CPU, "no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = fsdp.ShardedEMA(model, decay=0.5)
    _loss(model).backward()
    optimizer.step()
    ema.update(model)
    return model, optimizer, ema


def _values(model, optimizer, ema):
    weights = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    moments = {n: _full(optimizer.state[p]["exp_avg_sq"]).clone() for n, p in model.named_parameters()}
    averages = {n: _full(t).clone() for n, t in ema.params.items()}
    return weights, moments, averages


def _fresh(world):
    model = fsdp.apply_fsdp(_model(), world, CPU, "no")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)  # the checkpoint's lr (1e-2) replaces it
    return model, optimizer, fsdp.ShardedEMA(model, decay=0.5)


def _assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_save_then_load_restores_weights_moments_and_ema_and_writes_the_exports(world, tmp_path):
    model, optimizer, ema = _trained(world)
    weights, moments, averages = _values(model, optimizer, ema)
    config = {"train": {"max_steps": 9}, "model": {"size": "tiny"}}  # not in sorted order
    step_dir = save_fsdp_checkpoint(tmp_path, 3, model, optimizer, ema, STATE, config, 2, world)
    assert step_dir == tmp_path / "step_000003" and (tmp_path / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "config.yaml",
        "ema",
        "model",
        "sharded",
        "trainer.pt",
    ]
    assert (
        step_dir / "config.yaml"
    ).read_text() == "train:\n  max_steps: 9\nmodel:\n  size: tiny\n"  # config's order
    exported = VideoDiT.from_pretrained(step_dir / "model").state_dict()
    for n, w in weights.items():
        assert torch.equal(exported[n], w), n
    exported_ema = VideoDiT.from_pretrained(step_dir / "ema").state_dict()
    for n, w in averages.items():
        assert torch.equal(exported_ema[n], w), n

    model2, optimizer2, ema2 = _fresh(world)
    state = load_fsdp_checkpoint(step_dir, model2, optimizer2, ema2)
    assert (state["step"], state["bad_steps"], state["lr_schedule"]) == (3, 1, {"last_epoch": 3})
    got = _values(model2, optimizer2, ema2)
    for g, w in zip(got, (weights, moments, averages)):
        _assert_same(g, w)
    assert optimizer2.param_groups[0]["lr"] == 1e-2


def test_a_checkpoint_without_ema_starts_the_ema_at_the_weights(world, tmp_path):
    model, optimizer, _ = _trained(world)
    weights = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    step_dir = save_fsdp_checkpoint(tmp_path, 1, model, optimizer, None, STATE, {}, 2, world)
    assert not (step_dir / "ema").exists()
    model2, optimizer2, ema2 = _fresh(world)
    load_fsdp_checkpoint(step_dir, model2, optimizer2, ema2)
    _assert_same({n: _full(t) for n, t in ema2.params.items()}, weights)


def test_resume_from_a_replicated_checkpoint(world, tmp_path):
    torch.manual_seed(0)
    plain = _model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _loss(plain).backward()
    optimizer.step()
    ema = _model()  # any other weights: the EMA export
    state = {**STATE, "optimizer": optimizer.state_dict()}
    step_dir = save_checkpoint(tmp_path, 2, plain, ema, state, {}, 2)
    model2, optimizer2, ema2 = _fresh(world)
    got = load_fsdp_checkpoint(step_dir, model2, optimizer2, ema2)
    assert got["step"] == 2 and "optimizer" not in got
    params = dict(plain.named_parameters())
    _assert_same(
        {n: _full(p).detach() for n, p in model2.named_parameters()},
        {n: p.detach() for n, p in params.items()},
    )
    _assert_same(
        {n: _full(optimizer2.state[p]["exp_avg"]) for n, p in model2.named_parameters()},
        {n: optimizer.state[p]["exp_avg"] for n, p in params.items()},
    )
    _assert_same({n: _full(t) for n, t in ema2.params.items()}, dict(ema.named_parameters()))
    # without an ema/ folder the EMA starts at the checkpoint's weights
    step_dir = save_checkpoint(tmp_path, 4, plain, None, state, {}, 2)
    model3, optimizer3, ema3 = _fresh(world)
    load_fsdp_checkpoint(step_dir, model3, optimizer3, ema3)
    _assert_same({n: _full(t) for n, t in ema3.params.items()}, {n: p.detach() for n, p in params.items()})


def _exported(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize(
    "dtype, with_ema", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)]
)
def test_async_save_exports_the_weights_it_read_back_from_the_shards(world, tmp_path, dtype, with_ema):
    """``train.async_checkpoint`` under FSDP: rank 0's writer thread reads the full weights (and the
    EMA) back from the finished DCP shards for the diffusers exports, instead of gathering them while
    training waits. Those exports must hold the saved step's weights bitwise, in the run's dtype (a
    bf16 run exports bf16), with ema/ only when there is an EMA, and the checkpoint must resume. Planted:
    the read-back buffers in the default dtype, the EMA left out or the model's shapes lost (None), the
    DCP folder not passed to the read: each fails."""
    torch.manual_seed(0)
    model = fsdp.apply_fsdp(_model().to(dtype), world, CPU, "no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = fsdp.ShardedEMA(model, decay=0.5) if with_ema else None
    if dtype == torch.float32:  # a step, so the weights, moments and EMA differ (the tiny model's
        _loss(model).backward()  # loss takes fp32 inputs: the bf16 case saves its initial weights)
        optimizer.step()
        if ema is not None:
            ema.update(model)
    weights = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    saver = AsyncFSDPCheckpointer(world, CPU)
    saver.save(tmp_path, 5, model, optimizer, ema, STATE, {}, 2)
    saver.wait()  # raises RunStopped if the background save failed
    step_dir = tmp_path / "step_000005"
    assert (tmp_path / "latest").read_text().strip() == "step_000005"
    exported = _exported(step_dir / "model")  # the files as written (from_pretrained would upcast some)
    for n, w in weights.items():
        assert exported[n].dtype == dtype and torch.equal(exported[n], w), n
    assert (step_dir / "ema").exists() == with_ema
    if with_ema:
        exported_ema = _exported(step_dir / "ema")
        for n, t in ema.params.items():
            assert exported_ema[n].dtype == dtype and torch.equal(exported_ema[n], _full(t)), n
    model2, optimizer2, ema2 = _fresh(world)
    assert load_fsdp_checkpoint(step_dir, model2, optimizer2, ema2)["step"] == 5


def _failing_writer(monkeypatch, step: int, error: int):
    """DCP's per-item file writer fails with OSError(``error``) once checkpoint ``step``'s first shard
    is written (as a disk that fills up partway, or a folder that turns unwritable, would)."""
    import errno
    import os

    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item
    tag = f"step_{step:06d}"

    def write_item(transforms, stream, data, write_item, storage_key, serialization_format):
        out = real(transforms, stream, data, write_item, storage_key, serialization_format)
        path = str(getattr(stream, "name", ""))
        if tag in path:
            raise OSError(error, os.strerror(error), path)
        return out

    assert error in (errno.ENOSPC, errno.EACCES)
    monkeypatch.setattr(fs, "_write_item", write_item)


def _written_tensor_bytes(step_dir) -> int:
    """The tensor bytes a finished FSDP checkpoint holds, read from its files: every tensor entry
    of DCP's metadata (global shape x element size) plus the data section of every exported
    safetensors file (file size - 8-byte length - JSON header)."""
    import struct

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(step_dir / "sharded")).read_metadata()
    total = 0
    for m in meta.state_dict_metadata.values():
        if isinstance(m, TensorStorageMetadata):
            total += m.size.numel() * torch.empty((), dtype=m.properties.dtype).element_size()
    for f in sorted(step_dir.glob("*/*.safetensors")):
        header = struct.unpack("<Q", f.read_bytes()[:8])[0]
        total += f.stat().st_size - 8 - header
    return total


@pytest.mark.parametrize("with_ema", [True, False])
def test_async_save_on_a_full_disk_stops_with_the_step_the_bytes_and_the_checkpoint_to_resume(
    world, tmp_path, monkeypatch, with_ema
):
    """An async FSDP save whose shards hit a full disk: ``wait`` stops the run with the disk-full line
    naming the step, the file, the bytes the checkpoint needs (exactly the tensor bytes a whole
    checkpoint of this model writes: shards of weights, moments and EMA, plus the exports) and the
    whole checkpoint ``--resume auto`` takes; the half-written ``.tmp`` is gone and ``latest`` still
    points at the previous one. Planted: the byte count without the EMA export (or with a third copy,
    or the no-EMA case doubled, or the sum turned into a difference / quotient), the count not
    computed (None, the state dict itself), the disk-full branch returning None or the folder: each
    fails."""
    import errno

    from data.cli import RunStopped

    model, optimizer, ema = _trained(world)
    ema = ema if with_ema else None
    saver = AsyncFSDPCheckpointer(world, CPU)
    saver.save(tmp_path, 4, model, optimizer, ema, STATE, {}, 2)
    saver.wait()
    _failing_writer(monkeypatch, 5, errno.ENOSPC)
    saver.save(tmp_path, 5, model, optimizer, ema, STATE, {}, 2)
    with pytest.raises(RunStopped) as stop:
        saver.wait()
    line = str(stop.value)
    needed = _written_tensor_bytes(tmp_path / "step_000004")
    assert line.startswith("disk full while saving checkpoint step_000005 ("), line
    assert "step_000005.tmp/sharded/" in line, line  # the file that failed
    assert f"it needs about {needed:,} bytes and " in line, (needed, line)
    assert line.endswith("then rerun with --resume auto: it takes step_000004, which is whole"), line
    assert not (tmp_path / "step_000005.tmp").exists()
    assert (tmp_path / "latest").read_text().strip() == "step_000004"
    saver.wait()  # the failure was reported once: nothing is pending any more


def test_a_failed_async_save_stops_the_run_at_a_check_with_its_step_and_error(world, tmp_path, monkeypatch):
    """A background save that fails (here the shards' folder turns unwritable) stops the run at the
    next ``check`` after it ended, with one line naming the checkpoint and the error, and nothing is
    committed. Planted: ``check`` skipping a pending save (``is`` -> ``is not``), the failure flag
    compared with 1 instead of 0 (the failure forgotten), the local error reported as another rank's,
    the message returned as None or as a plain string: each fails."""
    import errno
    import time

    from data.cli import RunStopped

    model, optimizer, ema = _trained(world)
    _failing_writer(monkeypatch, 3, errno.EACCES)
    saver = AsyncFSDPCheckpointer(world, CPU)
    saver.save(tmp_path, 3, model, optimizer, ema, STATE, {}, 2)
    with pytest.raises(RunStopped) as stop:
        for _ in range(6000):  # a check per training step until the save has ended (60 s at most)
            saver.check()
            time.sleep(0.01)
    line = str(stop.value)
    assert line.startswith("the background save of checkpoint step_000003 failed: "), line
    assert "Permission denied" in line and "\n" not in line, line
    assert not (tmp_path / "latest").exists() and not (tmp_path / "step_000003").exists()
    saver.check()  # reported once: nothing is pending any more
    saver.wait()


def test_check_never_waits_for_a_pending_async_save_and_wait_does(world, tmp_path, monkeypatch):
    """While rank 0's writer is still busy (held here at its kill point, after the shards, before the
    export), ``check`` returns at once and the step is not committed; ``wait`` blocks until the save
    is on disk and ``latest`` points at it. The writer is a daemon thread: a run that stops on an
    error elsewhere exits instead of hanging on a save that can no longer finish. Planted: ``not
    done`` as ``done``, the pending flag compared with 1 or with ``!=`` (check joins the writer), the
    failure flag read from the pending one (check stops a healthy run), a non-daemon writer: each
    fails."""
    import threading

    from dynamic_cp.runtime import fsdp_checkpoint

    model, optimizer, ema = _trained(world)
    release = threading.Event()
    # a check that joined the writer would wait here 20 s, then find the step committed (and fail)
    monkeypatch.setattr(fsdp_checkpoint, "kill_point_for_tests", lambda step: release.wait(timeout=20))
    saver = AsyncFSDPCheckpointer(world, CPU)
    saver.save(tmp_path, 2, model, optimizer, ema, STATE, {}, 2)
    try:
        assert saver._thread.daemon
        saver.check()
        saver.check()
        assert not (tmp_path / "latest").exists() and (tmp_path / "step_000002.tmp").is_dir()
    finally:
        release.set()
    saver.wait()
    assert (tmp_path / "latest").read_text().strip() == "step_000002"
    assert not (tmp_path / "step_000002.tmp").exists()


def test_a_rank_whose_own_save_succeeded_names_the_failed_checkpoint(world):
    """When another rank's background save failed, this rank (no error of its own) stops with a line
    naming the checkpoint and pointing at that rank's line. Spawned ranks run the whole path in
    tests/test_faults_fsdp.py; here the line itself. Planted: None or a plain string returned
    (``raise`` then fails with a TypeError): each fails."""
    from data.cli import RunStopped

    saver = AsyncFSDPCheckpointer(world, CPU)
    saver._step = 7
    stop = saver._stop()
    assert isinstance(stop, RunStopped)
    assert str(stop) == "the background save of checkpoint step_000007 failed on another rank (see its line)"


def test_both_experts_export_into_their_wan22_folders(world, tmp_path):
    """model.expert=both under FSDP: the export holds each expert's weights in its Wan2.2 folder
    (transformer/: high, transformer_2/: low) beside model_index.json, as from_pretrained reads them.
    Planted: the folder path built with ``*`` instead of ``/`` (a TypeError: no export): fails."""
    from dit.experts import ExpertPair

    torch.manual_seed(0)
    high, low = _model(), _model()
    with torch.no_grad():
        for p in low.parameters():
            p.mul_(-1.0)  # the two experts differ
    pair = ExpertPair(fsdp.apply_fsdp(high, world, CPU, "no"), fsdp.apply_fsdp(low, world, CPU, "no"), 0.875)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (high, low)]
    step_dir = save_fsdp_checkpoint(tmp_path, 1, pair, optimizers, None, STATE, {}, 2, world)
    assert (step_dir / "model" / "model_index.json").is_file()
    for expert, folder in ((high, "transformer"), (low, "transformer_2")):
        exported = _exported(step_dir / "model" / folder)
        _assert_same(exported, {n: _full(p).detach() for n, p in expert.named_parameters()})
