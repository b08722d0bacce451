"""Sharded checkpoints of FSDP runs with ``torch.distributed.checkpoint`` (DCP), plus the diffusers export.

Layout of ``<output_dir>/checkpoints/step_000100/`` under ``parallel.fsdp=per_step|per_layer``:
    sharded/        DCP: {"model", "optim", "ema"}: every rank writes its own shards (no gather)
    model/, ema/    save_pretrained of the full weights (gathered to rank 0 on the CPU): what
                    sample.py and diffusers' ``from_pretrained`` load
    trainer.pt      LR schedule, step, counters and RNG states (the optimizer lives in sharded/)
    config.yaml     the full resolved config
Atomic as the replicated checkpoints (``dit/checkpoint.py``): everything goes into ``step_X.tmp``;
rank 0 renames it and points ``latest`` at it only after DCP's save returned on rank 0 (its metadata
is written after every rank's shards) and the export is on disk. DCP stores each tensor's global
shape and each shard's offsets, so a run resumes on any world size: loading reshards.
``train.async_checkpoint`` writes the same layout from background threads (``AsyncFSDPCheckpointer``:
DCP's ``async_save``), committed the same way.

Resuming an FSDP run from a replicated (``fsdp=none``) checkpoint loads its consolidated weights and
its plain AdamW state dict (parameter order = ``model.parameters()``), each rank keeping its shards.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from data.cli import RunStopped
from dit.checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    disk_full_stop,
    export_pretrained,
    is_disk_full,
    kill_point_for_tests,
    load_trainer_state,
    nbytes,
    rng_state,
    save_trainer_state,
    stop_on_full_disk,
)
from dynamic_cp.runtime.fsdp import ShardedEMA

SHARDED = "sharded"


def _sharded_state(model, optimizer, ema: ShardedEMA | None) -> dict:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = ema.params  # DTensors, loaded in place
    return state


def save_fsdp_checkpoint(
    root: Path,
    step: int,
    model,
    optimizer,
    ema: ShardedEMA | None,
    trainer_state: dict,
    config: dict,
    keep: int,
    world: dist.ProcessGroup,
    extra_files: dict[str, str] | None = None,
) -> Path | None:
    """Collective: every rank calls it. Returns the step directory on rank 0, None elsewhere.
    A full disk stops every rank with one line (``dit.checkpoint.stop_on_full_disk``).
    ``extra_files``: more {name: text} files for the folder (rank 0's), as ``dit.checkpoint`` takes."""
    is_main = dist.get_rank(world) == 0
    tmp = root / f"step_{step:06d}.tmp"
    state = {**trainer_state, "rng": rng_state()}  # before DCP's save, which draws from `random`
    if is_main:
        begin_checkpoint(root, step)
    dist.barrier(group=world)  # the fresh tmp directory exists before anyone writes into it
    sharded = _sharded_state(model, optimizer, ema)
    with stop_on_full_disk(tmp, lambda: _checkpoint_bytes(sharded, model, ema)):
        # DCP gathers every rank's write result: a full disk on any rank fails the save on all
        dcp.save(sharded, checkpoint_id=tmp / SHARDED, process_group=world)
    kill_point_for_tests(step)  # test-only, off by default: sharded/ written, the export not yet
    full, ema_full = _full_weights(model, ema, is_main)
    error = None
    if is_main:
        try:
            with stop_on_full_disk(tmp, lambda: _checkpoint_bytes(sharded, model, ema)):
                _write_export(tmp, step, model, full, ema_full, state, config, extra_files)
        except RunStopped as err:
            error = err
    _raise_on_every_rank(error, step, world)  # nobody goes on while rank 0 failed or has not committed
    return commit_checkpoint(root, step, keep) if is_main else None


def _checkpoint_bytes(sharded: dict, model, ema) -> int:
    """About what a checkpoint writes: the shards of every rank (a DTensor counts its global size)
    and the exported full weights (model/, ema/)."""
    return nbytes(sharded) + nbytes(model) * (2 if ema is not None else 1)


def _full_weights(model, ema: ShardedEMA | None, is_main: bool):
    """Collective: the full weights and EMA, gathered to rank 0's CPU (fresh tensors: a staged copy)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ema_full = ema.full_state_dict(is_main) if ema is not None else None
    return full, ema_full


def _full_shapes(state: dict | None) -> dict[str, tuple[torch.Size, torch.dtype]] | None:
    """{name: (global shape, dtype)} of a (sharded) state dict: what ``_read_full`` allocates."""
    if state is None:
        return None
    return {k: (t.shape, t.dtype) for k, t in state.items()}  # a DTensor's shape is the global one


def _read_full(sharded_dir: Path, model_shapes: dict, ema_shapes: dict | None):
    """Rank 0, no collective: the full weights (and EMA) read back from a finished DCP folder, every
    rank's shards joined (the same bytes a gather returns)."""
    state = {"model": {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in model_shapes.items()}}
    if ema_shapes is not None:
        state["ema"] = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in ema_shapes.items()}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=sharded_dir, no_dist=True)
    return state["model"], state.get("ema")


