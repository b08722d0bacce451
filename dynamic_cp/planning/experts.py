"""Plans for ``model.expert: both`` (Wan2.2 A14B's two experts in one run): no micro-batch mixes them.

Each clip of the global batch has its expert before planning (``dit.flow.draw_expert``, from seed,
step and dataset index: the same on every rank). The planner runs once per expert on that expert's
clips, and the plans are concatenated, high first; ``plan.info["experts"]`` names the expert of each
micro-batch, which the runtime uses (FSDP gathers and reduce-scatters only the experts that run, in
this order on every rank). The predicted step is the sum of the two plans' critical paths: an upper
bound (under replicated weights a rank may start its low micro-batches before another rank ends its
high ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dynamic_cp.planning.plan_types import Plan

EXPERT_ORDER = ("high", "low")


def plan_per_expert(
    plan_fn: Callable[[list[int]], Plan], lengths: Sequence[int], experts: Sequence[str]
) -> Plan:
    """``plan_fn`` on each expert's clips, joined into one plan of the whole batch (sample ids are
    batch positions again); ``info["experts"]`` gives each micro-batch's expert."""
    if len(experts) != len(lengths):
        raise ValueError(f"{len(experts)} experts for {len(lengths)} clips")
    parts = []
    for name in EXPERT_ORDER:
        ids = [i for i, e in enumerate(experts) if e == name]
        if ids:
            parts.append((name, ids, plan_fn([lengths[i] for i in ids])))
    if not parts:  # an empty batch: the planner's own empty plan
        empty = plan_fn([])
        empty.info["experts"] = []
        return empty
    first = parts[0][2]
    joined = Plan(
        [], first.world_size, first.cap_tokens, predicted_step_s=0.0, solver_ms=0.0, fsdp=first.fsdp
    )
    joined.info = {"experts": []}
    rounds: list[list[int]] | None = [] if all(p.rounds is not None for _, _, p in parts) else None
    for name, ids, part in parts:
        offset = len(joined.micro_batches)
        joined.micro_batches += [(ranks, [ids[s] for s in sub]) for ranks, sub in part.micro_batches]
        joined.info["experts"] += [name] * len(part.micro_batches)
        joined.predicted_step_s += part.predicted_step_s
        joined.solver_ms += part.solver_ms
        if rounds is not None:
            rounds += [[offset + m for m in r] for r in part.rounds]
        for key, value in part.info.items():  # per-micro-batch lists are joined, the rest kept from the first
            if isinstance(value, list) and len(value) == len(part.micro_batches):
                joined.info.setdefault(key, []).extend(value)
            else:
                joined.info.setdefault(key, value)
    joined.rounds = rounds
    return joined
