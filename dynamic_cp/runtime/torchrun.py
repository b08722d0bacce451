"""Joining the process group that torchrun describes: shared by train.py and ``python -m data.cache``.

device = init_torchrun()   # nccl and cuda:LOCAL_RANK with GPUs, gloo and cpu without
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_torchrun(timeout: timedelta = timedelta(minutes=30)) -> torch.device:
    """Initialize the default process group from torchrun's environment; -> this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Several ranks share the cores of one machine; oversubscribed threads only slow gloo down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group(backend, timeout=timeout)
    return device


class ProcessGroupWorld:
    """``data.cache_shards.World`` over a process group: the ranks that build one cache together."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None):
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = device or torch.device("cpu")  # nccl reduces tensors on the GPU only

    def sum(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()
