"""``model.idle_expert: cpu``: under ``model.expert: both`` the expert a step does not run waits in
host memory, as ``--dry-run`` prices it (``dynamic_cp/planning/memory.py``): in full training its
weights, buffers and AdamW moments; under LoRA its frozen base (the adapters, their moments and
their EMA stay on the device, a few percent of the base, as ``dit/block_offload.py`` keeps them).

A forward pre-hook on each expert brings it to the device (if it is on the host) and sends the
other one to the host unless that one still has a part in this step: it ran earlier in it (its
gradients wait for the optimizer step) and the forward is a training one. Micro-batches are packed
high first, then low (``pack_per_expert``), so in a step that runs one expert only that one is on
the device; a step that runs both ends with both there, as their optimizer steps need. Validation
forwards (no grad) keep one expert at a time; an expert's leftover gradients are dropped when it
leaves (the next step zeroes them anyway).

As in ``dit/block_offload.py`` (``frozen_tensors`` lists the tensors), a tensor is swapped in place
(``t.data = ...``): parameters keep their identity for the optimizer, and an expert used while on
the host has empty weights and fails loudly. Checkpoints read an offloaded expert's host copies
(a ``state_dict`` post-hook), so saving brings nothing back. The AdamW moments move as tensors in
the optimizer's state (its ``state_dict`` reads them wherever they are).

Under LoRA the low expert's base goes to the host while the model is still on the CPU, before it
moves to the device (``idle_expert_host``), so the device never holds both bases. In full training
both experts are on the device while the model is built, the EMA copied and a checkpoint resumed
(those need both whole); the first forward sends the idle one away.

On several ranks (replicated weights) the ranks must agree: the gradient all-reduce sums every
expert's slots on every rank, so an expert that any rank runs this step must be on the device on all
of them, even on a rank whose micro-batches are all the other expert's. The step's strategy calls
``plan_step`` with the global plan's experts before the first micro-batch (the same list on every
rank, ``plan.info["experts"]``); an expert no rank runs goes to the host everywhere and is left
out of the step's reduction. Under FSDP the idle expert is sharded instead
(16P/W bytes a rank), and ``model.idle_expert=cpu`` is refused.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dit.block_offload import frozen_tensors
from dit.flow import EXPERTS


class IdleExpertHost:
    """Moves ``pair.high`` / ``pair.low`` (and their ``optimizers.parts[name]`` states) between
    ``device`` and host memory around their forwards; see the module docstring."""

    def __init__(self, pair: nn.Module, optimizers, device: torch.device | str, trainable: bool = True):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.experts = {n: getattr(pair, n) for n in EXPERTS}
        self.optimizers = optimizers  # None: no AdamW moments to move (LoRA's stay with the adapters)
        self.trainable = trainable  # the trainable tensors move too (full training), or stay (LoRA)
        self._tensors = {n: frozen_tensors(e, trainable) for n, e in self.experts.items()}
        self._names = {n: _qualified(e, self._tensors[n]) for n, e in self.experts.items()}
        self._host: dict[str, list[torch.Tensor]] = {}  # an offloaded expert's tensors
        self._states: dict[str, list[tuple[dict, str, torch.Tensor]]] = {}  # its AdamW moments
        self.on_host: set[str] = set()
        self.step_experts: frozenset[str] = frozenset()  # the experts the running step's plan uses
        self._handles = []
        for name, expert in self.experts.items():
            self._handles.append(expert.register_forward_pre_hook(lambda m, _a, n=name: self._before(m, n)))
            self._handles.append(
                expert.register_state_dict_post_hook(lambda m, sd, p, _l, n=name: self._saved(m, n, sd, p))
            )

    # ---------------------------------------------------------------- what is where
    def device_bytes(self, name: str) -> int:
        """Bytes of expert ``name``'s tensors on the device now, read from the tensors themselves."""
        return sum(getattr(m, a).nbytes for m, a in self._tensors[name])

    def host_bytes(self) -> int:
        """Host memory the offloaded experts take: tensors and optimizer states."""
        tensors = sum(t.nbytes for ts in self._host.values() for t in ts)
        return tensors + sum(t.nbytes for ss in self._states.values() for _, _, t in ss)

    # ---------------------------------------------------------------- moves
    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        # its strides too: an imported weight may be a transposed view, and a contiguous copy would
        # change the matmul's summation order (a last-bit difference)
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=self.pin)
        return host.copy_(t.detach())

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True) if self.pin else host.clone()

    def offload(self, name: str) -> None:
        if name in self.on_host:
            return
        self._host[name] = [self._copy_to_host(getattr(m, a)) for m, a in self._tensors[name]]
        for m, a in self._tensors[name]:
            t = getattr(m, a)
            t.grad = None
            t.data = torch.empty(0, dtype=t.dtype, device=self.device)
        states = []
        moving = self.trainable and self.optimizers is not None
        optimizer_state = local_state(self.optimizers.parts[name]) if moving else {}
        for p in self._trainable(name):
            for key, value in optimizer_state.get(p, {}).items():
                if torch.is_tensor(value) and value.device.type == self.device.type and value.dim() > 0:
                    states.append((optimizer_state[p], key, self._copy_to_host(value)))
        for state, key, host in states:
            state[key] = host
        self._states[name] = states
        self.on_host.add(name)

    def onload(self, name: str) -> None:
        if name not in self.on_host:
            return
        for (m, a), host in zip(self._tensors[name], self._host.pop(name)):
            getattr(m, a).data = self._to_device(host)
        for state, key, host in self._states.pop(name):
            state[key] = self._to_device(host)
        self.on_host.discard(name)

    def _trainable(self, name: str) -> list[torch.nn.Parameter]:
        return [p for p in self.experts[name].parameters() if p.requires_grad]

    def plan_step(self, experts) -> None:
        """The step about to run: ``experts`` (its global plan's) on the device, the others on the
        host, on every rank alike; see the module docstring."""
        self.step_experts = frozenset(experts)
        for name in EXPERTS:
            if name in self.step_experts:
                self.onload(name)
            else:
                self.offload(name)

    # ---------------------------------------------------------------- hooks
    def _before(self, module: nn.Module, name: str) -> None:
        if module is not self.experts[name]:  # a copy of the expert (the EMA's deepcopy) carries the hook
            return
        for other in EXPERTS:
            ran = any(p.grad is not None for p in self._trainable(other))
            busy = torch.is_grad_enabled() and (ran or other in self.step_experts)
            if other != name and not busy:
                self.offload(other)
        self.onload(name)

    def _saved(self, module: nn.Module, name: str, state: dict, prefix: str) -> None:
        """An offloaded expert's ``state_dict`` holds its host copies, not the empty placeholders."""
        if module is not self.experts[name] or name not in self.on_host:
            return
        for keys, host in zip(self._names[name], self._host[name]):
            for key in keys:  # a module held in two places has two keys
                if prefix + key in state:
                    state[prefix + key] = host

    def remove(self) -> None:
        """Both experts back on the device for good; the hooks dropped."""
        for h in self._handles:
            h.remove()
        for name in EXPERTS:
            self.onload(name)


