"""``train.py --dry-run``: what a config would do, before any GPU hour is spent. Trains nothing.

Builds the model on the meta device (shapes, no weights) and the dataset's metadata, then prints
the clip count, token statistics, parameter count, the memory estimate per GPU and, under
``parallel.mode=dynamic``, the planner's plan of the first step. A path that does not exist (the
shipped configs hold ``/path/to/...`` placeholders) is listed as a problem and makes the exit code
non-zero, but everything that does not need it is still printed: the parameter count and memory
come from ``model.size`` when ``model.pretrained`` is missing.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from data.cache_dataset import LatentCacheDataset
from dit.config import Config
from dit.image_cond import conditioning_of
from dit.model import VideoDiT
from dit.setup import build_datasets, check_cache_fits, clip_tokens, model_config_of, vae_stride
from dit.sizes import model_kwargs
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.memory import FSDP_MODES
from dynamic_cp.runtime.run_memory import MEMORY_FRACTION
from dynamic_cp.runtime.step_plans import (
    build_cost_model,
    cap_tokens_of,
    clip_token_limit,
    cp_sizes_of,
    largest_cp_of,
    make_plan_fn,
    stage_layers_of,
)

GB = 1e9


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gb(n: float) -> str:
    return f"{n / GB:.1f}" if n >= GB else f"{n / GB:.3f}"


def missing_paths(cfg: Config) -> list[str]:
    """Problems: every local path the config names that does not exist, by its dotted key."""
    paths = {
        "model.pretrained": cfg.model.pretrained,
        "data.vae_path": cfg.data.vae_path,
        "data.text_encoder_path": cfg.data.text_encoder_path,
        "data.image_encoder_path": cfg.data.image_encoder_path,
    }
    source = cfg.data.source
    if source != "synthetic" and not (":" in source and os.sep not in source.split(":", 1)[0]):
        paths["data.source"] = source  # a folder, manifest or cache; 'pkg.module:Class' is imported
    if cfg.parallel.hardware.endswith((".yaml", ".yml")):
        paths["parallel.hardware"] = cfg.parallel.hardware
    return [f"{key}={path} does not exist" for key, path in paths.items() if path and not Path(path).exists()]


def meta_model(cfg: Config, use_pretrained: bool) -> VideoDiT:
    """The configured VideoDiT with parameters on the meta device: shapes and counts, no memory."""
    kwargs = (
        model_config_of(cfg.model) if use_pretrained else model_kwargs(cfg.model.size, cfg.model.overrides)
    )
    with torch.device("meta"):
        return VideoDiT(**kwargs)


def token_stats(lengths: list[int]) -> dict[str, float]:
    s = sorted(lengths)
    return {
        "min": s[0],
        "median": statistics.median(s),
        "mean": statistics.fmean(s),
        "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
        "max": s[-1],
    }


def memory_estimate(
    cfg: Config, model: VideoDiT, world_size: int, gpu_bytes: float, tokens: int | None = None
) -> tuple[str, dict]:
    """(fsdp mode, bytes per GPU by part) from the memory model, as the run decides by it
    (``dynamic_cp.runtime.run_memory``): ``parallel.fsdp`` as the launcher resolves it (``auto``: for
    ``gpu_bytes``), the LoRA base as ``model.base_dtype`` stores it and ``model.offload`` places it,
    and one micro-batch of ``tokens`` a rank (default ``parallel.cap_tokens``, ``train.micro_batch_tokens``
    unparallel; ``rank_tokens`` raises it to the largest clip's share)."""
    from dynamic_cp.runtime.fsdp import auto_fsdp_choice, model_dims_of
    from dynamic_cp.runtime.run_memory import offload_count, run_breakdown

    dims = model_dims_of(cfg, dict(model.config))
    mode = "none" if cfg.parallel.mode == "none" or cfg.model.lora is not None else cfg.parallel.fsdp
    if mode == "auto":
        mode = auto_fsdp_choice(cfg, world_size, gpu_bytes, dims)[0]
    tokens = _tokens_of(cfg) if tokens is None else tokens
    blocks = offload_count(cfg, world_size, dims, tokens, gpu_bytes)
    m = run_breakdown(cfg, world_size, mode, dims, tokens, blocks)
    parts = {
        "weights": m.master_weights + m.compute_weights,
        "gradients": m.gradients,
        "optimizer": m.optimizer,
        "ema": m.ema,
        "activations": m.activations,
        "idle expert": m.idle_expert,
        "host": m.host,
        "offloaded": m.host_offload,
        "offload blocks": blocks,
    }
    return mode, {**parts, "total": m.total, "gpu": gpu_bytes}


def echo_memory(
    cfg: Config, mode: str, mem: dict, echo: Callable[[str], None], tokens: int | None = None
) -> bool:
    """The memory estimate's lines at ``tokens`` a rank: the parts, the experts and the offload, and
    whether it fits (-> True when it does)."""
    tokens = _tokens_of(cfg) if tokens is None else tokens
    keys = ["weights", "gradients", "optimizer", "ema", "activations"]
    if cfg.model.expert == "both":
        keys += ["idle expert"]
    parts = ", ".join(f"{k} {_gb(mem.get(k, 0.0))}" for k in keys)
    echo(
        f"memory per GPU (estimate, parallel.fsdp={cfg.parallel.fsdp}"
        f"{' -> ' + mode if cfg.parallel.fsdp == 'auto' else ''}): {_gb(mem['total'])} GB of "
        f"{mem['gpu'] / GB:.0f} GB ({_memory_source(cfg)}): {parts} GB"
    )
    if cfg.model.expert == "both":
        where = "on the GPU" if cfg.model.idle_expert == "sharded" else f"{_gb(mem['host'])} GB on the host"
        echo(
            f"  two experts (model.expert=both): the idle one at rest {where} (model.idle_expert={cfg.model.idle_expert})"
        )
    store = f"base_dtype={cfg.model.base_dtype}"
    if cfg.model.offload != "none":
        echo(
            f"  model.offload={cfg.model.offload}: {mem['offload blocks']} blocks offloaded "
            f"(offload_blocks={cfg.model.offload_blocks}), {_gb(mem['offloaded'])} GB of pinned host memory"
        )
        store += f" + offload {mem['offload blocks']}"
    budget = mem["gpu"] * MEMORY_FRACTION
    fit = "fits" if mem["total"] <= budget else "does not fit"
    echo(
        f"  {fit} in {MEMORY_FRACTION:.0%} of {mem['gpu'] / GB:.0f} GB (estimate) at {tokens:,} tokens "
        f"a rank with {store}"
        + ("" if fit == "fits" else f"; it would run out of memory: {_what_is_missing(cfg)}")
    )
    return fit == "fits"


def rank_tokens(cfg: Config, world_size: int, largest: int) -> int:
    """Tokens a rank holds at most: the cap, or the largest clip's share of the largest CP group when
    it is more (a run with ``parallel.mode=none`` trains such a clip alone, whatever the budget)."""
    cp = largest_cp_of(cfg, world_size)
    return max(_tokens_of(cfg), -(-largest // cp))


def clip_size_problems(cfg: Config, world_size: int, largest: int, dataset) -> list[str]:
    """A clip larger than one rank (or the largest CP group) holds: the step-0 plan refuses it under
    Dynamic-CP, and a single process runs it for as long as its attention takes (30M tokens: never
    returns), so it is a problem in every mode, with the fix for this kind of source."""
    limit, words = clip_token_limit(cfg, world_size)
    if largest <= limit:
        return []
    if isinstance(dataset, LatentCacheDataset):
        fix = "re-run python -m data.cache with --resolution, --max-frames, --fps or --max-tokens into a new --out"
    elif cfg.data.source == "synthetic":
        fix = "lower data.resolutions or data.frame_counts"
    else:
        fix = f"set 'data.options={{max_tokens: {limit}}}' (or resolution, max_frames, fps)"
    return [f"data: the largest clip has {largest:,} tokens, more than {words}; {fix}, or raise that budget"]


def _what_is_missing(cfg: Config) -> str:
    """The memory knobs this config has not turned yet, in the order they cost speed."""
    m = cfg.model
    knobs = [] if m.gradient_checkpointing else ["model.gradient_checkpointing=true"]
    if m.lora is not None and not m.base_dtype.startswith("fp8"):
        knobs.append("model.base_dtype=fp8_scaled")
    if m.lora is not None and m.offload != "blocks+activations":
        knobs.append("model.offload=blocks" if m.offload == "none" else "model.offload=blocks+activations")
    if m.lora is None:
        knobs.append("parallel.fsdp=per_layer or more GPUs")
    knobs.append("fewer tokens a rank (train.micro_batch_tokens / parallel.cap_tokens)")
    return "try " + ", ".join(knobs)


def _memory_source(cfg: Config) -> str:
    if cfg.parallel.memory_gb is not None:
        return "parallel.memory_gb"
    if cfg.parallel.hardware == "auto":  # nothing here was measured, on a CPU-only machine least of all
        return "an assumed h100: set parallel.hardware or parallel.memory_gb for yours"
    return cfg.parallel.hardware


def _tokens_of(cfg: Config) -> int:
    return int(cap_tokens_of(cfg) if cfg.parallel.mode != "none" else cfg.train.micro_batch_tokens)


def echo_pipeline(cfg: Config, cm, world_size: int, lengths, echo: Callable[[str], None]) -> None:
    """``parallel.pp_size > 1``: the first step planned over one stage's ranks (Dynamic-CP: CP sizes,
    packing and order for the pipeline, ``plan_for_pipeline``), replayed on the stages: step, bubble
    fraction and each stage's memory per GPU (``memory.stage_memory``'s planning convention). Without
    the data (``lengths`` None): the memory of 1F1B's pp - stage micro-batches in flight at the cap."""
    from dynamic_cp.planning.baselines import static_plan
    from dynamic_cp.planning.pipeline_memory import stage_memory
    from dynamic_cp.planning.pipeline_order import plan_for_pipeline
    from dynamic_cp.planning.pipeline_sim import simulate_pipeline
    from dynamic_cp.planning.pipeline_stages import check_pipeline

    pp, schedule = cfg.parallel.pp_size, cfg.parallel.pp_schedule
    check_pipeline(world_size, pp, cm.dims.layers)
    R, cap = world_size // pp, cap_tokens_of(cfg)
    layers = stage_layers_of(cfg, cm.dims)
    head = f"pipeline: {pp} stages x {R} ranks, blocks {layers}, parallel.pp_schedule={schedule}"
    if lengths is not None:
        if cfg.parallel.mode == "dynamic":
            plan = plan_for_pipeline(lengths, R, cap, cm, layers, schedule, cp_sizes=cp_sizes_of(cfg, R))
        else:
            plan = static_plan(lengths, R, cap, cm, cp_sizes=cp_sizes_of(cfg, R))
        s = simulate_pipeline(plan, lengths, cm, layers, schedule)
        hist = ", ".join(f"CP{c} x{n}" for c, n in sorted(plan.cp_histogram().items()))
        echo(
            f"{head}; first step {len(plan.micro_batches)} micro-batches ({hist}), predicted "
            f"{s.step_s:.3f} s, bubble {s.bubble_fraction():.1%}, planned in {plan.solver_ms:.0f} ms"
        )
        in_flight = s.peak_tokens
    elif schedule == "1f1b":
        echo(
            f"{head}; step and bubble need the data; memory at {cap:,} tokens a micro-batch, pp - stage in flight"
        )
        in_flight = [cap * (pp - p) for p in range(pp)]
    else:
        echo(f"{head}; gpipe holds every micro-batch of a step: step, bubble and memory need the data")
        return
    for p, tokens in enumerate(in_flight):
        states, act = stage_memory(cm.dims, layers, p, R, cfg.model.gradient_checkpointing)
        echo(
            f"  stage {p} (ranks {p * R}-{p * R + R - 1}): {_gb(states + tokens * act)} GB per GPU = "
            f"states {_gb(states)} + activations {_gb(tokens * act)} ({tokens:,.0f} tokens in flight)"
        )


def dry_run(cfg: Config, world_size: int = 1, echo: Callable[[str], None] = print) -> int:
    """Print what ``cfg`` would run; -> 0, or 1 when problems were found (listed at the end)."""
    problems = missing_paths(cfg)
    echo(f"dry run of {cfg.output_dir}: parallel.mode={cfg.parallel.mode}, {world_size} rank(s)")

    pretrained_ok = bool(cfg.model.pretrained) and Path(cfg.model.pretrained).exists()
    try:
        model = meta_model(cfg, pretrained_ok)
    except ValueError as err:
        problems.append(str(err))
        model = meta_model(cfg, False)
    src = "model.pretrained" if pretrained_ok else f"model.size={cfg.model.size}"
    params = sum(p.numel() for p in model.parameters())
    echo(f"model: {_count(params)} parameters ({params:,}) from {src}; weights not allocated (meta)")
    if cfg.model.expert is not None:
        try:
            from dit.setup import expert_of

            ratio = expert_of(cfg.model)[1]
            if cfg.model.expert == "both":
                echo(
                    f"  Wan2.2 A14B's two experts (model.expert=both, switch at t = {ratio * 1000:g}): "
                    f"{_count(2 * params)} parameters in all; each micro-batch runs one expert"
                )
            else:
                side = f"t >= {ratio * 1000:g}" if cfg.model.expert == "high" else f"t < {ratio * 1000:g}"
                echo(
                    f"  one Wan2.2 A14B expert: model.expert={cfg.model.expert} ({side}); every figure here is "
                    "per expert, and the other expert trains in its own run"
                )
        except ValueError as err:
            problems.append(str(err))

    lengths, largest = None, 0
    if "data.source" in " ".join(problems):
        echo("data: skipped (data.source is missing)")
    else:
        try:
            patch = tuple(model.config.patch_size)
            train_set, train_idx, val_set, val_idx = build_datasets(cfg.data, patch)
            stride = vae_stride(cfg.data)
            tokens = [clip_tokens(train_set.meta(i), patch, stride) for i in train_idx]
            val_tokens = [clip_tokens(val_set.meta(i), patch, stride) for i in val_idx]
            st = token_stats(tokens)
            echo(f"data: {len(train_idx)} training clips, {len(val_idx)} validation clips")
            echo(
                f"tokens per clip: min {st['min']:,} median {st['median']:,.0f} mean {st['mean']:,.0f} "
                f"p99 {st['p99']:,} max {st['max']:,}; {st['mean'] * cfg.train.global_batch_size:,.0f} per step on average"
            )
            largest = max(tokens + val_tokens)
            problems += clip_size_problems(cfg, world_size, largest, train_set)
            channels = getattr(train_set, "latent_channels", None) or (
                3 if cfg.data.vae == "identity" else None
            )
            if (
                channels is not None
            ):  # what Trainer checks at start-up: text- or image-to-video, and the cache
                try:
                    conditioning = conditioning_of(model.config, channels, stride[0])
                    if isinstance(train_set, LatentCacheDataset):
                        check_cache_fits(cfg.data, train_set, conditioning, model.config.image_dim)
                except ValueError as err:
                    problems.append(str(err))
            from dit.batching import GlobalBatchSampler

            first = GlobalBatchSampler(train_idx, cfg.train.global_batch_size, cfg.data.seed).batch(0)
            token_of = dict(zip(train_idx, tokens))
            lengths = [token_of[i] for i in first]
        except ValueError as err:
            problems.append(f"data: {err}")

    hardware = None
    if cfg.parallel.hardware == "auto":  # measured by the run itself; a dry run prices the usual target
        hardware = Hardware.load("h100")
        echo(
            "parallel.hardware=auto: priced with the h100 profile (the run measures its device, then learns)"
        )
    cost_model = build_cost_model(cfg, model.config, hardware)
    try:
        gpu = cost_model.hw.memory_bytes if cfg.parallel.memory_gb is None else cfg.parallel.memory_gb * GB
        tokens = rank_tokens(cfg, world_size, largest)
        mode, mem = memory_estimate(cfg, model, world_size, gpu, tokens)
        if not echo_memory(cfg, mode, mem, echo, tokens):
            problems.append(f"memory: {_gb(mem['total'])} GB per GPU does not fit; {_what_is_missing(cfg)}")
    except ValueError as err:
        mode = "none"
        problems.append(f"parallel.fsdp: {err}")

    if cfg.parallel.pp_size > 1:
        try:
            echo_pipeline(cfg, cost_model, world_size, lengths, echo)
        except ValueError as err:
            problems.append(f"pipeline: {err}")
    elif cfg.parallel.mode != "none":
        if lengths is None:
            echo("first step's plan: skipped (needs the data)")
        else:
            try:
                plan = make_plan_fn(cfg, cost_model, world_size, mode if mode in FSDP_MODES else "none")(
                    lengths
                )
                hist = ", ".join(f"CP{c} x{n}" for c, n in sorted(plan.cp_histogram().items()))
                echo(
                    f"first step's plan: {len(plan.micro_batches)} micro-batches ({hist}), "
                    f"predicted {plan.predicted_step_s * 1e3:.1f} ms, planned in {plan.solver_ms:.1f} ms"
                )
                for ranks, ids in plan.micro_batches:
                    echo(f"  ranks {list(ranks)}: clips {list(ids)}, {sum(lengths[i] for i in ids):,} tokens")
            except ValueError as err:
                problems.append(f"plan: {err}")

    if problems:
        echo(f"{len(problems)} problem(s):")
        for p in problems:
            echo(f"  - {p}")
        return 1
    echo("no problems found")
    return 0
