"""Joining torchrun's process group for training and sampling: ``data/torchrun.py`` plus NCCL's flight recorder.

device = init_torchrun()   # nccl and cuda:LOCAL_RANK with GPUs, gloo and cpu without
"""

from __future__ import annotations

from datetime import timedelta

import torch

from data.torchrun import join_torchrun
from dynamic_cp.runtime.timeouts import nccl_flight_recorder_env


def init_torchrun(
    timeout: timedelta = timedelta(minutes=30), flight_recorder_dir: str | None = None
) -> torch.device:
    """Initialize the default process group from torchrun's environment; -> this rank's device.

    flight_recorder_dir: where NCCL's flight recorder dumps its trace when a collective times out
    (set in the environment before the process group reads it); None leaves it off."""
    if torch.cuda.is_available() and flight_recorder_dir is not None:
        nccl_flight_recorder_env(flight_recorder_dir)
    return join_torchrun(timeout)
