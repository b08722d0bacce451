"""Bytes per GPU under each weight-sharding mode, the token cap each leaves, and ``auto``'s choice.

P parameters, W ranks (the sharding world), L layers; fp32 master weights, fp32 gradient reduction
and bf16 compute, as torchtitan trains (DESIGN.md "Memory at 14B"):

    mode       master  grads                            moments  compute-dtype weights
    none       4P      4P                               8P/W*    2P   (autocast's bf16 copies)
    per_step   4P/W    4P/W + an unsharded accumulator  8P/W     2P   (gathered once per step)
                       (4P fp32: FSDP2 accumulates in reduce_dtype until the step-end reduce-scatter)
    per_layer  4P/W    4P/W + one layer's unsharded     8P/W     2 layers (current + prefetched)
                       grad in flight ((2 + 4) P/L)
    lora       frozen bf16 base 2P; adapters A params with 16 bytes each + their bf16 copy

    * ``shard_optimizer`` (ZeRO-1, the runtime's default) shards the moments under ``none``; 8P otherwise.

Activations come on top: ``activation_bytes_per_token`` (cost_model.py) per token a rank holds. Only
``memory_fraction`` of HBM is planned for (allocator, NCCL buffers, workspace), as ``token_cap`` does.
An fp32 EMA adds 4P (none) or 4P/W (sharded: EMA works on shards).

Two experts (Wan2.2 A14B, ``model.expert: both``): one runs at a time (micro-batches are routed by
timestep and per_step gathers one expert at a time), so the running expert costs the table above and
the idle one its states at rest: ``idle_expert='sharded'`` keeps them on the GPU, 4P + 4P + moments
(+ 4P EMA) replicated, 16P/W (+ 4P/W) sharded, 2P + 16A (+ 4A) for a LoRA's frozen base and adapters;
``'cpu'`` moves them to host memory (``host``), leaving the GPU one expert's states.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamic_cp.planning.cost_model import MODELS, ModelDims, activation_bytes_per_token

FSDP_MODES = ("none", "per_step", "per_layer")
MEMORY_MODES = FSDP_MODES + ("lora",)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU of one mode, by part; ``activations`` is for ``tokens`` tokens per rank."""

    mode: str
    master_weights: float
    gradients: float
    optimizer: float
    compute_weights: float  # bf16 copies: all of them (none, per_step) or the gathered layers
    ema: float
    activations_per_token: float
    tokens: float = 0.0
    idle_expert: float = 0.0  # two experts: the idle one's states at rest on the GPU
    host: float = 0.0  # two experts with idle_expert='cpu': its states in host memory (not in total)

    @property
    def states(self) -> float:
        """Everything but activations."""
        running = self.master_weights + self.gradients + self.optimizer + self.compute_weights + self.ema
        return running + self.idle_expert

    @property
    def activations(self) -> float:
        return self.activations_per_token * self.tokens

    @property
    def total(self) -> float:
        return self.states + self.activations

    def rows(self) -> list[tuple[str, float]]:
        """(part, bytes) rows; the idle expert's only for two experts (model.expert=both)."""
        idle = [("idle expert at rest", self.idle_expert)] if self.idle_expert else []
        host = [("host: idle expert offloaded", self.host)] if self.host else []
        return [
            ("master weights (fp32)", self.master_weights),
            ("gradients", self.gradients),
            ("optimizer moments", self.optimizer),
            ("compute-dtype weights (bf16)", self.compute_weights),
            ("EMA (fp32)", self.ema),
            *idle,
            (f"activations ({self.tokens:,.0f} tokens)", self.activations),
            ("total", self.total),
            *host,
        ]


def resolve_dims(model: str | ModelDims) -> ModelDims:
    if isinstance(model, ModelDims):
        return model
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; use one of {sorted(MODELS)} or pass ModelDims")
    return MODELS[model]


def lora_params(dims: ModelDims, rank: int) -> int:
    """Adapter parameters for rank-``rank`` LoRA on every attention projection (self and cross:
    q, k, v, o, each d x d, so 8 adapters of d*r + r*d per block), PEFT's usual video-DiT target."""
    return dims.layers * 8 * 2 * dims.d * rank


def memory_breakdown(
    model: str | ModelDims,
    mode: str,
    world_size: int,
    tokens: float = 0.0,
    activation_checkpointing: bool = False,
    grad_accum_bytes: int = 4,
    shard_optimizer: bool = True,
    ema: bool = False,
    lora_rank: int = 16,
    experts: int = 1,
    idle_expert: str = "sharded",
) -> MemoryBreakdown:
    """Bytes per GPU of ``mode`` (see the module docstring) with ``tokens`` tokens of activations.

    ``grad_accum_bytes``: per_step's unsharded gradient accumulator, 4 (fp32 reduce_dtype, what FSDP2
    does) or 2 (bf16 reduction). ``lora_rank`` applies to mode 'lora' only. ``experts`` 2: Wan2.2
    A14B's two experts of ``model`` each, the idle one kept as ``idle_expert`` ('sharded' or 'cpu').
    """
    from dataclasses import replace

    if experts not in (1, 2):
        raise ValueError(f"experts={experts}; use 1 or 2 (Wan2.2 A14B's model.expert=both)")
    if idle_expert not in ("sharded", "cpu"):
        raise ValueError(f"idle_expert={idle_expert!r}; use 'sharded' or 'cpu'")
    one = _one_model(model, mode, world_size, tokens, activation_checkpointing, grad_accum_bytes,
                     shard_optimizer, ema, lora_rank)  # fmt: skip
    if experts == 1:
        return one
    dims = resolve_dims(model)
    P, W = float(dims.num_params), world_size
    if mode == "lora":
        A = float(lora_params(dims, lora_rank))
        rest = 2 * P + 16 * A + (4 * A if ema else 0.0)
    elif mode == "none":
        rest = 4 * P + 4 * P + (8 * P / W if shard_optimizer else 8 * P) + (4 * P if ema else 0.0)
    else:
        rest = 16 * P / W + (4 * P / W if ema else 0.0)
    if idle_expert == "cpu":
        return replace(one, host=rest)
    return replace(one, idle_expert=rest)


