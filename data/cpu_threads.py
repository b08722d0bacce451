"""How many threads one process computes with on the CPU: the cores left free by the machine's load.

torch starts one thread per core. On a machine whose cores other work keeps busy, those threads wait
on each other at every parallel region (each op ends when its slowest thread does, and a thread that
is descheduled holds up the rest): measured on 2 cores at load 6-15, a tiny-config step took 17-41 s
at torch's 2 threads against 3.3 s at 1 (docs/training.md, "Threads on a CPU"). So a CPU run takes
the cores the 1-minute load leaves free, at least one; OMP_NUM_THREADS, when set, is kept as the
user's choice (torchrun sets it to 1 for its workers, which then take ``join_torchrun``'s share).

    note = set_cpu_threads()   # -> a line saying what was chosen and why, or None: torch's default stands
"""

from __future__ import annotations

import os

import torch


def cpu_threads(cores: int, load: float) -> int:
    """Threads for one process on ``cores`` cores with ``load`` runnable tasks already (1-minute load
    average): the free cores, rounded to the nearest, at least 1 and at most ``cores``."""
    return max(1, min(cores, round(cores - load)))


def available_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_cpu_threads() -> str | None:
    """Fewer torch threads for a run on a loaded CPU; -> a line to print saying so, or None where
    torch's default stands: on CUDA, with OMP_NUM_THREADS set, or when the load leaves every core."""
    if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS") or not hasattr(os, "getloadavg"):
        return None
    cores, load = available_cores(), os.getloadavg()[0]
    threads = cpu_threads(cores, load)
    if threads >= torch.get_num_threads():
        return None
    torch.set_num_threads(threads)
    return (
        f"cpu: {threads} of {cores} threads (load {load:.1f}: busy cores slow every thread down); "
        "set OMP_NUM_THREADS to choose"
    )
