"""Pipeline stages: which blocks each stage holds, and which ranks each stage is.

The world is ``pp_size`` x R ranks, stage-major: stage p is ranks p*R .. p*R + R - 1, and rank r of
stage p mirrors rank r of stage 0, so one Dynamic-CP plan over R ranks serves every stage (the CP
group ``(0, 1)`` of the plan is ranks ``(p*R, p*R + 1)`` on stage p). Pure Python: the runtime and
the simulator both read these.
"""

from __future__ import annotations


def check_pipeline(world_size: int, pp_size: int, num_layers: int) -> None:
    """Raise a ValueError naming the fix when ``pp_size`` stages can't be laid on this world and model."""
    if pp_size < 1:
        raise ValueError(f"parallel.pp_size={pp_size} must be >= 1")
    if world_size % pp_size:
        raise ValueError(
            f"parallel.pp_size={pp_size} does not divide the world of {world_size} ranks; launch "
            f"a multiple of {pp_size} ranks or pick a pp_size that divides {world_size}"
        )
    if pp_size > num_layers:
        raise ValueError(
            f"parallel.pp_size={pp_size} is more stages than the model's {num_layers} blocks; "
            f"use pp_size <= {num_layers}"
        )


def stage_ranks(world_size: int, pp_size: int, stage: int) -> list[int]:
    """The global ranks of ``stage``, in the order of the plan's ranks 0 .. R-1."""
    per_stage = world_size // pp_size
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def stage_layers(
    num_layers: int, pp_size: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Blocks per stage, contiguous, minimising the slowest stage's cost.

    Every block costs 1; the first stage also carries ``first_extra`` (patch and text embedders, in
    block units) and the last ``last_extra`` (the head). Tries every bound on the slowest stage in
    increasing order and fills stages greedily, so the answer is the least bottleneck partition.
    """
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"{pp_size} stages need between 1 and {num_layers} blocks each side")
    extras = [0.0] * pp_size
    extras[0] += first_extra
    extras[-1] += last_extra
    candidates = sorted({k + e for k in range(1, num_layers + 1) for e in set(extras)})
    for bound in candidates:
        split = _fill(num_layers, extras, bound)
        if split is not None:
            return split
    raise AssertionError("unreachable: the largest bound always fits")  # pragma: no cover


def _fill(num_layers: int, extras: list[float], bound: float) -> list[int] | None:
    """Greedy stage sizes under ``bound`` (each stage >= 1 block), or None when they don't fit."""
    split, left = [], num_layers
    for p, extra in enumerate(extras):
        stages_after = len(extras) - p - 1
        take = min(int(bound - extra + 1e-9), left - stages_after)
        if take < 1:
            return None
        split.append(take)
        left -= take
    return split if left == 0 else None


def layer_ranges(layers_per_stage: list[int]) -> list[range]:
    """Stage p's block indices, from the per-stage counts: ``[2, 3] -> [range(0, 2), range(2, 5)]``."""
    out, start = [], 0
    for n in layers_per_stage:
        out.append(range(start, start + n))
        start += n
    return out
