"""Exponential moving average of the weights, kept as a full model so it saves and samples like one."""

from __future__ import annotations

import copy

import torch


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        ema_params = list(self.model.parameters())
        params = [p.detach() for p in model.parameters()]
        torch._foreach_lerp_(ema_params, params, 1.0 - self.decay)
