"""Single-process training loop: data, micro-batches by token budget, AdamW, EMA, logs, checkpoints.

The multi-process Dynamic-CP runtime (``dynamic_cp/runtime/distributed_trainer.py``) reuses the pieces here and replaces
only how a step's clips are split into micro-batches and which attention each micro-batch runs with.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from data.cli import RunStopped
from data.failures import absorb_worker_failures
from dit.attention import PackedAttention
from dit.batching import close_batches, pack_by_token_budget, step_loader
from dit.block_offload import offload_model
from dit.checkpoint import load_trainer_state, resolve_checkpoint, save_checkpoint, set_rng_state
from dit.clips import TrainClip, micro_batch_loss, prepare_clip, validation_clips
from dit.compile import compile_blocks
from dit.config import Config, to_dict
from dit.device_memory import bar_text, peak_memory, reset_peak
from dit.ema import EMA, AdapterEMA, ema_not_ready
from dit.expert_offload import idle_expert_host
from dit.expert_training import expert_optimizers
from dit.flops import train_step_flops
from dit.model import VideoDiT
from dit.optim import build_lr_schedule, build_optimizer, check_optimizer_runs
from dit.run_dir import truncate_metrics
from dit.setup import expert_of
from dit.tracking import Tracker, check_trackers_installed
from dit.train_setup import (
    blocks_to_offload,
    build_train_data,
    build_train_model,
    check_train_options,
    validation_sigmas,
    warn_on_few_checkpoints,
)
from dit.trainer_resume import load_checkpoint_tensors


def autocast_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``train.mixed_precision`` on ``device``; None runs fp32."""
    if mixed_precision == "bf16" or (mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class Trainer:
    rank, world_size, is_main = 0, 1, True  # the distributed runtime's subclass sets its own
    fsdp_mode = "none"  # FSDPTrainer's resolved parallel.fsdp (auto too), set before __init__ runs

    def __init__(self, cfg: Config, resume: str | None = None, device: torch.device | None = None):
        self.cfg = cfg
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.out = Path(cfg.output_dir)
        # a missing tracker library or an optimizer this device cannot run stops here, before any data
        check_trackers_installed(cfg.train.report_to)
        check_optimizer_runs(cfg.train, self.device)
        self._tracker: Tracker | None = None
        if self.is_main:
            warn_on_few_checkpoints(cfg)
        self.expert = expert_of(cfg.model)  # (name, boundary_ratio) of a Wan2.2 A14B expert, or None
        self.both = bool(self.expert) and self.expert[0] == "both"  # two experts, dit/expert_training.py
        check_train_options(cfg, self.expert, self.device)
        self.val_sigmas = validation_sigmas(cfg.flow.val_sigmas, self.expert)
        self.lora = cfg.model.lora is not None
        model = build_train_model(cfg, self.expert, self.compute_dtype(), self.fsdp_mode != "none")
        self.offloaders = offload_model(model, cfg.model, self.device, blocks_to_offload(cfg, model))
        self.expert_host = idle_expert_host(self, model)  # model.idle_expert=cpu, dit/expert_offload.py
        self.model: VideoDiT = model.to(self.device)
        self.patch = tuple(self.model.config.patch_size)
        self.train_set, self.train_indices, self.val_set, self.val_indices, self.encoder = build_train_data(
            cfg, self.model.config, self.device
        )
        self._shard_model()
        self.optimizer = self._build_optimizer()
        if self.both:
            from dit.expert_training import ExpertSchedules

            self.lr_schedule = ExpertSchedules(self.optimizer, lambda opt: build_lr_schedule(cfg.train, opt))
        else:
            self.lr_schedule = build_lr_schedule(cfg.train, self.optimizer)
        self.ema = self._build_ema() if cfg.train.ema_decay > 0 else None
        if cfg.model.compile:  # after the EMA copy: the EMA model only samples, eagerly
            compile_blocks(self.model)
        self.step = 0
        self.bad_steps = 0
        self._background = None
        if cfg.train.async_checkpoint and not self.lora:  # LoRA checkpoints are the adapters: small
            from dit.async_checkpoint import BackgroundCheckpointer

            self._background = BackgroundCheckpointer()
        self._val_clips: list[list[TrainClip]] | None = None
        if resume is not None:
            self._resume(resume)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer, gradient clipping and the gradient all-reduce see: every parameter that
        requires a gradient (all of them in full training; the adapters alone under LoRA)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """The run's optimizer over the trainable parameters; under model.expert=both one per expert."""
        if self.both:
            return expert_optimizers(self, self._optimizer_over)
        return self._optimizer_over(self.trainable_parameters())

    def _optimizer_over(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """An optimizer over ``params`` (the distributed runtime may shard its states)."""
        return build_optimizer(self.cfg.train, params)

    def _shard_model(self) -> None:
        """Where the distributed runtime shards the weights (FSDP), before the optimizer sees them."""

    def _build_ema(self) -> EMA | AdapterEMA:
        """The EMA of the weights: of the adapters alone under LoRA (no copy of the frozen base); the
        distributed runtime keeps one of its local shards under FSDP."""
        return (AdapterEMA if self.lora else EMA)(self.model, self.cfg.train.ema_decay)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip the trainable gradients to ``max_norm`` (inf: no clipping); -> their total norm.
        Under model.expert=both each expert's on its own; -> the norm of both."""
        if self.both:
            from dit.expert_training import clip_expert_gradients

            return clip_expert_gradients(self.model, max_norm, self._clip)
        return self._clip(self.trainable_parameters(), max_norm)

    def _clip(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    # ----------------------------------------------------------------------------- checkpoints

    def _resume(self, path: str) -> None:
        step_dir = resolve_checkpoint(path)
        state = load_trainer_state(step_dir)
        load_checkpoint_tensors(self.model, self.ema, self.optimizer, step_dir, state, self.lora)
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        # the groups' lr is the schedule's last (a stage checkpoint's moments come without the groups)
        for group, lr in zip(self.optimizer.param_groups, self.lr_schedule.get_last_lr()):
            group["lr"] = lr
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        set_rng_state(state["rng"])
        self._truncate_metrics(self.step)
        if self.is_main:  # one line per job, not one per rank
            print(f"resumed from {step_dir} at step {self.step}")

    def save(self) -> Path:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "lr_schedule": self.lr_schedule.state_dict(),
            "bad_steps": self.bad_steps,
        }
        if self.lora:  # the adapters alone (the base is model.pretrained), in diffusers' LoRA format
            from dit.lora import LoraFiles

            model, ema = LoraFiles(self.model), LoraFiles(self.model, self.ema.state) if self.ema else None
        else:
            model, ema = self.model, self.ema.model if self.ema else None
        args = (self.out / "checkpoints", self.step, model, ema, state, to_dict(self.cfg))
        keep, extra = self.cfg.train.keep_checkpoints, self.checkpoint_extras()
        if self._background is not None:  # staged now, written by a thread; check() reports failures
            self._background.save(*args, keep, extra)
            return self.out / "checkpoints" / f"step_{self.step:06d}"
        return save_checkpoint(*args, keep, extra)

    def checkpoint_extras(self) -> dict[str, str]:
        """More text files for the checkpoint folder, {name: text} (the runtime's learned costs)."""
        return {}

    def _truncate_metrics(self, step: int) -> None:
        truncate_metrics(self.out, step)

    @property
    def tracker(self) -> Tracker:
        """The run's ``train.report_to`` sinks, opened on first use (after a resume has set the step);
        ranks other than the logging one get a tracker that writes nothing."""
        if self._tracker is None:
            t = self.cfg.train
            self._tracker = (
                Tracker(self.out, t.report_to, to_dict(self.cfg), self.step or None, t.tracker_project)
                if self.is_main
                else Tracker.disabled()
            )
        return self._tracker

    def log(self, record: dict) -> None:
        if "val_loss" in record and self.is_main:  # to the console too, above the progress bar
            tqdm.write(f"step {record['step']}: validation loss {record['val_loss']:.4f}")
        self.tracker.log(record)

    def write_config(self) -> Path:
        """``<output_dir>/config.yaml``: the resolved config, there before step 0 so that a run that
        dies early still says what it ran (each checkpoint keeps its own copy too)."""
        import yaml

        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "config.yaml"
        path.write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        return path

    # ----------------------------------------------------------------------------- one step

    def compute_dtype(self) -> torch.dtype:
        return autocast_dtype(self.cfg.train.mixed_precision, self.device) or torch.float32

    def autocast(self):
        """bf16 autocast on explicit 'bf16' (CPU too: the tests run the casts a GPU run does) or on
        CUDA under 'auto'; fp32 weights, gradients and optimizer states either way."""
        if autocast_dtype(self.cfg.train.mixed_precision, self.device) is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def prepare(self, samples: list[dict], step: int) -> list[TrainClip]:
        c = self.cfg
        absorb_worker_failures(samples, getattr(self.train_set, "failures", None))
        return [
            prepare_clip(
                s, self.encoder, self.patch, c.flow, c.data.caption_dropout, c.train.seed, step, self.expert
            )
            for s in samples
        ]

    def train_step(self, clips: list[TrainClip]) -> dict:
        """Forward and backward over the micro-batches, then one optimizer step. Returns metrics."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for group in self._micro_batches(clips):
            mb = [clips[i] for i in group]
            with self.autocast():
                loss = micro_batch_loss(
                    self.model, mb, PackedAttention([c.num_tokens for c in mb]), len(clips)
                )
            loss.backward()
            total += loss.item()
        return self.finish_step(total)

    def _micro_batches(self, clips: list[TrainClip]) -> list[list[int]]:
        """Token-budget packing; under model.expert=both each expert's clips apart (high first), so
        every micro-batch runs one expert."""
        budget = self.cfg.train.micro_batch_tokens
        if not self.both:
            return pack_by_token_budget([c.num_tokens for c in clips], budget)
        from dit.expert_training import pack_per_expert

        return pack_per_expert(clips, budget, self.expert[1])

    def finish_step(self, loss: float) -> dict:
        """Clip, guard against non-finite values, step the optimizer, LR schedule and EMA."""
        if self._background is not None:  # a background save still copying the weights it saves
            self._background.wait_staged()
        clip = self.cfg.train.grad_clip
        grad_norm = self.clip_gradients(clip if clip > 0 else math.inf)
        if not (math.isfinite(loss) and torch.isfinite(grad_norm)):
            self.bad_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            if self.bad_steps >= self.cfg.train.max_bad_steps:
                raise RunStopped(
                    f"{self.bad_steps} steps in a row had a non-finite loss or gradient (last loss {loss}); "
                    "lower train.lr, raise train.warmup_steps or check the data"
                )
            return {"loss": loss, "grad_norm": float(grad_norm), "skipped": True}
        self.bad_steps = 0
        self.optimizer.step()
        self.lr_schedule.step()
        if self.ema is not None:
            # model.expert=both: only the experts that stepped (an idle one's average stays put)
            only = tuple(f"{n}." for n in self.optimizer.active) if self.both else None
            self.ema.update(self.model, only)
        return {"loss": loss, "grad_norm": float(grad_norm)}

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Mean loss of the held-out clips at fixed sigmas and fixed noise: comparable across steps."""
        self.model.eval()
        if self._val_clips is None:  # fixed inputs: encode once, reuse at every evaluation
            samples = [self.val_set[i] for i in self.val_indices]
            self._val_clips = validation_clips(
                samples, self.encoder, self.patch, self.cfg.flow, self.val_sigmas
            )
        losses = []
        for clips in self._val_clips:
            for group in pack_by_token_budget(
                [c.num_tokens for c in clips], self.cfg.train.micro_batch_tokens
            ):
                losses.append(self._eval_loss([clips[i] for i in group], len(clips)))
        return sum(losses) / len(self.val_sigmas)

    def _eval_loss(self, mb: list[TrainClip], num_clips: int) -> float:
        """One validation micro-batch's loss (pipeline stages run their part of it instead)."""
        with self.autocast():
            return micro_batch_loss(
                self.model, mb, PackedAttention([c.num_tokens for c in mb]), num_clips
            ).item()

    # ----------------------------------------------------------------------------- samples and export

    def sampling_weights(self):
        """Context giving the weights to sample with: the EMA's once it shows what was learned (a
        young one is mostly the starting weights, ``ema_not_ready``), else the live ones."""
        if self.ema is None or ema_not_ready(self.cfg.train.ema_decay, self.step):
            return contextlib.nullcontext(self.model)
        return self.ema_weights()

    def ema_weights(self):
        """Context giving the EMA's weights (under LoRA its adapters swapped in): what the run exports."""
        if self.lora:
            return self.ema.swapped_in(self.model)
        return contextlib.nullcontext(self.ema.model)

    @torch.no_grad()
    def write_samples(self) -> list[str]:
        """Validation clips of ``train.sample_prompts`` at a fixed seed -> mp4s and a PNG grid under
        ``<output_dir>/samples``; returns their paths. Only the logging rank samples: under torchrun
        the others wait in a barrier (``side_work``; 3 x ``parallel.timeout_s`` bounds how long
        sampling may take)."""
        if not self.is_main:
            return []
        from dit.train_samples import training_samples

        t = self.cfg.train
        with self.sampling_weights() as model, self.autocast():
            videos, paths = training_samples(model, self.encoder, t, self.cfg.flow.shift, self.out, self.step)
        for i, (prompt, video, mp4) in enumerate(zip(t.sample_prompts, videos, paths)):
            self.tracker.log_video(f"samples/{i:02d}", video, self.step, caption=prompt, mp4=mp4)
        return [str(p) for p in paths]

    def export_lora(self) -> Path:
        """The run's LoRA in diffusers' format: ``<output_dir>/pytorch_lora_weights.safetensors`` (the
        EMA adapters when there is an EMA), for ``WanPipeline.load_lora_weights(output_dir)``; under
        model.expert=both one per expert, ``<output_dir>/transformer/`` and ``transformer_2/``
        (``load_lora_weights(that folder, load_into_transformer_2=True)`` for the low expert's)."""
        from dit.lora import save_model_lora, stage_export

        state = self.ema.state if self.ema else None
        paths = stage_export(self.model, self.out, self.step, state is not None)  # a pipeline stage's
        paths = paths or save_model_lora(self.model, self.out, state=state)
        for path in paths:
            print(f"wrote {path}")
        return paths[0]

    # ----------------------------------------------------------------------------- loop

    def data_iterator(self):
        c = self.cfg
        return iter(
            step_loader(
                self.train_set, self.train_indices, c.train.global_batch_size, c.data.seed, self.step,
                c.data.num_workers,
            )
        )  # fmt: skip

    def side_work(self):
        """Around what follows a step (validation, samples, logs, checkpoint): the distributed
        runtime gives it a longer collective timeout, as rank 0 may do it alone while others wait."""
        return contextlib.nullcontext()

    def run_step(self, samples: list[dict]) -> tuple[dict, list[int]]:
        """One optimizer step on a global batch from ``data_iterator``: (metrics, clip token counts)."""
        clips = self.prepare(samples, self.step)
        return self.train_step(clips), [c.num_tokens for c in clips]

    def train(self) -> None:
        t = self.cfg.train
        dims = self.model.config
        dim = dims.num_attention_heads * dims.attention_head_dim
        if self.is_main:
            self.write_config()
        if self.step == 0:
            first = {"step": 0, "val_loss": self.validation_loss()}
            if t.sample_every:  # the "before" clips of the run
                first["samples"] = self.write_samples()
            self.log(first)
        batches = self.data_iterator()
        bar = tqdm(
            total=t.max_steps, initial=self.step, desc="train", dynamic_ncols=True, disable=not self.is_main
        )
        try:
            while self.step < t.max_steps:
                if self._background is not None:
                    self._background.check()  # the last background save failed: stop here, say why
                reset_peak(self.device)
                started = time.perf_counter()
                metrics, lengths = self.run_step(next(batches))
                seconds = time.perf_counter() - started
                self.step += 1
                flops = train_step_flops(lengths, dim, dims.ffn_dim, dims.num_layers)
                record = {
                    "step": self.step,
                    **metrics,
                    "lr": self.lr_schedule.get_last_lr()[0],
                    "tokens": sum(lengths),
                    "tokens_per_s": sum(lengths) / seconds,
                    "tflops": flops / seconds / 1e12,
                    "step_s": seconds,
                    **peak_memory(self.device),
                }
                if t.peak_tflops:
                    record["mfu"] = record["tflops"] / (t.peak_tflops * self.world_size)
                with self.side_work():
                    if self.step % t.val_every == 0 or self.step == t.max_steps:
                        record["val_loss"] = self.validation_loss()
                    if t.sample_every and (self.step % t.sample_every == 0 or self.step == t.max_steps):
                        record["samples"] = self.write_samples()
                    if self.step % t.log_every == 0 or "val_loss" in record or "samples" in record:
                        self.log(record)
                    bar.set_postfix(
                        loss=f"{metrics['loss']:.4f}",
                        tok_s=f"{record['tokens_per_s']:.0f}",
                        mem=bar_text(record),
                    )
                    bar.update(1)
                    if self.step % t.checkpoint_every == 0 or self.step == t.max_steps:
                        self.save()
            if self._background is not None:
                self._background.wait()  # the final checkpoint is on disk when train() returns
        finally:
            bar.close()
            close_batches(batches)  # also when a step raised: a held traceback keeps the iterator
            self.tracker.close()
        if self.lora and self.is_main:
            self.export_lora()
        failures = getattr(self.train_set, "failures", None)
        if failures is not None:  # under CP each rank counts the broken files of its own share
            print(f"rank {self.rank}: {failures.summary()}" if self.world_size > 1 else failures.summary())