def _write_export(
    tmp: Path, step: int, model, full, ema_full, trainer_state: dict, config: dict, extra_files: dict | None
) -> None:
    """Rank 0: model/, ema/, trainer.pt, config.yaml and the extra files into ``tmp``."""
    import yaml

    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)

    _export(model, full, tmp / "model")
    if ema_full is not None:
        _export(model, ema_full, tmp / "ema")
    save_trainer_state(tmp / "trainer.pt", {**trainer_state, "step": step})
    (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def _raise_on_every_rank(error: BaseException | None, step: int, world: dist.ProcessGroup) -> None:
    """Collective: rank 0's failure (or None) reaches every rank, which all stop at the same point
    instead of the others waiting in the next collective until the timeout."""
    box = [None if error is None else str(error)]
    dist.broadcast_object_list(box, src=0, group=world)
    if error is not None:
        raise error
    if box[0] is not None:
        raise RunStopped(f"rank 0 failed to save checkpoint step {step} (its error line says why)")


class AsyncFSDPCheckpointer:
    """``train.async_checkpoint`` under FSDP: DCP's ``async_save``.

    At the save every rank stages its shards (model, optimizer, EMA) into CPU memory (DCP's
    ``DefaultStager``, synchronous: copied when ``async_save`` returns); nothing else is moved while
    training waits. DCP then writes the shards from a thread; its collectives (plan, metadata) run on
    a gloo group of their own, so they never interleave with training's. On rank 0 a second thread
    waits for DCP's future (its ``.metadata`` is written after every rank's shards), reads the full
    weights and EMA back from those files (no collective: the gather a sync save makes would stall
    training), writes the export, trainer.pt and the config into ``step_X.tmp`` and renames it: a
    crash before that leaves the previous checkpoint whole and a ``.tmp`` that resume skips.

    One save in flight: the next save and the end of the run wait for it. Failures: at every step
    while a save is pending, ``check`` all-reduces (failed here, not done here) over the world, so
    every rank learns of a failure on any rank (a full disk, rank 0's export) at the same step and
    stops with one line. Host memory: a CPU copy of this rank's shards until DCP has written them;
    rank 0 also holds the full weights and EMA while it writes the export.
    """

    def __init__(self, world: dist.ProcessGroup, device: torch.device):
        self.world, self.device = world, device
        self.is_main = dist.get_rank(world) == 0
        # collective: every rank builds it at start-up. async_save needs a CPU backend; its own group
        # keeps its background collectives apart from training's (the order of collectives on one
        # group must be the same on every rank, and a thread's timing is not)
        self.group = dist.new_group(ranks=list(range(dist.get_world_size(world))), backend="gloo")
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._step, self._tmp, self._needed = 0, Path(), 0

    def save(
        self, root: Path, step: int, model, optimizer, ema, trainer_state: dict, config: dict, keep: int,
        extra_files: dict[str, str] | None = None,
    ):  # fmt: skip
        self.wait()
        tmp = root / f"step_{step:06d}.tmp"
        state = {**trainer_state, "rng": rng_state()}  # the saved step's, as a sync save takes it
        if self.is_main:
            begin_checkpoint(root, step)
        dist.barrier(group=self.world)
        sharded = _sharded_state(model, optimizer, ema)
        self._needed = _checkpoint_bytes(sharded, model, ema)
        future = dcp.async_save(sharded, checkpoint_id=tmp / SHARDED, process_group=self.group)
        # staged: training may go on now. The export's full weights are read back from the written
        # shards by rank 0's thread, not gathered here: a gather would stall training for as long
        # as moving the weights and EMA over the network takes
        full, ema_full = _full_shapes(sharded.get("model")), _full_shapes(sharded.get("ema"))
        self._step, self._tmp, self._error = step, tmp, None
        self._done.clear()
        self._thread = threading.Thread(
            target=self._finish,
            args=(future, root, step, tmp, model, full, ema_full, state, config, keep, extra_files),
            name="checkpoint-writer",
            daemon=True,
        )
        self._thread.start()

    def _finish(self, future, root, step, tmp, model, full, ema_full, state, config, keep, extra) -> None:
        try:
            future.result()
            kill_point_for_tests(step)  # test-only, off by default: sharded/ written, the export not yet
            if self.is_main:
                full, ema_full = _read_full(tmp / SHARDED, full, ema_full)
                _write_export(tmp, step, model, full, ema_full, state, config, extra)
                commit_checkpoint(root, step, keep)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            self._error = err
        finally:
            self._done.set()

    def wait_staged(self) -> None:
        """Nothing to wait for: staged before ``save`` returned."""

    def check(self) -> None:
        """Collective while a save is pending (every rank has the same pending state): stop every
        rank if the save failed on any; forget it once done on all."""
        if self._thread is None:
            return
        done = self._done.is_set()
        flags = torch.tensor([float(done and self._error is not None), float(not done)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.world)
        if flags[0] > 0:
            self._thread.join()
            self._thread = None
            raise self._stop()
        if flags[1] == 0:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        """Block until the save in flight is on disk on every rank; stop every rank if it failed."""
        if self._thread is None:
            return
        self._thread.join()
        self.check()

    def _stop(self) -> RunStopped:
        err = self._error
        tmp_name = f"step_{self._step:06d}"
        if err is None:
            return RunStopped(
                f"the background save of checkpoint {tmp_name} failed on another rank (see its line)"
            )
        if isinstance(err, RunStopped):
            return err
        if is_disk_full(err):
            return disk_full_stop(self._tmp, self._needed, err)
        return RunStopped(f"the background save of checkpoint {tmp_name} failed: {str(err).splitlines()[-1]}")


def _export(model, full: dict[str, torch.Tensor], directory: Path) -> None:
    """save_pretrained of ``full``: one VideoDiT, or (model.expert=both) each expert into its folder."""
    from dit.experts import ExpertPair

    if not isinstance(model, ExpertPair):
        export_pretrained(model.config, full, directory)
        return
    from dit.wan_pipeline_folders import EXPERT_FOLDERS

    for name, folder in EXPERT_FOLDERS.items():
        prefix = f"{name}."
        part = {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}
        export_pretrained(getattr(model, name).config, part, directory / folder)
    model.write_index(directory)


def load_fsdp_checkpoint(step_dir: Path, model, optimizer, ema: ShardedEMA | None) -> dict:
    """Collective: load ``step_dir`` into the sharded model, optimizer and EMA; -> the trainer state."""
    state = load_trainer_state(step_dir)
    if (step_dir / SHARDED).is_dir():
        sharded = _sharded_state(model, optimizer, ema)
        if ema is not None and not _has_ema(step_dir):
            del sharded["ema"]
        dcp.load(sharded, checkpoint_id=step_dir / SHARDED, planner=None)
        set_model_state_dict(model, sharded["model"])
        set_optimizer_state_dict(model, optimizer, sharded["optim"])
        if ema is not None and "ema" not in sharded:  # saved without EMA: start it at the weights
            _reset_ema(ema, model)
        return state
    # A replicated checkpoint: full weights and a plain AdamW state dict, read by every rank.
    from dit.checkpoint import load_weights
    from dit.experts import ExpertPair

    if isinstance(model, ExpertPair):
        raise ValueError(
            f"{step_dir} is a replicated (parallel.fsdp=none) checkpoint and model.expert=both under FSDP "
            "resumes sharded ones only; resume it with parallel.fsdp=none, or start from its weights with "
            f"model.pretrained={step_dir / 'model'}"
        )

    full = _read_pretrained(model.config, step_dir / "model", load_weights)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    plain = state.pop("optimizer")
    by_name = {
        "state": {names[i]: s for i, s in plain["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in plain["param_groups"]],
    }
    ema_full = None
    if ema is not None:
        ema_dir = step_dir / "ema" if (step_dir / "ema").is_dir() else step_dir / "model"
        ema_full = _read_pretrained(model.config, ema_dir, load_weights)
    load_full_state(model, optimizer, ema, full, by_name, ema_full)
    return state


def load_full_state(model, optimizer, ema: ShardedEMA | None, full: dict, by_name: dict, ema_full) -> None:
    """Full weights, an optimizer state dict keyed by parameter name and the full EMA (every rank holds
    them all) into the sharded model, optimizer and EMA, each rank keeping its shards."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, full, options=options)
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
    if ema is not None:
        for name, t in ema.params.items():
            t.copy_(torch.distributed.tensor.distribute_tensor(ema_full[name], t.device_mesh, t.placements))


def _has_ema(step_dir: Path) -> bool:
    meta = dcp.FileSystemReader(str(step_dir / SHARDED)).read_metadata()
    return any(k.startswith("ema.") for k in meta.state_dict_metadata)


@torch.no_grad()
def _reset_ema(ema: ShardedEMA, model) -> None:
    for (_, t), p in zip(ema.params.items(), model.parameters()):
        t.copy_(p.detach())


def _read_pretrained(config, directory: Path, load_weights) -> dict[str, torch.Tensor]:
    from dit.model import VideoDiT

    model = VideoDiT.from_config(config)  # CPU, full size: what the replicated run held anyway
    load_weights(model, directory)
    return model.state_dict()
