"""Exponential moving average of the weights, kept as a full model so it saves and samples like one."""

from __future__ import annotations

import contextlib
import copy
import math

import torch

# An EMA samples once the weights training started from are under this share of it. After n updates
# they are decay**n of the average (each update keeps `decay` of it): at decay 0.99 that is 61% after
# 50 steps, so a short run's EMA samples like its untrained start; this share is reached at step 230.
READY_SHARE = 0.1


def ema_not_ready(decay: float, steps: int) -> str | None:
    """Why the EMA of ``steps`` updates at ``decay`` does not yet show what was learned, or None."""
    share = decay**steps
    if decay <= 0 or share <= READY_SHARE:
        return None
    ready = math.ceil(math.log(READY_SHARE) / math.log(decay))
    return (
        f"after {steps} steps at train.ema_decay={decay:g} the EMA is still {share:.0%} the starting "
        f"weights (under {READY_SHARE:.0%} from step {ready})"
    )


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module, only: tuple[str, ...] | None = None) -> None:
        """``only``: name prefixes to update (model.expert=both: the experts that stepped)."""
        pairs = [
            (e, p.detach())
            for (n, e), p in zip(self.model.named_parameters(), model.parameters())
            if only is None or n.startswith(only)
        ]
        if pairs:
            torch._foreach_lerp_([e for e, _ in pairs], [p for _, p in pairs], 1.0 - self.decay)


class AdapterEMA:
    """EMA of the trainable parameters only (the LoRA adapters): a copy of a frozen 14B base would cost
    28 GB for values that never change. ``state`` maps parameter names to their averages."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module, only: tuple[str, ...] | None = None) -> None:
        live = dict(model.named_parameters())
        names = [n for n in self.state if only is None or n.startswith(only)]
        if not names:
            return
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