def _one_model(
    model,
    mode,
    world_size,
    tokens,
    activation_checkpointing,
    grad_accum_bytes,
    shard_optimizer,
    ema,
    lora_rank,
) -> MemoryBreakdown:
    dims = resolve_dims(model)
    if mode not in MEMORY_MODES:
        raise ValueError(f"fsdp mode {mode!r}; use one of {MEMORY_MODES}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if grad_accum_bytes not in (2, 4):
        raise ValueError(f"grad_accum_bytes={grad_accum_bytes}; use 4 (fp32) or 2 (bf16)")
    if tokens < 0:
        raise ValueError(f"tokens={tokens} must be non-negative")
    P, W, L = float(dims.num_params), world_size, dims.layers
    act = activation_bytes_per_token(dims, activation_checkpointing)
    if mode == "none":
        moments = 8 * P / W if shard_optimizer else 8 * P
        return MemoryBreakdown(mode, 4 * P, 4 * P, moments, 2 * P, 4 * P if ema else 0.0, act, tokens)
    if mode == "per_step":
        grads = 4 * P / W + grad_accum_bytes * P
        return MemoryBreakdown(
            mode, 4 * P / W, grads, 8 * P / W, 2 * P, 4 * P / W if ema else 0.0, act, tokens
        )
    if mode == "per_layer":
        grads = 4 * P / W + (2 + 4) * P / L
        gathered = 2 * 2 * P / L
        return MemoryBreakdown(
            mode, 4 * P / W, grads, 8 * P / W, gathered, 4 * P / W if ema else 0.0, act, tokens
        )
    if lora_rank < 1:
        raise ValueError(f"lora_rank={lora_rank} must be at least 1")
    A = float(lora_params(dims, lora_rank))
    # frozen base in bf16 (no master, grads or moments); adapters train like a small full model
    return MemoryBreakdown(mode, 4 * A, 4 * A, 8 * A, 2 * P + 2 * A, 4 * A if ema else 0.0, act, tokens)


def mode_token_cap(breakdown: MemoryBreakdown, memory_bytes: float, memory_fraction: float = 0.9) -> int:
    """Most tokens per rank that fit next to the mode's states; 0 when the states alone do not fit."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
    free = memory_bytes * memory_fraction - breakdown.states
    return max(int(free // breakdown.activations_per_token), 0)


def choose_fsdp_mode(
    model: str | ModelDims,
    world_size: int,
    token_cap: float | None,
    memory_bytes: float,
    gradient_checkpointing: bool,
    *,
    memory_fraction: float = 0.9,
    grad_accum_bytes: int = 4,
    shard_optimizer: bool = True,
    ema: bool = False,
    experts: int = 1,
    idle_expert: str = "sharded",
) -> tuple[str, float, int]:
    """``parallel.fsdp: auto``: (mode, bytes per GPU expected, token cap per rank).

    The fastest mode that fits ``token_cap`` tokens per rank (None: at least one token) in
    ``memory_fraction`` of ``memory_bytes``. Fastest first: none and per_step move about the same
    bytes per step (an fp32 all-reduce, 8P, against a bf16 gather and an fp32 reduce-scatter, 6P)
    but none needs no sharding bookkeeping, so none, then per_step; per_layer gathers and
    reduce-scatters every layer in every lockstep round, so it comes last. With W = 1 nothing can be
    sharded and only none is tried. The cap returned is ``token_cap`` when given, else the most the
    mode leaves; bytes are for that cap.
    """
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes={memory_bytes} must be positive")
    if token_cap is not None and token_cap < 1:
        raise ValueError(f"token_cap={token_cap} must be at least 1 token per rank (or None)")
    need = 1 if token_cap is None else token_cap
    tried = []
    for mode in FSDP_MODES if world_size > 1 else ("none",):
        mem = memory_breakdown(
            model,
            mode,
            world_size,
            0.0,
            gradient_checkpointing,
            grad_accum_bytes=grad_accum_bytes,
            shard_optimizer=shard_optimizer,
            ema=ema,
            experts=experts,
            idle_expert=idle_expert,
        )
        cap = mode_token_cap(mem, memory_bytes, memory_fraction)
        tried.append(f"{mode}: {mem.states / 1e9:.1f} GB of states, cap {cap:,} tokens")
        if cap >= need:
            use = int(need) if token_cap is not None else cap
            return mode, mem.states + use * mem.activations_per_token, use
    raise ValueError(
        f"no fsdp mode fits {need:,.0f} tokens per rank in {memory_fraction:.0%} of "
        f"{memory_bytes / 1e9:.0f} GB on {world_size} ranks ({'; '.join(tried)}); lower "
        "train.micro_batch_tokens / parallel.cap_tokens, turn on model.gradient_checkpointing, or use more GPUs"
    )
