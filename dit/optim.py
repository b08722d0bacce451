"""The optimizer and the LR schedule of a run: one place that the trainer, ZeRO, FSDP and LoRA all call.

Callers hand in the parameters to train (``Trainer.trainable_parameters``): the whole model for full
training, only the adapters for LoRA, the local shards under FSDP. Nothing here knows which.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dit.config import TrainConfig


def optimizer_kwargs(t: TrainConfig) -> dict:
    """Keyword arguments of the optimizer class (also what ZeRO-1's wrapper passes on)."""
    return {"lr": t.lr, "betas": tuple(t.betas), "weight_decay": t.weight_decay}


def optimizer_class(t: TrainConfig) -> type[torch.optim.Optimizer]:
    return torch.optim.AdamW


def build_optimizer(t: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return optimizer_class(t)(list(params), **optimizer_kwargs(t))


def build_lr_schedule(
    t: TrainConfig, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``warmup_steps``, then constant."""
    warmup = max(t.warmup_steps, 1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
