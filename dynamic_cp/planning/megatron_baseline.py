"""Megatron Core's ``BalancedCPScheduler`` (megatron-core 0.16.1), run as shipped, as a Plan.

We call ``get_groups_and_subsamples`` exactly as Megatron's hybrid-CP data path does: the sample
list sorted by nothing in particular (it sorts internally, longest first), ``max_seq_len_per_rank``
equal to our per-rank token cap, and a stand-in for the DPxCP process group (the scheduler only calls
``.size()`` on it). Its output is a list of *groups*; in each, every GPU holds an ordered list of
sample ids, and a sample's CP group is the set of GPUs that list it.

Conversion keeps Megatron's execution model (``hybrid_context_parallel_forward_backward``): one
micro-batch per sub-sample (no packing), the GPUs' own order within a group, and a barrier over all
ranks after every group. Its rank sets are whatever it picked (contiguous free ranks, not always
aligned blocks); the simulator prices them by the ranks they really span.
"""

from __future__ import annotations

import time
import warnings

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.planner import check_lengths
from dynamic_cp.planning.simulator import simulate


class _FakeGroup:
    def __init__(self, n: int):
        self._n = n

    def size(self) -> int:
        return self._n


def _scheduler_class():
    # Imported lazily: megatron-core takes seconds to import and only this baseline needs it. Its
    # import warns that Transformer Engine and Apex are missing; the scheduler needs neither, so
    # those warnings would only bury the comparison the user asked for.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    return BalancedCPScheduler


def megatron_schedule(lengths, world_size: int, cap_tokens: float):
    """Raw ``(groups, sample_id_groups)`` from Megatron's scheduler."""
    BalancedCPScheduler = _scheduler_class()
    sched = BalancedCPScheduler(max_seq_len_per_rank=int(cap_tokens), dp_cp_group=_FakeGroup(world_size))
    pairs = [(i, int(x)) for i, x in enumerate(lengths)]
    return sched.get_groups_and_subsamples(pairs, config=None)


def _group_order(per_gpu: list[list[int]]) -> list[tuple[tuple[int, ...], list[int]]]:
    """Order one Megatron group's sub-samples so every GPU sees its own list order (a topological
    merge: take a sample when it heads the queue of every GPU that holds it)."""
    owners: dict[int, list[int]] = {}
    for r, ids in enumerate(per_gpu):
        for s in ids:
            owners.setdefault(s, []).append(r)
    heads = [0] * len(per_gpu)
    out = []
    remaining = sum(len(ids) for ids in per_gpu)
    while remaining:
        progressed = False
        for r, ids in enumerate(per_gpu):
            if heads[r] >= len(ids):
                continue
            s = ids[heads[r]]
            if all(heads[o] < len(per_gpu[o]) and per_gpu[o][heads[o]] == s for o in owners[s]):
                out.append((tuple(owners[s]), [s]))
                for o in owners[s]:
                    heads[o] += 1
                remaining -= len(owners[s])
                progressed = True
        if not progressed:
            raise RuntimeError("Megatron group has crossing sub-sample orders; it would deadlock")
    return out


def megatron_plan(lengths, world_size: int, cap_tokens: float, cost_model: CostModel) -> Plan:
    """Megatron's schedule as a Plan with one barrier after each of its groups."""
    L = check_lengths(lengths)
    _scheduler_class()  # pay the import before the clock starts
    t0 = time.perf_counter()
    _, sample_id_groups = megatron_schedule(L.tolist(), world_size, cap_tokens)
    solver_ms = (time.perf_counter() - t0) * 1e3
    micro_batches, barriers = [], []
    for per_gpu in sample_id_groups:
        per_gpu = list(per_gpu) + [[] for _ in range(world_size - len(per_gpu))]
        micro_batches.extend(_group_order(per_gpu))
        barriers.append(len(micro_batches) - 1)
    out = Plan(micro_batches, world_size, cap_tokens, barriers_after=tuple(barriers[:-1]))
    out.predicted_step_s = simulate(out, L, cost_model).step_s
    out.solver_ms = solver_ms
    return out
