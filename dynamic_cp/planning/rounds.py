"""Lockstep rounds: the execution order that FSDP ``per_layer`` (ZeRO-3) sharding needs.

Under per-layer sharding every layer's all-gather and reduce-scatter runs over *all* ranks, so every
rank must run the same number of forward/backward passes in the same order. A plan whose ranks run
different numbers of micro-batches would hang. Rounds fix that: in round k each rank is in exactly
one micro-batch of that round, or, when it has nothing left there, in an empty one (zero tokens;
it still joins the collectives).

``lockstep_rounds`` turns any plan into rounds without reordering any rank's work: each micro-batch
goes to the earliest round after the last round that used any of its ranks (greedy, in plan order).
A micro-batch's round is then strictly later than every earlier micro-batch that shares a rank, so
the rank sets within a round are pairwise disjoint and each rank keeps its plan order.
"""

from __future__ import annotations

import dataclasses

from dynamic_cp.planning.plan_types import Plan


def lockstep_rounds(plan: Plan, world_size: int) -> Plan:
    """A copy of ``plan`` with ``rounds`` set: a list of rounds, each a list of micro-batch indices
    (in plan order) whose rank sets are pairwise disjoint. Every micro-batch is in exactly one round
    and each rank's micro-batches appear in the same order as in the plan."""
    if world_size != plan.world_size:
        raise ValueError(
            f"world_size={world_size} but the plan was made for world_size={plan.world_size}; "
            "pass the plan's own world size"
        )
    last = [-1] * world_size  # rank -> last round it is busy in
    rounds: list[list[int]] = []
    for i, (ranks, _) in enumerate(plan.micro_batches):
        for r in ranks:
            if not 0 <= r < world_size:
                raise ValueError(f"micro-batch {i} names rank {r}, outside 0..{world_size - 1}")
        k = 1 + max((last[r] for r in ranks), default=-1)
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(i)
        for r in ranks:
            last[r] = k
    return dataclasses.replace(plan, rounds=rounds)


def round_violations(plan: Plan) -> list[str]:
    """Every broken round invariant of ``plan`` as readable strings (empty when valid)."""
    if plan.rounds is None:
        return ["plan has no rounds"]
    errors = []
    n = len(plan.micro_batches)
    seen = [0] * n
    position = {}  # micro-batch -> round
    for k, members in enumerate(plan.rounds):
        used: set[int] = set()
        for i in members:
            if not 0 <= i < n:
                errors.append(f"round {k} names micro-batch {i}, outside 0..{n - 1}")
                continue
            seen[i] += 1
            position[i] = k
            ranks = set(plan.micro_batches[i][0])
            if used & ranks:
                errors.append(f"round {k}: micro-batch {i} shares ranks {sorted(used & ranks)}")
            used |= ranks
    errors += [f"micro-batch {i} is in {c} rounds" for i, c in enumerate(seen) if c != 1]
    for r, order in enumerate(plan.per_rank()):
        ks = [position.get(i, -1) for i in order]
        if any(a >= b for a, b in zip(ks, ks[1:])):
            errors.append(f"rank {r} runs its micro-batches out of plan order: rounds {ks}")
    return errors


def rank_round_schedule(plan: Plan, rank: int) -> list[int | None]:
    """For each round, the micro-batch ``rank`` runs in it, or None for an empty one (the runtime
    still joins that round's collectives with zero tokens)."""
    if plan.rounds is None:
        raise ValueError("plan has no rounds; call lockstep_rounds(plan, world_size) first")
    out: list[int | None] = []
    for members in plan.rounds:
        mine = [i for i in members if rank in plan.micro_batches[i][0]]
        out.append(mine[0] if mine else None)
    return out
