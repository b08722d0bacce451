"""``model.expert: both``: Wan2.2 A14B's two experts trained in one run, as two single-expert runs.

The trainer's model is a ``dit.experts.ExpertPair`` (parameters ``high.*`` and ``low.*``); a
micro-batch runs the expert on whose side of the switch its clips' timesteps fall (every clip's expert
is drawn first, ``dit.flow.draw_expert``, and micro-batches are packed per expert). Each expert keeps
its own optimizer (AdamW state) and LR schedule, its own gradient clipping and its own EMA, and moves
only in a step where some micro-batch ran it: AdamW on a zero gradient would still move it through its
momentum and weight decay, and its LR schedule would advance. "Ran" is read from the gradients after
the step's reduction (a gradient slot is None only when no rank ran the expert), so every rank agrees.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dit.experts import ExpertPair
from dit.flow import EXPERTS


def expert_parameters(model: ExpertPair, name: str) -> list[torch.nn.Parameter]:
    return [p for p in getattr(model, name).parameters() if p.requires_grad]


def ran(params: list[torch.nn.Parameter]) -> bool:
    """Whether this step gave the expert a gradient (on every rank alike, after the reduction)."""
    return any(p.grad is not None for p in params)


class ExpertOptimizers:
    """One optimizer per expert behind the one-optimizer calls the trainer makes; ``step`` steps the
    experts that ran and records them in ``active`` (the LR schedules and EMA follow it)."""

    def __init__(self, model: ExpertPair, build: Callable[[list], torch.optim.Optimizer]):
        self.params = {n: expert_parameters(model, n) for n in EXPERTS}
        self.parts = {n: build(self.params[n]) for n in EXPERTS}
        self.active: tuple[str, ...] = ()

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for opt in self.parts.values() for k, v in opt.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.active = tuple(n for n in EXPERTS if ran(self.params[n]))
        for n in self.active:
            self.parts[n].step()

    def state_dict(self) -> dict:
        return {n: opt.state_dict() for n, opt in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        for n, opt in self.parts.items():
            opt.load_state_dict(state[n])


def expert_optimizers(trainer, build: Callable[[list], torch.optim.Optimizer]) -> ExpertOptimizers:
    """``trainer``'s ExpertOptimizers, handed to its IdleExpertHost if it has one
    (``model.idle_expert=cpu``: full training moves their moments with the experts)."""
    optimizers = ExpertOptimizers(trainer.model, build)
    if trainer.expert_host is not None:
        trainer.expert_host.optimizers = optimizers
    return optimizers


class ExpertSchedules:
    """One LR schedule per expert; each advances only when its expert stepped."""

    def __init__(self, optimizers: ExpertOptimizers, build: Callable[[torch.optim.Optimizer], object]):
        self.optimizers = optimizers
        self.parts = {n: build(opt) for n, opt in optimizers.parts.items()}

    def step(self) -> None:
        for n in self.optimizers.active:
            self.parts[n].step()

    def get_last_lr(self) -> list[float]:
        """The high expert's LR first, then the low one's (the log's ``lr`` is the first)."""
        return [lr for s in self.parts.values() for lr in s.get_last_lr()]

    def state_dict(self) -> dict:
        return {n: s.state_dict() for n, s in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        for n, s in self.parts.items():
            s.load_state_dict(state[n])


def clip_expert_gradients(
    model: ExpertPair, max_norm: float, clip: Callable[[list, float], torch.Tensor]
) -> torch.Tensor:
    """Clip each expert's gradients to ``max_norm`` on its own (as a run of that expert alone would);
    -> the norm of both together, for the log. ``clip`` is the trainer's clip function (collective
    under FSDP: called for both experts on every rank, in the same order)."""
    norms = [clip(expert_parameters(model, n), max_norm) for n in EXPERTS]
    return torch.stack([n.float() for n in norms]).norm() if norms else torch.tensor(math.nan)


def expert_of_clip(clip, boundary: float) -> str:
    """The expert whose side of the switch ``clip``'s timestep lies on (the pipeline's own test)."""
    from dit.flow import model_timesteps, on_expert_side

    return "high" if bool(on_expert_side(model_timesteps([clip.sigma]), "high", boundary)) else "low"


def pack_per_expert(clips, budget: int, boundary: float) -> list[list[int]]:
    """Token-budget micro-batches (clip indices) of each expert's clips apart, high first, so that
    every micro-batch runs one expert."""
    from dit.batching import pack_by_token_budget
    from dit.flow import EXPERTS

    groups = []
    for name in EXPERTS:
        ids = [i for i, c in enumerate(clips) if expert_of_clip(c, boundary) == name]
        groups += [
            [ids[j] for j in g] for g in pack_by_token_budget([clips[i].num_tokens for i in ids], budget)
        ]
    return groups
