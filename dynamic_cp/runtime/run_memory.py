"""A training config priced by the memory model: the one bridge from ``Config`` to ``planning/memory.py``.

``--dry-run``, ``parallel.fsdp: auto`` and ``model.offload_blocks: auto`` all ask ``run_breakdown``,
so what the dry run prints is what the run decides by.
"""

from __future__ import annotations

from dynamic_cp.planning.memory import MemoryBreakdown, fewest_offload_blocks, memory_breakdown
from dynamic_cp.planning.model_dims import ModelDims

BASE_BYTES = {"fp8_e4m3": 1, "fp8_scaled": 1, "bf16": 2, "fp32": 4}  # model.base_dtype -> bytes
MEMORY_FRACTION = 0.9  # what a plan may fill: the allocator, NCCL buffers and workspace take the rest


def base_bytes_of(cfg) -> int:
    """Bytes a frozen LoRA base weight takes: ``model.base_dtype``, auto being bf16 (the GPU's compute)."""
    return BASE_BYTES.get(cfg.model.base_dtype, 2)


def run_breakdown(
    cfg, world_size: int, mode: str, dims: ModelDims, tokens: float, offload_blocks: int | None = None
) -> MemoryBreakdown:
    """Bytes per GPU of ``cfg`` under fsdp ``mode`` with ``tokens`` tokens a rank; a LoRA run is
    priced as mode 'lora' (a replicated frozen base). ``offload_blocks`` replaces an ``auto`` count."""
    t, m = cfg.train, cfg.model
    common = dict(
        ema=t.ema_decay > 0,
        experts=2 if m.expert == "both" else 1,
        idle_expert=m.idle_expert,
        moment_bytes=2 if t.optimizer == "adamw_8bit" else 8,
    )
    shard = cfg.parallel.mode != "none" and cfg.parallel.shard_optimizer and world_size > 1
    ckpt = m.gradient_checkpointing
    if m.lora is None:
        return memory_breakdown(dims, mode, world_size, tokens, ckpt, shard_optimizer=shard, **common)
    count = 0
    if m.offload != "none":
        count = offload_blocks if offload_blocks is not None else m.offload_blocks
        if count == "auto":
            raise ValueError("run_breakdown: resolve model.offload_blocks=auto first (offload_count)")
    return memory_breakdown(
        dims, "lora", world_size, tokens, ckpt, lora_rank=m.lora.rank, base_bytes=base_bytes_of(cfg),
        offload_blocks=count, offload_activations=m.offload == "blocks+activations", **common,
    )  # fmt: skip


def offload_count(cfg, world_size: int, dims: ModelDims, tokens: float, memory_bytes: float | None) -> int:
    """``model.offload_blocks`` as a number: as given, or (auto) the fewest blocks whose offload makes
    the run fit ``memory_bytes`` (all of them when nothing fits or the memory is unknown)."""
    m = cfg.model
    if m.offload == "none":
        return 0
    if m.offload_blocks != "auto":
        if m.offload_blocks > dims.layers:
            raise ValueError(
                f"model.offload_blocks={m.offload_blocks}: the model has {dims.layers} blocks; use 0 to "
                f"{dims.layers} or auto"
            )
        return m.offload_blocks
    if memory_bytes is None:
        return dims.layers
    fewest = fewest_offload_blocks(
        memory_bytes, MEMORY_FRACTION, lambda n: run_breakdown(cfg, world_size, "none", dims, tokens, n)
    )
    return dims.layers if fewest is None else fewest
