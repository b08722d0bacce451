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

import torch
import torch.distributed as dist

from dit.checkpoint import resolve_checkpoint, set_rng_state
from dit.config import Config, to_dict
from dit.optim import build_optimizer
from dit.trainer import Trainer
from dynamic_cp.planning.rounds import lockstep_rounds, rank_round_schedule
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.fsdp import (
    ShardedEMA,
    apply_fsdp,
    configure,
    empty_micro_batch_loss,
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
        super().__init__(cfg, world, resume=resume, device=device)
        if cfg.train.async_checkpoint:  # DCP's async_save, in place of the replicated background writer
            self._background = AsyncFSDPCheckpointer(self.world, self.device)

    # ----------------------------------------------------------------------------- construction

    def _shard_model(self) -> None:
        apply_fsdp(self.model, self.world, self.device, self.cfg.train.mixed_precision)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        # The parameters are this rank's shards: AdamW's moments are sharded with them (no ZeRO-1).
        return build_optimizer(self.cfg.train, self.trainable_parameters())

    def _build_ema(self) -> ShardedEMA:
        return ShardedEMA(self.model, self.cfg.train.ema_decay)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        return grad_norm_and_clip(self.trainable_parameters(), max_norm)

    # ----------------------------------------------------------------------------- one step

    def _run_plan(self, batch: StepBatch, timeline: StepTimeline, t0: float) -> float:
        if self.fsdp_mode == "per_step":
            return self._run_per_step(batch, timeline, t0)
        return self._run_per_layer(batch, timeline, t0)

    def _empty_micro_batch(self) -> None:
        with self.autocast():
            loss = empty_micro_batch_loss(self.model, self.device)
        loss.backward()

    def _run_per_step(self, batch: StepBatch, timeline: StepTimeline, t0: float) -> float:
        # 1. gather every unit once, 2. the plan with no world collective, 3. one synced empty pass
        configure(self.model, keep_gathered=True, free_after_backward=False, sync=False, last_backward=False)
        gather_weights(self.model)
        local_loss = super()._run_plan(batch, timeline, t0)  # the replicated runtime's plan loop
        configure(self.model, keep_gathered=True, free_after_backward=True, sync=True, last_backward=True)
        self._empty_micro_batch()  # reduce-scatters every unit's accumulated gradient, frees weights
        return local_loss

    def _run_per_layer(self, batch: StepBatch, timeline: StepTimeline, t0: float) -> float:
        plan = (
            batch.plan
            if getattr(batch.plan, "rounds", None)
            else lockstep_rounds(batch.plan, self.world_size)
        )
        schedule = rank_round_schedule(plan, self.rank) or [None]  # a step without clips: one empty round
        mine = dict(zip(batch.plan_indices, batch.micro_batches))
        local_loss = 0.0
        for k, m in enumerate(schedule):
            configure(
                self.model,
                keep_gathered=False,
                free_after_backward=True,
                sync=True,
                last_backward=k == len(schedule) - 1,
            )
            if m is None:
                self._empty_micro_batch()
                continue
            local_loss += self._timed_micro_batch(batch, timeline, t0, m, *mine[m])
        return local_loss

    def _all_reduce(self, local_loss: float, extra: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Gradients arrived reduce-scattered: only the loss and ``extra`` are summed here."""
        flat = torch.cat([torch.tensor([local_loss], dtype=torch.float64), extra.double()]).to(self.device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.world)
        return float(flat[0]), flat[1:]

    @torch.no_grad()
    def validation_loss(self) -> float:
        # Every forward gathers weights from every rank: all ranks evaluate the same clips.
        configure(self.model, keep_gathered=False, free_after_backward=True, sync=True, last_backward=True)
        try:
            return Trainer.validation_loss(self)
        finally:
            release_weights(self.model)

    # ----------------------------------------------------------------------------- checkpoints

    def save(self):
        state = {"lr_schedule": self.lr_schedule.state_dict(), "bad_steps": self.bad_steps}
        args = (self.out / "checkpoints", self.step, self.model, self.optimizer, self.ema, state)
        rest = (to_dict(self.cfg), self.cfg.train.keep_checkpoints)
        if self._background is not None:  # staged now, written by DCP's thread; check() reports failures
            self._background.save(*args, *rest)
            return None
        return save_fsdp_checkpoint(*args, *rest, self.world)

    def _resume(self, path: str) -> None:
        step_dir = resolve_checkpoint(path)
        state = load_fsdp_checkpoint(step_dir, self.model, self.optimizer, self.ema)
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        set_rng_state(state["rng"])
        self._truncate_metrics(self.step)
        if self.is_main:
            print(f"resumed from {step_dir} at step {self.step} (fsdp={self.fsdp_mode})")
