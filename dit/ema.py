"""Exponential moving average of the weights, kept as a full model so it saves and samples like one."""

from __future__ import annotations

import contextlib
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


class AdapterEMA:
    """EMA of the trainable parameters only (the LoRA adapters): a copy of a frozen 14B base would cost
    28 GB for values that never change. ``state`` maps parameter names to their averages."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        live = dict(model.named_parameters())
        names = list(self.state)
        torch._foreach_lerp_(
            [self.state[n] for n in names], [live[n].detach() for n in names], 1.0 - self.decay
        )

    @contextlib.contextmanager
    def swapped_in(self, model: torch.nn.Module):
        """Run ``model`` with the averaged adapters (to sample), then put the live ones back."""
        live = dict(model.named_parameters())
        saved = {n: live[n].detach().clone() for n in self.state}
        with torch.no_grad():
            for n, v in self.state.items():
                live[n].copy_(v)
        try:
            yield model
        finally:
            with torch.no_grad():
                for n, v in saved.items():
                    live[n].copy_(v)
