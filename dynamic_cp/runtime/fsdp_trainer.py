"""``DistributedTrainer`` with FSDP2-sharded weights, gradients and AdamW moments (``parallel.fsdp``).

The plan, routing and CP attention are the replicated runtime's; what changes (see
``dynamic_cp/runtime/fsdp.py`` for the collectives of each mode):
- the model is sharded before the optimizer is built, so AdamW holds only this rank's shards;
- the step runs the per_step or per_layer strategy (``dynamic_cp/runtime/step_strategies.py``):
  gradients arrive reduce-scattered, so the step's all-reduce carries only the loss and the
  timeline, and clipping uses the global norm of the sharded gradients;
- the EMA averages the local shards;
- validation runs on every rank (each forward gathers weights from all of them);
- checkpoints are DCP shards written by every rank, plus the consolidated diffusers export.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dit.checkpoint import resolve_checkpoint, set_rng_state
from dit.config import Config, to_dict
from dit.optim import build_optimizer
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.fsdp import (
    ShardedEMA,
    apply_fsdp,
    configure,
    fp8_scales_after_step,
    release_weights,
    resolve_fsdp_mode,
)
from dynamic_cp.runtime.fsdp_checkpoint import (
    AsyncFSDPCheckpointer,
    load_fsdp_checkpoint,
    save_fsdp_checkpoint,
)


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

    # ----------------------------------------------------------------------------- validation

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

    def _save_weights_format(self):
        """DCP shards written by every rank, plus the consolidated export (fsdp_checkpoint.py)."""
        state = {"lr_schedule": self.lr_schedule.state_dict(), "bad_steps": self.bad_steps}
        args = (self.out / "checkpoints", self.step, self.model, self._optimizers(), self.ema, state)
        rest = (to_dict(self.cfg), self.cfg.train.keep_checkpoints)
        extra = self.checkpoint_extras()  # the learner's state, as replicated checkpoints hold it
        if self._background is not None:  # staged now, written by DCP's thread; check() reports failures
            self._background.save(*args, *rest, extra)
            return None
        return save_fsdp_checkpoint(*args, *rest, self.world, extra)

    def _optimizers(self):
        """The optimizer, or the experts' (DCP's state-dict functions take a list)."""
        return list(self.optimizer.parts.values()) if self.both else self.optimizer

    def _resume_weights_format(self, path: str) -> None:
        step_dir = resolve_checkpoint(path)
        state = load_fsdp_checkpoint(step_dir, self.model, self._optimizers(), self.ema)
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        set_rng_state(state["rng"])
        self._truncate_metrics(self.step)
        if self.is_main:
            print(f"resumed from {step_dir} at step {self.step} (fsdp={self.fsdp_mode})")
