"""Bounded hangs: collective timeouts, NCCL's flight recorder, and a one-line report of a timeout.

A rank that dies is torchrun's business (it restarts every worker). A rank that *hangs* (a stuck
GPU, a SIGSTOP, a deadlocked reader) leaves the others waiting in their next collective, forever
unless the process group has a timeout. As torchtitan does:

- start-up and the first step get ``STARTUP_FACTOR`` x ``parallel.timeout_s`` (300 s by default):
  process-group set-up, the step-0 validation on rank 0 alone, compiling, the first plan;
- every later collective gets ``parallel.timeout_s`` (100 s by default). Validation, samples and
  checkpoints, which rank 0 may do alone while the others wait, run under the start-up timeout
  again (``DistributedTrainer.side_work``).

On NCCL, ``nccl_flight_recorder_env`` makes every rank keep a ring buffer of its last collectives
and dump it on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``); docs/runtime.md says how to read the dumps.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
STARTUP_FACTOR = 3.0  # torchtitan: 300 s at start-up, 100 s after the first step


def startup_timeout(timeout_s: float) -> timedelta:
    return timedelta(seconds=STARTUP_FACTOR * timeout_s)


def set_collective_timeout(seconds: float) -> None:
    """The timeout of every process group of this process (the world, the CP groups, FSDP's mesh):
    a group keeps the timeout it was created with unless told otherwise."""
    # _set_pg_timeout is private, as in torchtitan, which uses it for the same switch after step 1
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def nccl_flight_recorder_env(output_dir: str) -> Path:
    """Before ``init_process_group("nccl")``: abort a timed-out collective instead of waiting forever
    (async error handling), and dump each rank's last collectives on a timeout, to
    ``<output_dir>/flight_recorder/rank_<N>``. Values the user set are kept. -> the dump folder."""
    folder = Path(output_dir) / "flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # tear down the process group, not the job
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # collectives kept per rank (torchtitan's default)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / "rank_"))
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "rank_"))  # its older name
    return folder


TIMEOUT_TEXT = ("Timed out", "timed out", "Timeout", "timeout")


def describe_timeout(err: BaseException) -> str | None:
    """``"all_reduce (called from dynamic_cp/runtime/step_strategies.py:47 in sum_gradients)"``
    for a collective that timed out, read from ``err``'s traceback; None when ``err`` is no timeout."""
    if not isinstance(err, RuntimeError) or not any(t in str(err) for t in TIMEOUT_TEXT):
        return None
    frames = traceback.extract_tb(err.__traceback__)
    inside = [i for i, f in enumerate(frames) if f"torch{os.sep}distributed{os.sep}" in f.filename]
    if not inside:
        return "a collective"
    c10d = [i for i in inside if frames[i].filename.endswith("distributed_c10d.py")]
    name = frames[c10d[0]].name if c10d else frames[inside[-1]].name
    first = c10d[0] if c10d else inside[0]
    callers = [f for f in frames[:first] if f"torch{os.sep}distributed{os.sep}" not in f.filename]
    if not callers:
        return name
    caller = callers[-1]
    where = caller.filename
    if where.startswith(str(REPO) + os.sep):
        where = os.path.relpath(where, REPO)
    return f"{name} (called from {where}:{caller.lineno} in {caller.name})"
