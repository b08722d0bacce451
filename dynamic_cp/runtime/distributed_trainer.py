"""Multi-process training with static or Dynamic context parallelism: what ``train.py`` runs under torchrun.

    torchrun --nproc_per_node=4 train.py --config configs/tiny.yaml parallel.mode=dynamic

One step on every rank (see ``dynamic_cp/runtime/iterator.py`` for the data half):
1. ``DynamicCPBatches`` gathers lengths, plans, loads this rank's share and routes clips, giving the
   rank its micro-batches in plan order;
2. each micro-batch runs forward and backward with its group's CP attention on this rank's token
   shard; collectives block until the whole group is there, so plan order needs no barrier;
3. one SUM all-reduce over the world carries every gradient, the loss and the step timeline. The
   loss weights (``dit/flow.py``) make the summed gradient the single-process gradient of the global
   batch, so no division by the world size follows;
4. ``Trainer.finish_step`` (clip, non-finite guard, AdamW, EMA) runs on identical gradients on every
   rank. With ``parallel.shard_optimizer`` (the default, ZeRO-1) each rank updates only the
   parameters whose AdamW moments it holds and broadcasts them; otherwise every rank updates all
   of them, and the replicas stay identical without any broadcast.

Steps 2 and 3 are the trainer's strategy (``dynamic_cp/runtime/step_strategies.py``): replicated
as above, FSDP per_step or per_layer, each under pipeline stages too; the rest of the step is this
one loop in every mode.

Rank 0 alone writes metrics and checkpoints (sharded optimizer states are gathered to it first, in
the format of a plain AdamW state dict, so checkpoints move between modes and world sizes); every
rank reads the checkpoint when resuming (a shared file system, as on any cluster). Weights and
gradients are replicated on every rank here; ``parallel.fsdp=per_step|per_layer`` shards them
(``FSDPTrainer``, ``dynamic_cp/runtime/fsdp_trainer.py``).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from data.cli import RunStopped
from dit.checkpoint import kill_point_for_tests, resolve_checkpoint
from dit.clips import micro_batch_loss
from dit.config import Config
from dit.optim import optimizer_class, optimizer_kwargs
from dit.setup import clip_tokens, vae_stride
from dit.trainer import Trainer
from dynamic_cp.attention.comm_clock import CommClock
from dynamic_cp.attention.cp_attention import make_cp_attention
from dynamic_cp.runtime.cost_learning import STATE_FILE, build_learner, write_timeline
from dynamic_cp.runtime.fsdp import model_dims_of
from dynamic_cp.runtime.groups import build_cp_groups
from dynamic_cp.runtime.iterator import DynamicCPBatches, StepBatch
from dynamic_cp.runtime.pipeline import PipelineEval, PipelineTimeline, build_pipeline
from dynamic_cp.runtime.pipeline_checkpoint import (
    is_pipeline_checkpoint,
    resume_pipeline_checkpoint,
    save_pipeline_checkpoint,
)
from dynamic_cp.runtime.step_plans import cp_sizes_of
from dynamic_cp.runtime.step_stats import StepTimeline
from dynamic_cp.runtime.step_strategies import step_strategy
from dynamic_cp.runtime.timeouts import STARTUP_FACTOR, describe_timeout, set_collective_timeout


class CollectiveTimeout(RunStopped):
    """A collective waited longer than ``parallel.timeout_s``: another rank hung or died."""


def check_world_failures(failures, failed_in_world: int) -> None:
    """Stop when the world's broken files exceed ``max_failure_share``. Each rank loads only its share
    of the clips, so its own log undercounts; every rank gets the same world count from the step's
    all-reduce and so stops at the same step, with no rank left waiting in a collective."""
    if failures.total and failed_in_world / failures.total > failures.max_failure_share:
        from data.failures import TooManyFailures, too_many_failures

        raise TooManyFailures(
            too_many_failures(
                failed_in_world,
                failures.total,
                failures.max_failure_share,
                failures.failed,
                " over all ranks",
            )
        )


class DistributedTrainer(Trainer):
    """``Trainer`` whose steps run on a plan over ``world``; everything else (model, optimizer, EMA,
    checkpoints, validation) is the single-process trainer's."""

    def __init__(
        self,
        cfg: Config,
        world: dist.ProcessGroup,
        resume: str | None = None,
        device: torch.device | None = None,
    ):
        if cfg.parallel.mode not in ("static", "dynamic"):
            raise ValueError(
                f"parallel.mode={cfg.parallel.mode!r}; the distributed runtime needs 'static' or 'dynamic'"
            )
        self.world = world
        self.rank, self.world_size = dist.get_rank(world), dist.get_world_size(world)
        if type(self) is DistributedTrainer:
            from dynamic_cp.runtime.fsdp import resolve_fsdp_mode

            if resolve_fsdp_mode(cfg, self.world_size) != "none":
                raise ValueError(
                    f"parallel.fsdp={cfg.parallel.fsdp} shards the weights: build the trainer with "
                    "trainer_class(cfg, world) (FSDPTrainer), or set parallel.fsdp=none"
                )
        self.is_main = self.rank == 0
        # parallel.pp_size > 1: this rank's stage (dynamic_cp/runtime/pipeline.py); the plan, the
        # data flow, gradients and ZeRO-1 then live on the stage's ranks, the plan's world
        self.pipeline = build_pipeline(cfg, world, model_dims_of(cfg))
        pipe = self.pipeline
        self.plan_size, self.plan_rank = (
            (pipe.plan_size, pipe.plan_rank) if pipe else (self.world_size, self.rank)
        )
        self.grad_group = pipe.stage_group if pipe else world
        # how a step's plan runs and its gradients meet (dynamic_cp/runtime/step_strategies.py)
        self.strategy = step_strategy(self, self.fsdp_mode)  # FSDPTrainer resolved it before this runs
        # Same seed on every rank (Trainer seeds before building the model): identical replicas.
        super().__init__(cfg, resume=resume, device=device)
        for opt in self._zero_parts():
            # Loading a checkpoint leaves a second, never-read copy of this rank's moments in the
            # wrapper's own state (the live one is in its inner AdamW); state_dict() rebuilds the
            # full state from the per-rank gathers, so the copy only costs memory.
            opt.state.clear()
        # The planner's cost model starts from parallel.hardware and learns from the run
        # (dynamic_cp/runtime/cost_learning.py); plans carry the layouts they were priced with.
        resume_dir = resolve_checkpoint(resume) if resume is not None else None
        self.learner = build_learner(
            cfg, self.model.config, world, self.device, self.step, resume_dir, self.fsdp_mode
        )
        self.cost_model = self.learner.prior
        # Only "auto" may pick a 2-D (Ulysses x ring) layout; 'ulysses' and 'ring' force 1-D ones.
        splits = self.cost_model.cp_layout if cfg.parallel.cp_method == "auto" else None
        pp = cfg.parallel.pp_size
        self.groups = build_cp_groups(world, cp_sizes_of(cfg, self.plan_size), splits, pp)
        self.plan_fn = self.learner.plan
        self._overhead_s: list[float] = []  # measured step minus compute window, recent steps
        self.stride = vae_stride(cfg.data)
        failures = getattr(self.train_set, "failures", None)
        # found while building the dataset: the same on every rank, so counted once
        self._build_failures = len(failures.failed) if failures is not None else 0

    # ----------------------------------------------------------------------------- rank-0 side effects

    def _truncate_metrics(self, step: int) -> None:
        if self.is_main:
            super()._truncate_metrics(step)

    def log(self, record: dict) -> None:
        if "compute_s" in record and "step_s" in record:
            # predicted step = predicted compute window + the recent median of what lies outside it
            # (routing, all-reduce, optimizer), which the cost model does not price
            if self._overhead_s:
                record["predicted_step_s"] = record["predicted_s"] + statistics.median(self._overhead_s)
            self._overhead_s = [*self._overhead_s[-19:], record["step_s"] - record["compute_s"]]
        if self.is_main:
            super().log(record)

    def _shard_model(self) -> None:
        if self.pipeline is not None:  # the whole model was built and seeded: keep this stage's part
            self.pipeline.keep(self.model)

    def _optimizer_over(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if not self.cfg.parallel.shard_optimizer or self.plan_size == 1:
            return super()._optimizer_over(params)
        # Per-parameter broadcasts, not bucket views: views into one buffer share storage, which
        # safetensors refuses to save.
        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=optimizer_class(self.cfg.train),
            process_group=self.grad_group,
            parameters_as_bucket_view=False,
            **optimizer_kwargs(self.cfg.train),
        )

    def _zero_parts(self) -> list[ZeroRedundancyOptimizer]:
        """The ZeRO-1 optimizers (one, or one per expert under model.expert=both)."""
        parts = self.optimizer.parts.values() if self.both else [self.optimizer]
        return [opt for opt in parts if isinstance(opt, ZeroRedundancyOptimizer)]

    # ----------------------------------------------------------------------------- checkpoints
    # One path for every format: stage files under pipeline stages (pipeline_checkpoint.py, any
    # pp_size reads them), else the weights' own format (``_save_weights``/``_resume_weights``: rank
    # 0's replicated checkpoint here, DCP shards in FSDPTrainer). Each holds ``checkpoint_extras``
    # (the learned costs), and rank 0 saves the learner's files beside it.

    def _resume(self, path: str) -> None:
        step_dir = resolve_checkpoint(path)
        if self.pipeline is not None or is_pipeline_checkpoint(step_dir):
            return resume_pipeline_checkpoint(self, step_dir)  # names the fix for a stage-less one
        self._resume_weights_format(path)

    def _resume_weights_format(self, path: str) -> None:
        super()._resume(path)

    def checkpoint_extras(self) -> dict[str, str]:
        return {STATE_FILE: json.dumps(self.learner.state_dict())}

    def save(self):
        """Collective; -> the step directory on rank 0 (None elsewhere, and for background writes)."""
        if self.pipeline is not None:  # each stage writes its blocks
            step_dir = save_pipeline_checkpoint(self)
        else:
            step_dir = self._save_weights_format()
        if self.is_main:
            self.learner.save(self.out, self.step)
        return step_dir

    def _save_weights_format(self):
        sharded = self._zero_parts()
        for opt in sharded:
            opt.consolidate_state_dict(to=0)  # collective: every rank sends its moments
        try:
            # Replicas are identical (and the moments gathered), so rank 0's state is everyone's.
            if not self.is_main:
                # test-only, off by default: a rank that writes nothing dies while rank 0 writes
                kill_point_for_tests(self.step, self.out / "checkpoints" / f"step_{self.step:06d}.tmp")
                return None
            return super().save()  # Trainer.save, with checkpoint_extras
        finally:
            for opt in sharded:
                # torch keeps the gathered moments of every rank on rank 0 until the next gather
                # (_all_state_dicts, private): 8 bytes x all parameters of host memory, dropped here.
                opt._all_state_dicts = []

    # ----------------------------------------------------------------------------- data

    def data_iterator(self) -> DynamicCPBatches:
        c = self.cfg
        return DynamicCPBatches(
            self.train_set,
            self.train_indices,
            global_batch_size=c.train.global_batch_size,
            data_seed=c.data.seed,
            start_step=self.step,
            world=self.grad_group,  # every stage runs the same data flow over its own ranks
            token_fn=lambda i: clip_tokens(self.train_set.meta(i), self.patch, self.stride),
            prepare_fn=lambda sample, step: self.prepare([sample], step)[0],
            plan_fn=self.plan_fn,
            device=self.device,
            plan_ahead=c.parallel.plan_ahead,
            num_workers=c.data.num_workers,
            experts_fn=self._clip_experts if self.both else None,
        )

    def _clip_experts(self, step: int, indices: list[int], lengths: list[int]) -> list[str]:
        """model.expert=both: each clip's expert at ``step`` (what ``prepare`` will draw its sigma for)."""
        from dit.clips import clip_expert

        c, boundary = self.cfg, self.expert[1]
        return [clip_expert(c.flow, c.train.seed, step, i, n, boundary) for i, n in zip(indices, lengths)]

    # ----------------------------------------------------------------------------- one step

    def _sync(self) -> None:
        if self.device.type == "cuda":  # timestamps must see finished kernels, not queued ones
            torch.cuda.synchronize(self.device)

    def train_step(self, batch: StepBatch) -> dict:
        """This rank's micro-batches in plan order, one all-reduce, then the optimizer step."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        pipe = self.pipeline
        timeline = PipelineTimeline(batch.plan, self.plan_rank, pipe.stage, pipe.pp_size) if pipe else None
        timeline = timeline or StepTimeline(batch.plan, self.rank)
        self._sync()
        t0 = time.perf_counter()
        local_loss = self.strategy.run(batch, timeline, t0)
        timeline.finish(time.perf_counter() - t0)
        failures = getattr(self.train_set, "failures", None)
        # Broken files found while loading: each rank sees only its share of the clips, so the
        # max_failure_share check needs the world's count (it rides in the same all-reduce).
        local_failed = float(len(failures.failed) - self._build_failures) if failures is not None else 0.0
        local_failed *= pipe is None or pipe.first  # every stage loads the same clips: count them once
        extra = torch.cat([torch.tensor([local_failed], dtype=torch.float64), timeline.local().double()])
        total_loss, reduced = self.strategy.reduce(local_loss, extra)
        if failures is not None:
            check_world_failures(failures, self._build_failures + int(reduced[0]))
        gathered = reduced[1:]
        metrics = self.finish_step(total_loss)
        t_learn = time.perf_counter()
        measured = timeline.micro_batch_seconds(gathered)
        refit = self.learner.observe(batch.step, batch.plan, batch.lengths, measured)
        if refit and self.is_main:
            self.learner.save(self.out, batch.step + 1)
        if self.is_main and (batch.step + 1) % self.cfg.train.log_every == 0:
            planned_with = self.learner.model_at(batch.step)
            write_timeline(self.out, batch.step + 1, batch.plan, batch.lengths, planned_with, measured)
        hist = batch.plan.cp_histogram()
        return {
            **metrics,
            "num_micro_batches": len(batch.plan.micro_batches),
            "cp_hist": {str(c): n for c, n in hist.items()},
            "cp_layouts": self._layout_histogram(batch),
            "predicted_s": batch.plan.predicted_step_s,
            **timeline.summarize(gathered),
            "explore_s": batch.plan.info.get("explore_s", 0.0),
            "cost_model_step": batch.plan.info.get("model_step", 0),
            "cost_speed": batch.plan.info.get("speed", 1.0),  # pace factor on that fit (cost_learning.py)
            "learn_s": time.perf_counter() - t_learn,
            "plan_ms": batch.plan.solver_ms,
            **{k: round(v, 6) for k, v in batch.timings.items()},
        }

    def _timed_micro_batch(
        self, batch: StepBatch, timeline: StepTimeline, t0: float, m: int, ranks, clips
    ) -> float:
        """``_micro_batch`` with its start, end and CP-collective seconds recorded in ``timeline``."""
        ready = time.perf_counter() - t0
        loss, comm_s = self._micro_batch(batch, m, ranks, clips)
        self._sync()
        timeline.record(m, ready, time.perf_counter() - t0, comm_s)
        return loss

    def _micro_batch(self, batch: StepBatch, m: int, ranks, clips) -> tuple[float, float]:
        """Forward and backward of plan micro-batch ``m`` on this rank's token shard; -> (its loss,
        seconds spent in its CP collectives)."""
        heads = self.model.config.num_attention_heads
        lengths = [c.num_tokens for c in clips]
        layouts = batch.plan.info.get("layouts")
        layout = tuple(layouts[m]) if layouts else self.cost_model.layout(lengths, len(ranks))
        attention, shard = self._cp_attention(ranks, lengths, heads, layout)
        token_range = (shard.start, shard.end) if len(ranks) > 1 else None
        clock = CommClock(self.device)  # seconds in this micro-batch's CP collectives
        with clock.active():
            with self.autocast():
                loss = micro_batch_loss(self.model, clips, attention, batch.num_clips, token_range)
            loss.backward()
        return loss.item(), clock.seconds()

    def _cp_attention(self, ranks, lengths: list[int], heads: int, layout: tuple[int, int]):
        """(attention, shard) for one micro-batch in the layout its plan priced for it (the cost
        model's ``layout``, or an exploratory one): the planner's prices and what runs agree."""
        u, r = layout
        sub_groups = self.groups.sub_groups(ranks, u) if u > 1 and r > 1 else None
        return make_cp_attention(
            self.groups.get(ranks), lengths, num_heads=heads, layout=(u, r), sub_groups=sub_groups
        )

    def _layout_histogram(self, batch: StepBatch) -> dict[str, int]:
        """ "UxR" -> micro-batches of the plan (all ranks) that run Ulysses U x ring R, CP > 1 only."""
        hist: dict[str, int] = {}
        for (ranks, _), (u, r) in zip(batch.plan.micro_batches, batch.plan.info["layouts"]):
            if len(ranks) > 1:
                hist[f"{u}x{r}"] = hist.get(f"{u}x{r}", 0) + 1
        return dict(sorted(hist.items()))

    def _clip(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return self.strategy.clip(params, max_norm)

    # ----------------------------------------------------------------------------- loop

    @torch.no_grad()
    def validation_loss(self) -> float:
        if self.pipeline is None:
            return (
                super().validation_loss()
                if self.is_main or self.strategy.validates_on_every_rank
                else float("nan")
            )
        # each stage's plan rank 0 (every rank when weights are sharded) runs its part
        if self.plan_rank != 0 and not self.strategy.validates_on_every_rank:
            return float("nan")
        self._pipeline_eval = PipelineEval(self)
        try:
            return self._pipeline_eval.finish(super().validation_loss())
        finally:
            self._pipeline_eval = None

    def _eval_loss(self, mb, num_clips: int) -> float:
        if self.pipeline is None:
            return super()._eval_loss(mb, num_clips)
        return self._pipeline_eval.loss(mb, num_clips)

    def run_step(self, batch: StepBatch) -> tuple[dict, list[int]]:
        self._doing = f"step {self.step + 1}"
        return {**self.train_step(batch), "world_size": self.world_size}, list(batch.lengths)

    # ----------------------------------------------------------------------------- bounded hangs

    @contextlib.contextmanager
    def side_work(self):
        """Validation, samples and checkpoints may run on rank 0 alone while the others wait: under the
        start-up timeout, ended by a barrier; then every collective gets ``parallel.timeout_s``."""
        t, step = self.cfg.train, self.step
        busy = step % t.val_every == 0 or step % t.checkpoint_every == 0 or step == t.max_steps
        busy = busy or bool(t.sample_every and step % t.sample_every == 0)
        self._doing = f"the validation, samples or checkpoint after step {step}"
        if busy:
            set_collective_timeout(STARTUP_FACTOR * self.cfg.parallel.timeout_s)
        yield
        if busy:
            dist.barrier(group=self.world)  # the others wait here for rank 0's side work
        set_collective_timeout(self.cfg.parallel.timeout_s)
        # what follows is the next step's work, its data routing (route_clips) before run_step included
        self._doing = f"step {step + 1}"

    def train(self) -> None:
        self._doing = "the start-up (step-0 validation, first plan)"
        try:
            super().train()
        except RuntimeError as err:
            collective = describe_timeout(err)
            if collective is None:
                raise
            raise CollectiveTimeout(
                f"rank {self.rank}: collective {collective} timed out in {self._doing}: another rank is hung "
                f"or dead (see its log; on NCCL every rank dumped its flight-recorder trace to "
                f"{self.out / 'flight_recorder'}, read with `python -m torch.distributed.flight_recorder."
                f"fr_trace {self.out / 'flight_recorder'}`); parallel.timeout_s={self.cfg.parallel.timeout_s:g}"
            ) from None
