"""Memory of one pipeline stage: its share of the weights and the activations of the micro-batches
it holds in flight, at the planning convention of ``memory.planning_token_cap``."""

from __future__ import annotations

from dataclasses import replace

from dynamic_cp.planning.memory import activation_bytes_per_token, block_params
from dynamic_cp.planning.model_dims import ModelDims


def stage_params(dims: ModelDims, layers_per_stage: list[int], stage: int) -> float:
    """Parameters stage ``stage`` holds: its blocks, plus the patch embedding (first stage) and the
    output projection (last), half of ``patch_values * d`` each."""
    per_block = block_params(dims)
    ends = (stage == 0) + (stage == len(layers_per_stage) - 1)
    return per_block * layers_per_stage[stage] + dims.patch_values * dims.d * ends / 2


def stage_memory(
    dims: ModelDims, layers_per_stage: list[int], stage: int, shard_world: int, ckpt: bool = False
) -> tuple[float, float]:
    """(states, activation bytes per token held) of one pipeline stage at the planning convention
    (``planning_token_cap``: 2P + 14P / shard_world, P the stage's parameters), activations for the
    stage's blocks only."""
    P = stage_params(dims, layers_per_stage, stage)
    act = activation_bytes_per_token(replace(dims, layers=layers_per_stage[stage]), ckpt)
    return 2 * P + 14 * P / shard_world, act


def pipeline_token_cap(
    dims: ModelDims,
    memory_bytes: float,
    layers_per_stage: list[int],
    shard_world: int,
    ckpt: bool = False,
    memory_fraction: float = 0.9,
) -> int:
    """Most tokens a rank's micro-batch may hold under 1F1B, where stage p holds at most pp - p
    micro-batches' activations (``pipeline_schedule``): the tightest stage decides."""
    pp, caps = len(layers_per_stage), []
    for p in range(pp):
        states, act = stage_memory(dims, layers_per_stage, p, shard_world, ckpt)
        caps.append(int((memory_bytes * memory_fraction - states) // ((pp - p) * act)))
    if min(caps) < 1:
        raise ValueError(
            f"a pipeline stage's states do not fit in {memory_bytes / 1e9:.0f} GB with {pp - caps.index(min(caps))} "
            "micro-batches in flight; use more stages (parallel.pp_size), more ranks or checkpointing"
        )
    return min(caps)
