"""Entry points of the multi-process runtime: ``train.py`` under torchrun, and tests.

    torchrun --nproc_per_node=4 train.py --config configs/tiny.yaml parallel.mode=dynamic parallel.fsdp=per_layer

``trainer_class`` picks the replicated ``DistributedTrainer`` or the sharded ``FSDPTrainer`` from
``parallel.fsdp`` (resolved by ``dynamic_cp.runtime.fsdp.resolve_fsdp_mode``).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from data.torchrun import leave_torchrun
from dit.checkpoint import resolve_checkpoint
from dit.config import Config
from dynamic_cp.planning.pipeline_stages import check_pipeline
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.fsdp import auto_fsdp_choice, memory_per_rank, model_dims_of, resolve_fsdp_mode
from dynamic_cp.runtime.fsdp_trainer import FSDPTrainer
from dynamic_cp.runtime.pipeline import check_pipeline_options
from dynamic_cp.runtime.step_plans import cp_sizes_of, stage_layers_of
from dynamic_cp.runtime.timeouts import startup_timeout
from dynamic_cp.runtime.torchrun import init_torchrun


def trainer_class(cfg: Config, world: dist.ProcessGroup) -> type[DistributedTrainer]:
    """DistributedTrainer for replicated weights, FSDPTrainer when ``parallel.fsdp`` shards them."""
    if resolve_fsdp_mode(cfg, dist.get_world_size(world)) == "none":
        return DistributedTrainer
    return FSDPTrainer


def resolve_auto_fsdp(
    cfg: Config, world: dist.ProcessGroup, device: torch.device | None = None, resume: str | None = None
) -> Config:
    """``cfg`` with ``parallel.fsdp: auto`` replaced by the mode the memory model picks for the
    smallest memory of any rank (one all-reduce, so every rank picks the same mode); rank 0 logs the
    choice and the memory it expects. Resuming a sharded checkpoint stays sharded: where 'none' would
    fit, 'per_step' does too (it holds less), and it reads the checkpoint's DCP shards. Other modes
    come back unchanged."""
    if cfg.parallel.fsdp != "auto":
        return cfg
    memory = torch.tensor([memory_per_rank(cfg)], dtype=torch.float64, device=device)
    dist.all_reduce(memory, op=dist.ReduceOp.MIN, group=world)
    world_size = dist.get_world_size(world)
    mode, expected, cap = auto_fsdp_choice(cfg, world_size, memory.item())
    why = ""
    if mode == "none" and resume is not None and (resolve_checkpoint(resume) / "sharded").is_dir():
        mode, why = "per_step", " (resuming a sharded checkpoint)"
    if dist.get_rank(world) == 0:
        print(
            f"parallel.fsdp=auto -> {mode}{why}: expects {expected / 1e9:.2f} GB per rank of "
            f"{memory.item() / 1e9:.1f} GB ({cap:,} tokens per rank, {world_size} ranks)",
            flush=True,
        )
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, fsdp=mode))


def resolve_auto_offload(cfg: Config, world: dist.ProcessGroup, device: torch.device | None = None) -> Config:
    """``cfg`` with ``model.offload_blocks: auto`` replaced by the fewest blocks whose offload makes the
    run fit the smallest memory of any rank (``run_memory.offload_count``); rank 0 logs it."""
    if cfg.model.offload == "none" or cfg.model.offload_blocks != "auto":
        return cfg
    from dynamic_cp.runtime.fsdp import model_dims_of
    from dynamic_cp.runtime.run_memory import offload_count
    from dynamic_cp.runtime.step_plans import cap_tokens_of

    memory = torch.tensor([memory_per_rank(cfg)], dtype=torch.float64, device=device)
    dist.all_reduce(memory, op=dist.ReduceOp.MIN, group=world)
    dims = model_dims_of(cfg)
    blocks = offload_count(cfg, dist.get_world_size(world), dims, cap_tokens_of(cfg), memory.item())
    if dist.get_rank(world) == 0:
        print(f"model.offload_blocks=auto -> {blocks} of {dims.layers} blocks on the host", flush=True)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, offload_blocks=blocks))


def train_distributed(
    cfg: Config, world: dist.ProcessGroup, resume: str | None = None, device: torch.device | None = None
) -> DistributedTrainer:
    """Train on an initialized process group (``world``); returns the trainer (tests read it)."""
    cfg = resolve_auto_offload(resolve_auto_fsdp(cfg, world, device, resume), world, device)
    trainer = trainer_class(cfg, world)(cfg, world, resume=resume, device=device)
    trainer.train()
    return trainer


def check_world_size(cfg: Config, world_size: int) -> None:
    """The checks that need only the number of ranks: pipeline stages, CP sizes, the weight-sharding
    mode. Run before any process group starts, so a mistake stops every rank at once with its one
    line, before minutes of start-up and with no collective left waiting for a rank that quit."""
    p = cfg.parallel
    dims = model_dims_of(cfg)
    check_pipeline(world_size, p.pp_size, dims.layers)
    plan_size = world_size // p.pp_size  # the ranks each stage's plan spreads clips over
    if p.pp_size > 1:
        check_pipeline_options(cfg)
        stage_layers_of(cfg, dims)
    cp_sizes_of(cfg, plan_size)
    if p.fsdp != "auto":  # 'auto' is chosen from every rank's memory, after the process group starts
        resolve_fsdp_mode(cfg, world_size)


def run_distributed(cfg: Config, resume: str | None = None) -> None:
    """Entry point of ``train.py`` for parallel.mode != 'none': one process per rank, from torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"parallel.mode={cfg.parallel.mode} needs one process per rank: launch with "
            "`torchrun --nproc_per_node=N train.py ...` (or set parallel.mode=none for one process)"
        )
    check_world_size(cfg, int(os.environ["WORLD_SIZE"]))
    # start-up's timeout; DistributedTrainer shortens it to parallel.timeout_s after the first step
    device = init_torchrun(startup_timeout(cfg.parallel.timeout_s), flight_recorder_dir=cfg.output_dir)
    try:
        # The trainer is dropped here, so leave_torchrun can free its groups. No barrier first: rank 0
        # may still be writing an async checkpoint for longer than parallel.timeout_s.
        train_distributed(cfg, dist.group.WORLD, resume=resume, device=device)
    finally:
        leave_torchrun()
