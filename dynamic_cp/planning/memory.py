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

Activations come on top: ``activation_bytes_per_token`` per token a rank holds. Only
``memory_fraction`` of HBM is planned for (allocator, NCCL buffers, workspace), as ``token_cap`` does.
An fp32 EMA adds 4P (none) or 4P/W (sharded: EMA works on shards).

Two experts (Wan2.2 A14B, ``model.expert: both``): one runs at a time (micro-batches are routed by
timestep and per_step gathers one expert at a time), so the running expert costs the table above and
the idle one its states at rest: ``idle_expert='sharded'`` keeps them on the GPU, 4P + 4P + moments
(+ 4P EMA) replicated, 16P/W (+ 4P/W) sharded, 2P + 16A (+ 4A) for a LoRA's frozen base and adapters;
``'cpu'`` moves them to host memory (``host``), leaving the GPU one expert's states and the idle
one's EMA (which checkpoints and samples read whole, ``dit/expert_offload.py``); under LoRA only the
frozen base moves, the adapters and their moments (16A) staying on the GPU. ``'cpu'`` moves
replicated states (modes none and lora, ``dit/expert_offload.py``); a sharded mode keeps the idle
expert sharded on the GPU, so ``auto`` with ``'cpu'`` tries none alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamic_cp.planning.model_dims import MODELS, ModelDims

BYTES_BF16 = 2
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
    offloaded: float = 0.0  # model.offload: the offloaded blocks' frozen base in pinned host memory
    host_activations_per_token: float = 0.0  # blocks+activations: checkpointed inputs on the host

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

    @property
    def host_offload(self) -> float:
        """Pinned host bytes of ``model.offload``: the blocks' base, and the checkpointed inputs."""
        return self.offloaded + self.host_activations_per_token * self.tokens

    def rows(self) -> list[tuple[str, float]]:
        """(part, bytes) rows; the idle expert's only for two experts (model.expert=both)."""
        idle = [("idle expert at rest", self.idle_expert)] if self.idle_expert else []
        host = [("host: idle expert offloaded", self.host)] if self.host else []
        if self.offloaded or self.host_activations_per_token:
            host.append(("host: offloaded blocks and inputs", self.host_offload))
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


