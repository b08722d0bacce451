"""Joining the process group that torchrun describes: shared by train.py and ``python -m data.cache``.

device = init_torchrun()   # nccl and cuda:LOCAL_RANK with GPUs, gloo and cpu without
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from dynamic_cp.runtime.timeouts import nccl_flight_recorder_env


def init_torchrun(
    timeout: timedelta = timedelta(minutes=30), flight_recorder_dir: str | None = None
) -> torch.device:
    """Initialize the default process group from torchrun's environment; -> this rank's device.

    flight_recorder_dir: where NCCL's flight recorder dumps its trace when a collective times out
    (set in the environment before the process group reads it); None leaves it off."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
        if flight_recorder_dir is not None:
            nccl_flight_recorder_env(flight_recorder_dir)
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # Several ranks share the cores of one machine; oversubscribed threads only slow gloo down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    init_world(backend, timeout)
    return device


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
