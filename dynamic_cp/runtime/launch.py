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

from dit.checkpoint import resolve_checkpoint
from dit.config import Config
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.fsdp import auto_fsdp_choice, memory_per_rank, resolve_fsdp_mode
from dynamic_cp.runtime.fsdp_trainer import FSDPTrainer
from dynamic_cp.runtime.timeouts import nccl_flight_recorder_env, startup_timeout


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


def train_distributed(
    cfg: Config, world: dist.ProcessGroup, resume: str | None = None, device: torch.device | None = None
) -> DistributedTrainer:
    """Train on an initialized process group (``world``); returns the trainer (tests read it)."""
    cfg = resolve_auto_fsdp(cfg, world, device, resume)
    trainer = trainer_class(cfg, world)(cfg, world, resume=resume, device=device)
    trainer.train()
    return trainer


def init_world(backend: str, timeout) -> None:
    """``init_process_group`` from torchrun's environment, on a fresh key space for each restart.

    torchrun (c10d rendezvous) keeps one store for all attempts of a job, and the workers' keys
    carry no attempt number: the ranks of a restarted attempt would read the addresses the dead
    attempt published (gloo: "connectFullMesh failed ... Connection refused"). Prefixing the keys
    with TORCHELASTIC_RESTART_COUNT gives every attempt its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def run_distributed(cfg: Config, resume: str | None = None) -> None:
    """Entry point of ``train.py`` for parallel.mode != 'none': one process per rank, from torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"parallel.mode={cfg.parallel.mode} needs one process per rank: launch with "
            "`torchrun --nproc_per_node=N train.py ...` (or set parallel.mode=none for one process)"
        )
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        nccl_flight_recorder_env(cfg.output_dir)  # before the process group reads the environment
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Several ranks share the cores of one machine; oversubscribed threads only slow gloo down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    # start-up's timeout; DistributedTrainer shortens it to parallel.timeout_s after the first step
    init_world(backend, startup_timeout(cfg.parallel.timeout_s))
    try:
        train_distributed(cfg, dist.group.WORLD, resume=resume, device=device)
    finally:
        dist.destroy_process_group()