def activation_bytes_per_token(dims: ModelDims, activation_checkpointing: bool = False) -> float:
    """Bytes of saved activations per token for the whole network (bf16).

    A DiT block keeps about 16 d + 2 f values per token (norms, q/k/v, attention output,
    cross-attention, FFN input and hidden before/after the activation, modulations). With full
    checkpointing only each block's input survives, plus one block being recomputed.
    """
    d, f, layers = dims.d, dims.ffn, dims.layers
    block = (16 * d + 2 * f) * BYTES_BF16
    if activation_checkpointing:
        return layers * d * BYTES_BF16 + block
    return layers * block


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
    *,
    moment_bytes: int = 8,
    base_bytes: int = 2,
    offload_blocks: int = 0,
    offload_activations: bool = False,
) -> MemoryBreakdown:
    """Bytes per GPU of ``mode`` (see the module docstring) with ``tokens`` tokens of activations.

    ``grad_accum_bytes``: per_step's unsharded gradient accumulator, 4 (fp32 reduce_dtype, what FSDP2
    does) or 2 (bf16 reduction). ``lora_rank`` applies to mode 'lora' only. ``experts`` 2: Wan2.2
    A14B's two experts of ``model`` each, the idle one kept as ``idle_expert`` ('sharded' or 'cpu').
    ``moment_bytes``: AdamW's two moments per trained parameter, 8 (fp32) or 2 (adamw_8bit).
    Mode 'lora' only (``model.base_dtype``, ``model.offload``): ``base_bytes`` a frozen base weight
    (4 fp32, 2 bf16, 1 fp8); ``offload_blocks`` of the blocks' bases in host memory, of which two
    (the running one and the prefetched one) are on the GPU at a time; ``offload_activations``: the
    checkpointed block inputs on the host too, the GPU keeping one block's recompute working set.
    """
    from dataclasses import replace

    if experts not in (1, 2):
        raise ValueError(f"experts={experts}; use 1 or 2 (Wan2.2 A14B's model.expert=both)")
    if idle_expert not in ("sharded", "cpu"):
        raise ValueError(f"idle_expert={idle_expert!r}; use 'sharded' or 'cpu'")
    if experts == 2 and idle_expert == "cpu" and mode not in ("none", "lora"):
        raise ValueError(
            f"idle_expert='cpu' moves replicated states to the host; under {mode} the idle expert stays "
            "sharded on the GPU: use idle_expert='sharded' (model.idle_expert), or mode none"
        )
    one = _one_model(model, mode, world_size, tokens, activation_checkpointing, grad_accum_bytes,
                     shard_optimizer, ema, lora_rank, moment_bytes)  # fmt: skip
    if mode == "lora":
        one = _lora_placement(one, resolve_dims(model), base_bytes, offload_blocks, offload_activations)
    elif (base_bytes, offload_blocks, offload_activations) != (2, 0, False):
        raise ValueError(f"base_bytes and offload price a LoRA's frozen base: mode 'lora', not {mode!r}")
    if experts == 1:
        return one
    dims = resolve_dims(model)
    P, W = float(dims.num_params), world_size
    # (what moves to the host under idle_expert='cpu', what stays on the GPU): the EMA stays (saves
    # and samples read it whole), and under LoRA the adapters with their moments stay too
    if mode == "lora":  # each expert offloads its own blocks: the idle one's are on the host already
        A = float(lora_params(dims, lora_rank))
        one = replace(one, offloaded=2 * one.offloaded)
        moves, stays = (
            base_bytes * (P - block_params(dims) * offload_blocks),
            16 * A + (4 * A if ema else 0.0),
        )
    elif mode == "none":
        moves, stays = 4 * P + 4 * P + (8 * P / W if shard_optimizer else 8 * P), 4 * P if ema else 0.0
    else:
        moves, stays = 16 * P / W, 4 * P / W if ema else 0.0
    if idle_expert == "cpu":
        return replace(one, host=moves, idle_expert=stays)
    return replace(one, idle_expert=moves + stays)


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
    moment_bytes,
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
    if moment_bytes not in (2, 8):
        raise ValueError(f"moment_bytes={moment_bytes}; use 8 (fp32 AdamW) or 2 (adamw_8bit)")
    P, W, L = float(dims.num_params), world_size, dims.layers
    act = activation_bytes_per_token(dims, activation_checkpointing)
    if mode == "none":
        moments = moment_bytes * P / (W if shard_optimizer else 1)
        return MemoryBreakdown(mode, 4 * P, 4 * P, moments, 2 * P, 4 * P if ema else 0.0, act, tokens)
    if mode == "per_step":
        grads = 4 * P / W + grad_accum_bytes * P
        return MemoryBreakdown(
            mode, 4 * P / W, grads, moment_bytes * P / W, 2 * P, 4 * P / W if ema else 0.0, act, tokens
        )
    if mode == "per_layer":
        grads = 4 * P / W + (2 + 4) * P / L
        gathered = 2 * 2 * P / L
        return MemoryBreakdown(
            mode, 4 * P / W, grads, moment_bytes * P / W, gathered, 4 * P / W if ema else 0.0, act, tokens
        )
    if lora_rank < 1:
        raise ValueError(f"lora_rank={lora_rank} must be at least 1")
    A = float(lora_params(dims, lora_rank))
    # frozen base in bf16 (no master, grads or moments); adapters train like a small full model
    return MemoryBreakdown(
        mode, 4 * A, 4 * A, moment_bytes * A, 2 * P + 2 * A, 4 * A if ema else 0.0, act, tokens
    )


