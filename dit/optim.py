"""The optimizer and the LR schedule of a run: one place that the trainer, ZeRO, FSDP and LoRA all call.

Callers hand in the parameters to train (``Trainer.trainable_parameters``): the whole model for full
training, only the adapters for LoRA, the local shards under FSDP. Nothing here knows which.

``train.optimizer``:
    adamw        torch.optim.AdamW, torch's default implementation (foreach on CUDA)
    adamw_fused  torch.optim.AdamW(fused=True): one kernel per parameter group (CUDA, and CPU since torch 2.4)
    adamw_8bit   bitsandbytes.optim.AdamW8bit: block-wise 8-bit moments, 2 bytes instead of 8 per
                 parameter (``pip install -e ".[quant]"``); parameters under 4096 elements keep fp32 moments
``train.lr_schedule`` (diffusers' ``get_scheduler``, linear warm-up from 0 over ``warmup_steps``):
    constant     then constant
    cosine       then half a cosine down to 0 at ``lr_decay_steps`` (default ``max_steps``)
    linear       then a straight line down to 0 at ``lr_decay_steps``
The schedule is a pure function of the step, rebuilt from the config on resume; the checkpoint holds
only its step counter, so a resumed run follows the same curve bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from data.quiet_imports import import_bitsandbytes
from dit.config import TrainConfig

# our name -> diffusers' scheduler name (SchedulerType)
_DIFFUSERS_SCHEDULE = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


def optimizer_kwargs(t: TrainConfig) -> dict:
    """Keyword arguments of the optimizer class (also what ZeRO-1's wrapper passes on)."""
    kwargs = {"lr": t.lr, "betas": tuple(t.betas), "weight_decay": t.weight_decay}
    if t.optimizer == "adamw_fused":
        kwargs["fused"] = True
    return kwargs


def optimizer_class(t: TrainConfig) -> type[torch.optim.Optimizer]:
    if t.optimizer == "adamw_8bit":
        try:
            bitsandbytes = import_bitsandbytes()
        except ImportError as err:
            raise ValueError(
                'train.optimizer=adamw_8bit needs bitsandbytes: pip install -e ".[quant]" '
                "(or choose train.optimizer=adamw)"
            ) from err
        return bitsandbytes.optim.AdamW8bit
    return torch.optim.AdamW


def check_optimizer_runs(t: TrainConfig, device: torch.device) -> None:
    """Fail at start-up, in one line, when the chosen optimizer cannot step on ``device``: a tiny
    parameter takes one step, so an unsupported device or a broken install shows before any data loads."""
    if t.optimizer == "adamw":
        return
    cls = optimizer_class(t)
    probe = torch.nn.Parameter(torch.zeros(4096, device=device))  # 4096: bitsandbytes' smallest 8-bit size
    probe.grad = torch.ones_like(probe)
    try:
        cls([probe], **optimizer_kwargs(t)).step()
    except Exception as err:  # noqa: BLE001 - any failure here means "cannot run on this device"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"train.optimizer={t.optimizer} cannot step on {device.type}: {first}; "
            "use train.optimizer=adamw on this device"
        ) from err


def build_optimizer(t: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return optimizer_class(t)(list(params), **optimizer_kwargs(t))


def build_lr_schedule(
    t: TrainConfig, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up from 0 over ``warmup_steps``, then ``t.lr_schedule`` (diffusers' get_scheduler)."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        _DIFFUSERS_SCHEDULE[t.lr_schedule],
        optimizer,
        num_warmup_steps=t.warmup_steps,
        num_training_steps=t.lr_decay_steps or t.max_steps,
    )