def local_state(optimizer) -> dict:
    """The parameter -> state dict where ``optimizer`` keeps its moments on this rank: ZeRO-1's
    (``ZeroRedundancyOptimizer``) are in its local optimizer's, for the parameters this rank owns."""
    return getattr(optimizer, "optim", optimizer).state


def _qualified(expert: nn.Module, tensors: list[tuple[nn.Module, str]]) -> list[list[str]]:
    """The state-dict keys (relative to ``expert``) of each (module, attribute) of ``tensors``."""
    where: dict[int, list[str]] = {}
    for n, m in expert.named_modules(remove_duplicate=False):
        where.setdefault(id(m), []).append(n)
    return [[f"{n}.{a}" if n else a for n in where[id(m)]] for m, a in tensors]


def idle_expert_host(trainer, model: nn.Module) -> IdleExpertHost | None:
    """``model.idle_expert=cpu``: an ``IdleExpertHost`` on ``model`` (an ExpertPair still on the CPU)
    for ``trainer``, or None; ValueError where it cannot run.

    Under LoRA only the frozen base moves (the adapters, their moments and their EMA stay on the
    device, as ``dit/block_offload.py`` keeps them), and the low expert's base goes to the host
    here, before the model moves to the device: the GPU never holds both bases, which a 24 GB card
    running A14B in fp8 could not. Full training moves every tensor and the moments, from the first
    forward on: the EMA's copy and a resume need both experts whole."""
    if trainer.cfg.model.idle_expert != "cpu" or not trainer.both:
        return None
    if trainer.fsdp_mode != "none":
        raise ValueError(
            f"model.idle_expert=cpu moves replicated weights; under parallel.fsdp={trainer.fsdp_mode} "
            "the idle expert is sharded across the ranks instead: set model.idle_expert=sharded, or "
            "parallel.fsdp=none"
        )
    host = IdleExpertHost(model, None, trainer.device, trainable=not trainer.lora)
    if trainer.lora:
        host.offload("low")
    return host