def block_params(dims: ModelDims) -> float:
    """Parameters of one transformer block: num_params less the patch embedding and head, over the layers."""
    return (dims.num_params - dims.patch_values * dims.d) / dims.layers


def _lora_placement(
    one: MemoryBreakdown, dims: ModelDims, base_bytes: int, offload_blocks: int, offload_activations: bool
) -> MemoryBreakdown:
    """Mode 'lora' with its base at ``base_bytes`` a weight and ``offload_blocks`` blocks on the host.

    A block's base is its share of the block parameters (num_params less the patch embedding and
    head, over the layers); the GPU holds the blocks that stay plus two offloaded ones in flight."""
    from dataclasses import replace

    if base_bytes not in (1, 2, 4):
        raise ValueError(f"base_bytes={base_bytes}; use 1 (fp8), 2 (bf16) or 4 (fp32)")
    L = dims.layers
    if not 0 <= offload_blocks <= L:
        raise ValueError(f"offload_blocks={offload_blocks}: the model has {L} blocks; use 0 to {L}")
    per_block = block_params(dims)
    on_gpu_blocks = L - offload_blocks + min(offload_blocks, 2)
    adapters_bf16 = one.compute_weights - 2 * dims.num_params  # the adapters' bf16 copies, 2A
    base_gpu = base_bytes * (dims.num_params - per_block * (L - on_gpu_blocks))
    act, host_act = one.activations_per_token, 0.0
    if offload_activations:
        block = (16 * dims.d + 2 * dims.ffn) * BYTES_BF16  # the recompute's working set stays
        host_act, act = act - block, block
    return replace(
        one,
        compute_weights=base_gpu + adapters_bf16,
        offloaded=base_bytes * per_block * offload_blocks,
        activations_per_token=act,
        host_activations_per_token=host_act,
    )


