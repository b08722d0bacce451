"""Static context parallelism: the baseline every Dynamic-CP claim is measured against.

Static CP picks one CP size for the whole step, the smallest allowed size that fits the longest clip,
and runs W / c data-parallel groups of that size (aligned blocks). Two variants:

    round-robin  clip i goes to group i mod G, then each group packs its clips first-fit (in order)
                 into micro-batches of at most cap * c tokens: what a plain sharded loader does
    balanced     clips sorted by predicted time, longest first onto the least-loaded group (LPT),
                 then first-fit-decreasing packing: static CP with the best cheap balancing
"""

from __future__ import annotations

import heapq
import time

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import blocks_of_size, normalize_cp_sizes
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.planner import check_lengths, min_cp_index
from dynamic_cp.planning.simulator import simulate


def _first_fit(ids, L, capacity):
    bins, room = [], []
    for i in ids:
        for b, free in enumerate(room):
            if L[i] <= free:
                bins[b].append(i)
                room[b] -= L[i]
                break
        else:
            bins.append([i])
            room.append(capacity - L[i])
    return bins


def static_plan(
    lengths, world_size: int, cap_tokens: float, cost_model: CostModel, cp_sizes=None, balanced: bool = False
) -> Plan:
    """Static CP plan; see the module docstring. ``balanced`` picks the LPT variant."""
    t0 = time.perf_counter()
    L = check_lengths(lengths)
    sizes = normalize_cp_sizes(world_size, cp_sizes)
    c = sizes[int(min_cp_index(L, cap_tokens, sizes).max())] if L.size else sizes[0]
    groups = blocks_of_size(world_size, c)
    per_group: list[list[int]] = [[] for _ in groups]
    if balanced:
        t = cost_model.sample_times(L, c, cap_tokens)
        heap = [(0.0, g) for g in range(len(groups))]
        for i in sorted(range(L.size), key=lambda i: (-t[i], i)):
            load, g = heapq.heappop(heap)
            per_group[g].append(i)
            heapq.heappush(heap, (load + t[i], g))
    else:
        for i in range(L.size):
            per_group[i % len(groups)].append(i)
    micro_batches = []
    for g, ids in enumerate(per_group):
        order = sorted(ids, key=lambda i: (-int(L[i]), i)) if balanced else ids
        for mb in _first_fit(order, L, cap_tokens * c):
            micro_batches.append((groups[g], mb))
    out = Plan(micro_batches, world_size, cap_tokens, info={"cp": c})
    out.predicted_step_s = simulate(out, L, cost_model).step_s
    out.solver_ms = (time.perf_counter() - t0) * 1e3
    return out
