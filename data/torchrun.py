"""Joining the process group that torchrun describes: ``python -m data.cache`` and ``train.py`` both do.

It sits in ``data/``, the bottom layer, because the cache builder launches under torchrun as the
trainer does and ``data/`` imports nothing above it. Which groups a run builds on this world is
``dynamic_cp``'s business; the trainer adds NCCL's flight recorder (``dynamic_cp/runtime/torchrun.py``).

device = join_torchrun()   # nccl and cuda:LOCAL_RANK with GPUs, gloo and cpu without
...
leave_torchrun()           # every group's threads and sockets closed before the process exits
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def join_torchrun(timeout: timedelta = timedelta(minutes=30)) -> torch.device:
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


def leave_torchrun() -> None:
    """Destroy every process group and free it now, while the interpreter is whole.

    ``destroy_process_group`` only unregisters the groups: a group's gloo threads and sockets live as
    long as its Python object, and a trainer's reference cycles keep those until the interpreter's
    final collection. Seen after train.py's main had returned on a 3-rank dynamic run: ranks 0 and 1
    still ran two groups' gloo threads (``gloo_tcp_loop``, ``pt_gloo_runloop``), rank 2 one. They were
    then torn down while Python finalized and the C++ runtime ran its exit handlers, as the peers
    exited and closed their ends of the same sockets: 1 in 15 finished runs ended with SIGABRT on
    one rank (issue 54). A collection here joins those threads before anything else ends; the caller
    must hold no reference to a group (a trainer, a plan's CP groups) by then."""
    dist.destroy_process_group()
    gc.collect()