def fewest_offload_blocks(memory_bytes: float, memory_fraction: float, breakdown_for) -> int | None:
    """``model.offload_blocks: auto``: the fewest blocks to offload for the run to fit, or None when
    even all of them are not enough. ``breakdown_for(n)`` is the run's ``MemoryBreakdown`` with n."""
    n = 0
    while True:
        try:
            mem = breakdown_for(n)
        except ValueError:  # past the block count
            return None
        if mem.total <= memory_bytes * memory_fraction:
            return n
        n += 1


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
    sharded and only none is tried; so too with two experts and ``idle_expert='cpu'``. The cap
    returned is ``token_cap`` when given, else the most the mode leaves; bytes are for that cap.
    """
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes={memory_bytes} must be positive")
    if token_cap is not None and token_cap < 1:
        raise ValueError(f"token_cap={token_cap} must be at least 1 token per rank (or None)")
    need = 1 if token_cap is None else token_cap
    tried = []
    on_host = experts == 2 and idle_expert == "cpu"  # replicated weights only (the module docstring)
    for mode in FSDP_MODES if world_size > 1 and not on_host else ("none",):
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
        + (" (model.idle_expert=sharded lets auto shard the weights)" if on_host and world_size > 1 else "")
    )


def planning_token_cap(
    dims: ModelDims,
    memory_bytes: float,
    shard_world: int = 1,
    activation_checkpointing: bool = False,
    memory_fraction: float = 0.9,
) -> int:
    """The planners' and the simulator's default cap: most tokens one rank holds in a micro-batch.

    It prices ZeRO-3 at its leanest, the setting the scheduler comparisons hold fixed: bf16 weights
    whole (2P) plus 14 bytes a parameter (fp32 master 4, Adam 8, bf16 gradients 2) sharded over
    ``shard_world`` ranks. A training run caps by its own mode instead (``mode_token_cap``).
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
    if shard_world < 1:
        raise ValueError(f"shard_world={shard_world} must be at least 1")
    p = dims.num_params
    states = 2 * p + 14 * p / shard_world
    free = memory_bytes * memory_fraction - states
    cap = int(free // activation_bytes_per_token(dims, activation_checkpointing))
    if cap < 1:
        raise ValueError(
            f"model states ({states / 1e9:.1f} GB) do not fit in {memory_bytes / 1e9:.0f} GB; "
            "shard them over more ranks (shard_world) or use a larger GPU profile"
        )
    return cap


# ---------------------------------------------------------------- sampling: forward passes only
def weight_bytes(
    dims: ModelDims,
    shards: int = 1,
    value_bytes: int = BYTES_BF16,
    base_bytes: int | None = None,
    offload_blocks: int = 0,
    in_flight: int = 2,
) -> float:
    """DiT weights one rank holds while sampling, ``value_bytes`` a parameter (2: bf16, 4: fp32): all of
    them replicated (``shards`` 1), else its 1/``shards`` of them plus two gathered blocks (the one
    running and the one FSDP prefetches), never more than all of them (a model of one or two blocks).
    Replicated only, sample.py's ``--base-dtype`` and ``--offload``: the blocks at ``base_bytes`` a
    weight (1: fp8; None: ``value_bytes``), ``offload_blocks`` of them on the host, ``in_flight`` of
    which are on the device at a time: two while the model runs (the running one and the prefetched
    one, as training's ``_lora_placement``), none while it waits (an idle expert)."""
    total = value_bytes * dims.num_params
    if base_bytes is not None or offload_blocks:
        if shards > 1:
            raise ValueError("weight_bytes: fp8 blocks and offload price replicated weights (shards=1)")
        per_block = block_params(dims)
        on_device = dims.layers - offload_blocks + min(offload_blocks, in_flight)
        blocks = (value_bytes if base_bytes is None else base_bytes) * per_block * on_device
        return total - value_bytes * per_block * dims.layers + blocks
    if shards <= 1:
        return total
    return min(total, total / shards + 2 * total / dims.layers)


def sampling_token_cap(
    dims: ModelDims,
    memory_bytes: float,
    memory_fraction: float = 0.9,
    shards: int = 1,
    value_bytes: int = BYTES_BF16,
    resident_bytes: float = 0.0,
    base_bytes: int | None = None,
    offload_blocks: int = 0,
) -> int:
    """Tokens one rank can hold in a sampling forward: the weights (``weight_bytes``: replicated, or
    FSDP-sharded over ``shards`` ranks), ``resident_bytes`` of other models every rank keeps (the text
    encoder, the VAE), and the working set of one block per token (nothing is kept for a backward), in
    the compute dtype of ``value_bytes`` (2: bf16, 4: fp32); ``base_bytes`` and ``offload_blocks``: as
    ``weight_bytes``."""
    weights = weight_bytes(dims, shards, value_bytes, base_bytes, offload_blocks)
    free = memory_bytes * memory_fraction - weights - resident_bytes
    per_token = (16 * dims.d + 2 * dims.ffn) * value_bytes
    if free < per_token:
        plain_replicated = shards <= 1 and base_bytes is None and not offload_blocks
        how = "shard them with --fsdp per_layer, or use" if shards <= 1 else "sample on more ranks or"
        dtype = {2: "bf16", 4: "fp32"}.get(value_bytes, f"{value_bytes}-byte")
        beside = f" next to {resident_bytes / 1e9:.1f} GB of text encoder and VAE" if resident_bytes else ""
        raise ValueError(
            f"the model's {dtype} weights ({weights / 1e9:.1f} GB a rank"
            f"{'' if shards <= 1 else f', sharded over {shards}'}){beside} do not fit in "
            f"{memory_bytes / 1e9:.0f} GB per rank; {how} larger GPUs"
            + (" (or --precision bf16)" if value_bytes > BYTES_BF16 else "")
            + ("; on one process, --base-dtype fp8_scaled --offload blocks" if plain_replicated else "")
        )
    return int(free // per_token)
