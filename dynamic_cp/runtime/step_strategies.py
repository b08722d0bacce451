"""How a step's plan runs on this rank and how its gradients meet: one strategy per weight layout.

The trainer's loop and step (``DistributedTrainer.train_step``) are the same in every mode; the
trainer is given one of these strategies (``step_strategy``) and calls it three times a step:
``run`` (forward and backward of this rank's micro-batches; -> the sum of their losses), ``reduce``
(the step's sums over the world: gradients where they are still local, the loss, the timeline) and
``clip`` (the norm of the whole model's gradients).

- ``ReplicatedStep`` (``parallel.fsdp=none``): the micro-batches in plan order, then one flat SUM
  all-reduce of gradients, loss and timeline together (under model.expert=both, the gradients of
  the experts the step's plan runs; ``model.idle_expert=cpu`` keeps just those on the device).
- ``PerStepStep`` (``per_step``): every FSDP unit gathered once, the same micro-batch loop with no
  world collective, then one synced empty pass that reduce-scatters the accumulated gradients.
- ``PerLayerStep`` (``per_layer``): the plan's lockstep rounds, each a synced forward and backward
  that gathers and reduce-scatters unit by unit (``dynamic_cp/runtime/fsdp.py``).

Under ``parallel.pp_size > 1`` the micro-batch loop is the stages' schedule (``run_pipeline``):
gradients meet over the stage's ranks and clipping takes the norm over every stage.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from dit.expert_training import expert_parameters
from dit.flow import EXPERTS
from dynamic_cp.planning.rounds import lockstep_rounds, rank_round_schedule
from dynamic_cp.runtime.fsdp import configure, empty_micro_batch_loss, gather_weights, grad_norm_and_clip
from dynamic_cp.runtime.pipeline import clip_over_stages, empty_received, run_pipeline


def sum_gradients(
    params: list[torch.nn.Parameter], group: dist.ProcessGroup, extra: torch.Tensor
) -> torch.Tensor:
    """SUM of ``params``' gradients and ``extra`` (on the compute device) over ``group``, as one flat
    buffer and one collective; -> the summed ``extra``.

    A parameter without a gradient (this rank ran nothing, or no clip used it) contributes zeros.
    One more slot per parameter counts the ranks that gave it a gradient: a parameter that no
    clip of the whole step used keeps ``grad=None``, as in single-process training, so AdamW
    skips it (no weight decay, no moment decay) instead of stepping on a zero gradient.
    """
    parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
    dtype = parts[0].dtype if parts else torch.float32
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.float64, device=extra.device)
    flat = torch.cat([*(x.to(dtype) for x in parts), torch.cat([used, extra.double()]).to(dtype)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = sum(p.numel() for p in params)
    start = 0
    for p, u in zip(params, flat[offset : offset + len(params)].tolist()):
        n = p.numel()
        p.grad = flat[start : start + n].view_as(p).to(p.dtype) if u > 0 else None
        start += n
    return flat[offset + len(params) :]


def _loss_and_extra(local_loss: float, extra: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tensor([local_loss], dtype=torch.float64), extra.double()])


class ReplicatedStep:
    """Replicated weights: gradients are summed here, with the loss and the timeline."""

    # Replicas are identical: only the rank that logs evaluates (the others wait in the next step's
    # first collective). Sharded weights are gathered by every forward, so FSDP evaluates on all.
    validates_on_every_rank = False

    def __init__(self, trainer):
        self.trainer = trainer
        self.summed: list[torch.nn.Parameter] = []  # the parameters whose gradients ``reduce`` sums

    def run(self, batch, timeline, t0: float) -> float:
        t = self.trainer
        self.summed = t.trainable_parameters()
        if t.both:  # an expert no rank runs has no gradient anywhere: it stays out of the all-reduce
            ran = set(batch.plan.info["experts"])
            self.summed = [p for n in EXPERTS if n in ran for p in expert_parameters(t.model, n)]
            if t.expert_host is not None:  # model.idle_expert=cpu: those experts on every rank
                t.expert_host.plan_step(ran)
        return self.micro_batches(batch, timeline, t0)

    def micro_batches(self, batch, timeline, t0: float, expert: str | None = None) -> float:
        """This rank's micro-batches (of ``expert`` alone when given) in plan order, or the stages'
        schedule under pipeline parallelism; -> the sum of their losses."""
        t = self.trainer
        if t.pipeline is not None:
            return run_pipeline(t, batch, timeline, t0)
        experts = batch.plan.info.get("experts")
        local_loss = 0.0
        for m, (ranks, clips) in zip(batch.plan_indices, batch.micro_batches):
            if expert is None or experts[m] == expert:
                local_loss += t._timed_micro_batch(batch, timeline, t0, m, ranks, clips)
        return local_loss

    def reduce(self, local_loss: float, extra: torch.Tensor) -> tuple[float, torch.Tensor]:
        """-> (the world's loss, the world's ``extra``), gradients summed on the way."""
        t = self.trainer
        head = _loss_and_extra(local_loss, extra).to(t.device)
        if t.pipeline is None:  # one collective for everything
            flat = sum_gradients(self.summed, t.world, head)
        else:  # each stage's gradients over its ranks; loss and extra over the world
            sum_gradients(self.summed, t.grad_group, head[:0])
            flat = self._sum_over_world(head)
        return float(flat[0]), flat[1:]

    def _sum_over_world(self, head: torch.Tensor) -> torch.Tensor:
        flat = head.to(self.trainer.device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.trainer.world)
        return flat

    def clip(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        if self.trainer.pipeline is not None:  # the norm of the whole model's gradients, over all stages
            return clip_over_stages(self.trainer.pipeline, params, max_norm)
        return self._clip_local(params, max_norm)

    def _clip_local(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


class PerStepStep(ReplicatedStep):
    """FSDP per_step: 1. gather every unit once, 2. the plan with no world collective, 3. one synced
    empty pass that reduce-scatters every unit's accumulated gradient and frees the weights.

    model.expert=both: steps 1-3 once per expert the plan runs, high first, on every rank, so only
    one expert is gathered (and accumulates an unsharded gradient) at a time. Every rank issues
    AG(high), its high micro-batches (CP collectives only), RS(high), then the same for low: the world
    collectives keep one order on every rank, and each CP collective of an expert lies between that
    expert's AG and RS on all members of its group (the single-model argument,
    ``dynamic_cp/runtime/fsdp.py``, per expert). An expert no micro-batch runs is neither gathered
    nor reduced: its gradients stay None and it takes no step."""

    validates_on_every_rank = True  # every forward gathers weights from every rank

    def run(self, batch, timeline, t0: float) -> float:
        local_loss = 0.0
        for name, dit in self.trainer_dits(batch.plan):
            configure(dit, keep_gathered=True, free_after_backward=False, sync=False, last_backward=False)
            gather_weights(dit)
            local_loss += self.micro_batches(batch, timeline, t0, name)
            configure(dit, keep_gathered=True, free_after_backward=True, sync=True, last_backward=True)
            self.empty_micro_batch(dit)
        return local_loss

    def trainer_dits(self, plan) -> list[tuple[str | None, torch.nn.Module]]:
        """(expert name, its VideoDiT) for each expert some micro-batch of the (global) plan runs,
        high first, the same list on every rank; [(None, model)] for one model."""
        t = self.trainer
        if not t.both:
            return [(None, t.model)]
        return [(n, getattr(t.model, n)) for n in ("high", "low") if n in plan.info["experts"]]

    def empty_micro_batch(self, dit: torch.nn.Module) -> None:
        """A synced zero-token forward and backward of ``dit``: its collectives without any clip (a
        pipeline stage's blocks alone, from zero-token inputs of what the stage receives)."""
        t = self.trainer
        part = t.pipeline.part if t.pipeline is not None else None
        stage = (lambda args, extra: part(empty_received(t, args, extra))) if part else None
        with t.autocast():
            loss = empty_micro_batch_loss(dit, t.device, stage)
        loss.backward()

    def reduce(self, local_loss: float, extra: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Gradients arrived reduce-scattered: only the loss and ``extra`` are summed here."""
        flat = self._sum_over_world(_loss_and_extra(local_loss, extra))
        return float(flat[0]), flat[1:]

    def _clip_local(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return grad_norm_and_clip(params, max_norm)  # the global norm of the sharded gradients


class PerLayerStep(PerStepStep):
    """FSDP per_layer: lockstep rounds, each a synced forward and backward gathering and
    reduce-scattering unit by unit; under model.expert=both each expert's rounds, high first (every
    rank runs an expert's rounds, empty micro-batches where it has none, before the other's)."""

    def run(self, batch, timeline, t0: float) -> float:
        return sum(
            self._rounds_of(batch, timeline, t0, dit, name) for name, dit in self.trainer_dits(batch.plan)
        )

    def _rounds_of(self, batch, timeline, t0: float, dit, expert: str | None) -> float:
        """Lockstep rounds of the plan's micro-batches (of ``expert`` alone when given) on ``dit``:
        the rounds the planner chose (Dynamic-CP's rounds planner, ``plan_rounds``), or static CP's
        plan cut into greedy rounds, as ``simulate --fsdp per_layer`` prices each."""
        t = self.trainer
        plan = with_rounds(batch.plan, t.both, t.world_size)
        rounds = plan.rounds
        if expert is not None:  # an expert's rounds hold its micro-batches only
            rounds = [r for r in rounds if r and plan.info["experts"][r[0]] == expert]
        schedule = rank_round_schedule(dataclasses.replace(plan, rounds=rounds), t.rank)
        schedule = schedule or [None]  # a step without clips: one empty round
        mine = dict(zip(batch.plan_indices, batch.micro_batches))
        local_loss = 0.0
        for k, m in enumerate(schedule):
            last = k == len(schedule) - 1
            configure(dit, keep_gathered=False, free_after_backward=True, sync=True, last_backward=last)
            if m is None:
                self.empty_micro_batch(dit)
            else:
                local_loss += t._timed_micro_batch(batch, timeline, t0, m, *mine[m])
        return local_loss


def with_rounds(plan, both: bool, world_size: int):
    """``plan`` with rounds: its own, or greedy rounds in plan order (``lockstep_rounds``), cut
    per expert under model.expert=both so that no round mixes the two experts."""
    if plan.rounds is not None:
        return plan
    if not both:
        return lockstep_rounds(plan, world_size)
    rounds = []
    for name in ("high", "low"):
        ids = [m for m, e in enumerate(plan.info["experts"]) if e == name]
        sub = dataclasses.replace(plan, micro_batches=[plan.micro_batches[m] for m in ids], rounds=None)
        rounds += [[ids[m] for m in r] for r in lockstep_rounds(sub, world_size).rounds]
    return dataclasses.replace(plan, rounds=rounds)


STRATEGIES = {"none": ReplicatedStep, "per_step": PerStepStep, "per_layer": PerLayerStep}


def step_strategy(trainer, fsdp_mode: str) -> ReplicatedStep:
    """The strategy of ``fsdp_mode`` (``resolve_fsdp_mode``'s answer) for ``trainer``."""
    return STRATEGIES[fsdp_mode](trainer)
