"""``DistributedTrainer`` with FSDP2-sharded weights, gradients and AdamW moments (``parallel.fsdp``).

The plan, routing and CP attention are the replicated runtime's; what changes (see
``dynamic_cp/runtime/fsdp.py`` for the collectives of each mode):
- the model is sharded before the optimizer is built, so AdamW holds only this rank's shards;
- ``_run_plan`` runs the per_step or per_layer schedule, and gradients arrive reduce-scattered, so
  the step's all-reduce carries only the loss and the timeline;
- clipping uses the global norm of the sharded gradients, the EMA averages the local shards;
- validation runs on every rank (each forward gathers weights from all of them);
- checkpoints are DCP shards written by every rank, plus the consolidated diffusers export.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from dit.checkpoint import resolve_checkpoint, set_rng_state
from dit.config import Config, to_dict
from dit.optim import build_optimizer
from dynamic_cp.planning.rounds import lockstep_rounds, rank_round_schedule
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.fsdp import (
    ShardedEMA,
    apply_fsdp,
    configure,
    empty_micro_batch_loss,
    fp8_scales_after_step,
    gather_weights,
    grad_norm_and_clip,
    release_weights,
    resolve_fsdp_mode,
)
from dynamic_cp.runtime.fsdp_checkpoint import (
    AsyncFSDPCheckpointer,
    load_fsdp_checkpoint,
    save_fsdp_checkpoint,
)
from dynamic_cp.runtime.iterator import StepBatch
from dynamic_cp.runtime.step_stats import StepTimeline


class FSDPTrainer(DistributedTrainer):
    def __init__(self, cfg: Config, world: dist.ProcessGroup, resume: str | None = None, device=None):
        self.fsdp_mode = resolve_fsdp_mode(cfg, dist.get_world_size(world))
        if self.fsdp_mode == "none":
            raise ValueError(
                f"parallel.fsdp={cfg.parallel.fsdp} resolves to 'none' here; use DistributedTrainer "
                "(dynamic_cp.runtime.distributed_trainer.trainer_class picks the right one)"
            )
        if cfg.parallel.pp_size > 1 and resume is not None:
            raise ValueError(
                f"parallel.fsdp={self.fsdp_mode} with parallel.pp_size={cfg.parallel.pp_size} writes no "
                "checkpoint yet; resume with parallel.fsdp=none (stage checkpoints), or pp_size=1"
            )
        super().__init__(cfg, world, resume=resume, device=device)
        if cfg.train.async_checkpoint:  # DCP's async_save, in place of the replicated background writer
            self._background = AsyncFSDPCheckpointer(self.world, self.device)

    # ----------------------------------------------------------------------------- construction

    def _shard_model(self) -> None:
        # model.expert=both: each expert is sharded on its own (its own FSDP roots and units), so one
        # expert's collectives run without the other's, and an idle expert issues none
        super()._shard_model()  # a pipeline stage keeps its part first; its ranks are the FSDP mesh
        for dit in self._dits():
            apply_fsdp(dit, self.grad_group, self.device, self.cfg.train.mixed_precision)

    def _dits(self, names=None) -> list[torch.nn.Module]:
        """The sharded VideoDiTs: the model, or under model.expert=both the experts (of ``names``)."""
        if not self.both:
            return [self.model]
        return [getattr(self.model, n) for n in (names if names is not None else ("high", "low"))]

    def _optimizer_over(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        # The parameters are this rank's shards: AdamW's moments are sharded with them (no ZeRO-1).
        return fp8_scales_after_step(build_optimizer(self.cfg.train, params), self.model)

    def _build_ema(self) -> ShardedEMA:
        return ShardedEMA(self.model, self.cfg.train.ema_decay)

    def _clip(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        if self.pipeline is not None:
            return super()._clip(params, max_norm)  # the norm over all stages
        return grad_norm_and_clip(params, max_norm)

    # ----------------------------------------------------------------------------- one step

    def _run_plan(self, batch: StepBatch, timeline: StepTimeline, t0: float) -> float:
        if self.fsdp_mode == "per_step":
            return self._run_per_step(batch, timeline, t0)
        return self._run_per_layer(batch, timeline, t0)

    def _empty_micro_batch(self, dit: torch.nn.Module | None = None) -> None:
        part = self.pipeline.part if self.pipeline is not None else None
        if part is not None:  # a stage's blocks alone, from zero-token inputs of what it receives
            from dynamic_cp.runtime.pipeline import empty_received

            stage = lambda args, extra: part(empty_received(self, args, extra))  # noqa: E731
        with self.autocast():
            loss = empty_micro_batch_loss(
                self.model if dit is None else dit, self.device, stage if part else None
            )
        loss.backward()

    def _experts_run(self, plan) -> list[str] | None:
        """model.expert=both: the experts some micro-batch of the (global) plan runs, high first;
        the same list on every rank. None for one model."""
        if not self.both:
            return None
        return [n for n in ("high", "low") if n in plan.info["experts"]]

    def _run_per_step(self, batch: StepBatch, timeline: StepTimeline, t0: float) -> float:
        # 1. gather every unit once, 2. the plan with no world collective, 3. one synced empty pass
        if self.both:
            return self._run_per_step_experts(batch, timeline, t0)
        configure(self.model, keep_gathered=True, free_after_backward=False, sync=False, last_backward=False)
        gather_weights(self.model)
        local_loss = super()._run_plan(batch, timeline, t0)  # the replicated runtime's plan loop
        configure(self.model, keep_gathered=True, free_after_backward=True, sync=True, last_backward=True)
        self._empty_micro_batch()  # reduce-scatters every unit's accumulated gradient, frees weights
        return local_loss

    def _run_per_step_experts(self, batch: StepBatch, timeline: StepTimeline, t0: float) -> float:
        """model.expert=both: steps 1-3 once per expert the plan runs, high first, on every rank, so
        only one expert is gathered (and accumulates an unsharded gradient) at a time. Every rank
        issues AG(high), its high micro-batches (CP collectives only), RS(high), then the same for low:
        the world collectives keep one order on every rank, and each CP collective of an expert lies
        between that expert's AG and RS on all members of its group (the single-model argument,
        ``dynamic_cp/runtime/fsdp.py``, per expert). An expert no micro-batch runs is neither
        gathered nor reduced: its gradients stay None and it takes no step."""
        experts = batch.plan.info["experts"]
        mine = list(zip(batch.plan_indices, batch.micro_batches))
        local_loss = 0.0
        for name in self._experts_run(batch.plan):
            dit = getattr(self.model, name)
            configure(dit, keep_gathered=True, free_after_backward=False, sync=False, last_backward=False)
            gather_weights(dit)
            for m, (ranks, clips) in mine:
                if experts[m] == name:
                    local_loss += self._timed_micro_batch(batch, timeline, t0, m, ranks, clips)
            configure(dit, keep_gathered=True, free_after_backward=True, sync=True, last_backward=True)
            self._empty_micro_batch(dit)
        return local_loss

    def _run_per_layer(self, batch: StepBatch, timeline: StepTimeline, t0: float) -> float:
        if not self.both:
            return self._rounds_of(batch, timeline, t0, self.model, batch.plan)
        # model.expert=both: the rounds of each expert the plan runs, high first: every rank runs an
        # expert's rounds (empty micro-batches of that expert where it has none) before the other's
        local_loss = 0.0
        for name in self._experts_run(batch.plan):
            local_loss += self._rounds_of(batch, timeline, t0, getattr(self.model, name), batch.plan, name)
        return local_loss

    def _rounds_of(self, batch, timeline, t0, dit, plan, expert: str | None = None) -> float:
        """Lockstep rounds of ``plan``'s micro-batches (of ``expert`` alone when given) on ``dit``:
        the rounds the planner chose (Dynamic-CP's rounds planner, ``plan_rounds``), or static CP's
        plan cut into greedy rounds, as ``simulate --fsdp per_layer`` prices each."""
        plan = self._with_rounds(plan)
        rounds = plan.rounds
        if expert is not None:  # an expert's rounds hold its micro-batches only
            rounds = [r for r in rounds if r and plan.info["experts"][r[0]] == expert]
        schedule = rank_round_schedule(dataclasses.replace(plan, rounds=rounds), self.rank)
        schedule = schedule or [None]  # a step without clips: one empty round
        mine = dict(zip(batch.plan_indices, batch.micro_batches))
        local_loss = 0.0
        for k, m in enumerate(schedule):
            configure(
                dit,
                keep_gathered=False,
                free_after_backward=True,
                sync=True,
                last_backward=k == len(schedule) - 1,
            )
            if m is None:
                self._empty_micro_batch(dit)
                continue
            local_loss += self._timed_micro_batch(batch, timeline, t0, m, *mine[m])
        return local_loss

    def _with_rounds(self, plan):
        """``plan`` with rounds: its own, or greedy rounds in plan order (``lockstep_rounds``), cut
        per expert under model.expert=both so that no round mixes the two experts."""
        if plan.rounds is not None:
            return plan
        if not self.both:
            return lockstep_rounds(plan, self.world_size)
        rounds = []
        for name in ("high", "low"):
            ids = [m for m, e in enumerate(plan.info["experts"]) if e == name]
            sub = dataclasses.replace(plan, micro_batches=[plan.micro_batches[m] for m in ids], rounds=None)
            rounds += [[ids[m] for m in r] for r in lockstep_rounds(sub, self.world_size).rounds]
        return dataclasses.replace(plan, rounds=rounds)

    def _all_reduce(self, local_loss: float, extra: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Gradients arrived reduce-scattered: only the loss and ``extra`` are summed here."""
        flat = torch.cat([torch.tensor([local_loss], dtype=torch.float64), extra.double()]).to(self.device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.world)
        return float(flat[0]), flat[1:]

    validates_on_every_rank = True  # every forward gathers weights from every rank

    @torch.no_grad()
    def validation_loss(self) -> float:
        for dit in self._dits():
            configure(dit, keep_gathered=False, free_after_backward=True, sync=True, last_backward=True)
        try:
            return super().validation_loss()
        finally:
            for dit in self._dits():
                release_weights(dit)

    # ----------------------------------------------------------------------------- checkpoints

    def save(self):
        if self.pipeline is not None:
            raise ValueError(
                f"parallel.fsdp={self.fsdp_mode} with parallel.pp_size={self.cfg.parallel.pp_size}: stage "
                "checkpoints of sharded weights are not written yet; use parallel.fsdp=none under pipeline stages"
            )
        state = {"lr_schedule": self.lr_schedule.state_dict(), "bad_steps": self.bad_steps}
        args = (self.out / "checkpoints", self.step, self.model, self._optimizers(), self.ema, state)
        rest = (to_dict(self.cfg), self.cfg.train.keep_checkpoints)
        extra = self.checkpoint_extras()  # the learner's state, as replicated checkpoints hold it
        if self.is_main:
            self.learner.save(self.out, self.step)
        if self._background is not None:  # staged now, written by DCP's thread; check() reports failures
            self._background.save(*args, *rest, extra)
            return None
        return save_fsdp_checkpoint(*args, *rest, self.world, extra)

    def _optimizers(self):
        """The optimizer, or the experts' (DCP's state-dict functions take a list)."""
        return list(self.optimizer.parts.values()) if self.both else self.optimizer

    def _resume(self, path: str) -> None:
        step_dir = resolve_checkpoint(path)
        state = load_fsdp_checkpoint(step_dir, self.model, self._optimizers(), self.ema)
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        set_rng_state(state["rng"])
        self._truncate_metrics(self.step)
        if self.is_main:
            print(f"resumed from {step_dir} at step {self.step} (fsdp={self.fsdp_mode})")
