"""Run a function on a few CPU processes joined by gloo: for tests and benchmarks of CP code.

    results = run_gloo(worker, 4, case_list)   # worker(rank, world_size, case_list) -> picklable

The rendezvous is a FileStore in a fresh temporary directory, so concurrent runs never fight over a
port. Processes are forked where the platform allows: they inherit the imported modules (torch,
diffusers), which otherwise take most of a short test's time to import again in every process. Each process uses one intra-op thread: several processes share few cores, and oversubscribed
threads make gloo timeouts likely rather than anything faster.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store_dir: str, fn: Callable, args: tuple, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_dir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(store_dir, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Start ``world_size`` gloo processes running ``fn(rank, world_size, *args)``; return their results.

    ``fn`` should be importable (module level) so that it also works where processes are spawned.
    An exception in any process is raised here.
    """
    if "diffusers" in sys.modules:
        # diffusers imports its hooks (and through them peft and transformers) on a model's first
        # .to(): tens of seconds per process on a loaded machine, paid once here for all children.
        importlib.import_module("diffusers.hooks")
    # A forked child would inherit a process group or a CUDA context of this process: spawn then.
    can_fork = "fork" in mp.get_all_start_methods() and not dist.is_initialized()
    start_method = "fork" if can_fork and not torch.cuda.is_initialized() else "spawn"
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(
            _entry,
            args=(world_size, store_dir, fn, args, timeout_s),
            nprocs=world_size,
            join=True,
            start_method=start_method,
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(store_dir, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def run_gloo_cases(fn: Callable, world_size: int, *args, timeout_s: float = 120) -> dict[str, list]:
    """Run ``fn`` (returning {case: result}) on every rank; -> {case: [result of rank 0, 1, ...]}."""
    merged: dict[str, list] = {}
    for per_rank in run_gloo(fn, world_size, *args, timeout_s=timeout_s):
        for key, value in per_rank.items():
            merged.setdefault(key, []).append(value)
    return merged
