"""The plan data type shared by the planner, the baselines, the simulator and the runtime.

A plan is an ordered list of micro-batches ``(ranks, sample_ids)``. Each rank runs the micro-batches
that name it, in list order; a micro-batch starts when all of its ranks are free (its collectives
block until then, so no barrier is needed). ``barriers_after`` lists micro-batch indices after which
every rank waits for every other one: only Megatron's scheduler needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamic_cp.planning.groups_layout import allowed_groups

MicroBatch = tuple[tuple[int, ...], list[int]]


@dataclass
class Plan:
    """Output of a planner. ``predicted_step_s`` is the simulator's critical path under the cost model."""

    micro_batches: list[MicroBatch]
    world_size: int
    cap_tokens: float
    barriers_after: tuple[int, ...] = ()
    predicted_step_s: float = float("nan")
    solver_ms: float = float("nan")
    info: dict = field(default_factory=dict)
    # FSDP per_layer only: lockstep rounds (see rounds.py), each a list of micro-batch indices with
    # pairwise disjoint rank sets; every rank joins every round, idle ranks with an empty micro-batch.
    rounds: list[list[int]] | None = None
    # weight-sharding mode the plan was made for: 'none', 'per_step' or 'per_layer' (rounds set)
    fsdp: str = "none"
    # pipeline stages under 1F1B: stage p runs pp_warmup x (pp - p - 1) forwards before its first
    # backward (``pipeline_schedule.stage_ops``); 1 is plain 1F1B, more only where the plan's
    # micro-batches are small enough to keep 1F1B's memory (``pipeline_order``)
    pp_warmup: int = 1

    def per_rank(self) -> list[list[int]]:
        """rank -> indices into ``micro_batches`` in execution order."""
        out: list[list[int]] = [[] for _ in range(self.world_size)]
        for i, (ranks, _) in enumerate(self.micro_batches):
            for r in ranks:
                out[r].append(i)
        return out

    def rank_micro_batches(self, rank: int) -> list[MicroBatch]:
        """The micro-batches ``rank`` runs, in order: what the runtime iterates over."""
        return [self.micro_batches[i] for i in self.per_rank()[rank]]

    def cp_histogram(self) -> dict[int, int]:
        """CP size -> number of micro-batches using it."""
        hist: dict[int, int] = {}
        for ranks, _ in self.micro_batches:
            hist[len(ranks)] = hist.get(len(ranks), 0) + 1
        return dict(sorted(hist.items()))


def plan_violations(
    plan: Plan, lengths, cap_tokens: float, cp_sizes=None, check_groups: bool = True
) -> list[str]:
    """Every broken invariant of a plan, as readable strings (empty when the plan is valid)."""
    errors = []
    seen: dict[int, int] = {}
    groups = set(allowed_groups(plan.world_size, cp_sizes)) if check_groups else None
    for i, (ranks, ids) in enumerate(plan.micro_batches):
        if not ids:
            errors.append(f"micro-batch {i} is empty")
        if len(set(ranks)) != len(ranks) or not ranks:
            errors.append(f"micro-batch {i} has ranks {ranks}")
        if any(r < 0 or r >= plan.world_size for r in ranks):
            errors.append(f"micro-batch {i} names a rank outside 0..{plan.world_size - 1}")
        if groups is not None and tuple(ranks) not in groups:
            errors.append(f"micro-batch {i} uses group {ranks}, which is not an allowed group")
        tokens = sum(lengths[s] for s in ids)
        if tokens > cap_tokens * len(ranks) + 1e-9:
            errors.append(
                f"micro-batch {i}: {tokens} tokens over {len(ranks)} ranks exceeds cap {cap_tokens}"
            )
        for s in ids:
            seen[s] = seen.get(s, 0) + 1
    for s in range(len(lengths)):
        if seen.get(s, 0) != 1:
            errors.append(f"sample {s} appears {seen.get(s, 0)} times")
    extra = set(seen) - set(range(len(lengths)))
    if extra:
        errors.append(f"unknown sample ids {sorted(extra)[:5]}")
    return errors
