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

Resuming an FSDP run from a replicated (``fsdp=none``) checkpoint loads its consolidated weights and
its plain AdamW state dict (parameter order = ``model.parameters()``), each rank keeping its shards.
"""

from __future__ import annotations

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

from dit.checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    export_pretrained,
    kill_point_for_tests,
    load_trainer_state,
    rng_state,
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
) -> Path | None:
    """Collective: every rank calls it. Returns the step directory on rank 0, None elsewhere."""
    import yaml

    is_main = dist.get_rank(world) == 0
    tmp = root / f"step_{step:06d}.tmp"
    if is_main:
        begin_checkpoint(root, step)
    dist.barrier(group=world)  # the fresh tmp directory exists before anyone writes into it
    dcp.save(_sharded_state(model, optimizer, ema), checkpoint_id=tmp / SHARDED, process_group=world)
    if is_main:
        kill_point_for_tests(step)  # test-only, off by default: sharded/ written, the export not yet
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ema_full = ema.full_state_dict(is_main) if ema is not None else None
    final = None
    if is_main:
        export_pretrained(model.config, full, tmp / "model")
        if ema_full is not None:
            export_pretrained(model.config, ema_full, tmp / "ema")
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer.pt")
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        final = commit_checkpoint(root, step, keep)
    dist.barrier(group=world)  # nobody reads or rewrites checkpoints before rank 0 committed
    return final


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

    full = _read_pretrained(model.config, step_dir / "model", load_weights)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, full, options=options)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    plain = state.pop("optimizer")
    by_name = {
        "state": {names[i]: s for i, s in plain["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in plain["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
    if ema is not None:
        ema_dir = step_dir / "ema" if (step_dir / "ema").is_dir() else step_dir / "model"
        ema_full = _read_pretrained(model.config, ema_dir, load_weights)
        for name, t in ema.params.items():
            t.copy_(torch.distributed.tensor.distribute_tensor(ema_full[name], t.device_mesh, t.placements))
    return state


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
