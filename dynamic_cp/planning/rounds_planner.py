"""Dynamic-CP planner for FSDP ``per_layer``: CP sizes, packing and lockstep rounds chosen together.

Under per-layer sharding a step costs the sum over rounds of max(slowest micro-batch, the round's
weight traffic) (``fsdp_cost.py``), and in a round every rank is in exactly one micro-batch. So a
round is a partition of the ranks into aligned blocks, each running one packed micro-batch of at most
cap * c tokens. The barrier-free planner balances each rank's *total* work; cut into rounds, its
plans leave round maxima uneven (a rank with three short packs beside one with a long one). Here
rounds are built as shelves:

1. **Sizes.** The barrier-free planner's size choices (``planner._choose_sizes``: every cost
   threshold, then size floors up to a node) give each clip a CP size; each is tried.
2. **Shelves.** Clips are taken longest first. A round's height target is H = max(the longest clip
   left, the work left spread over W ranks and the fewest rounds the cap allows, the round's weight
   traffic) times a slack. A clip opens a free aligned block of its size if there is one (load 0:
   LPT), else joins the least-loaded open block of its size or larger that stays under H with
   room in tokens, priced at that block's size; otherwise it waits for a later round. Ranks left
   free in a round run an empty micro-batch.
3. **Exact pick.** Every (sizes, slack) candidate, plus the barrier-free plan cut into greedy rounds
   (``lockstep_rounds``), is priced by ``fsdp_cost.simulate_mode``; the cheapest is returned, with its
   rounds and ``fsdp='per_layer'``. Pure and deterministic (stable sorts, no clocks in decisions).
"""

from __future__ import annotations

import math
import time

import numpy as np

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.fsdp_cost import WeightTraffic, simulate_mode
from dynamic_cp.planning.groups_layout import blocks_of_size, check_world_size, normalize_cp_sizes
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.planner import (
    DEFAULT_THETAS,
    _choose_sizes,
    check_lengths,
    min_cp_index,
    plan,
)
from dynamic_cp.planning.rounds import lockstep_rounds

DEFAULT_SLACKS = (1.0, 1.1, 1.25)


def _time_table(
    L: np.ndarray, sizes: tuple[int, ...], kmin: np.ndarray, cap: float, cm: CostModel, world: int
):
    """(clips, sizes) additive seconds, inf where a clip does not fit; packs hold a rank's even share
    of the batch, at most ``cap`` tokens (as ``planner.plan`` assumes)."""
    packed = min(float(cap), max(float(L.sum()) / world, 1.0))
    table = np.full((L.size, len(sizes)), np.inf)
    for j, c in enumerate(sizes):
        fits = kmin <= j
        if fits.any():
            table[fits, j] = cm.sample_times(L[fits], c, packed)
    return table


def _shelves(
    L: np.ndarray,
    k: np.ndarray,
    table: np.ndarray,
    sizes: tuple[int, ...],
    world: int,
    cap: float,
    floor_s: float,
    slack: float,
) -> list[list[tuple[tuple[int, ...], list[int]]]]:
    """Step 2: rounds of (ranks, clip ids) for size choice ``k`` (index into ``sizes`` per clip)."""
    # plain Python lists: this loop runs for every candidate, and numpy scalar indexing dominated it
    rows = table.tolist()
    ks = [int(j) for j in k]
    t = [rows[i][ks[i]] for i in range(L.size)]
    lens = [int(x) for x in L]
    blocks = {j: blocks_of_size(world, c) for j, c in enumerate(sizes)}
    remaining = sorted(range(L.size), key=lambda i: (-t[i], i))
    rounds = []
    while remaining:
        work = float(sum(t[i] * sizes[ks[i]] for i in remaining))
        min_rounds = max(1, math.ceil(sum(lens[i] for i in remaining) / (world * cap)))
        height = max(t[remaining[0]], work / (world * min_rounds), floor_s) * slack
        free = [True] * world
        first = dict.fromkeys(blocks, 0)  # per size: blocks before this one are taken (ranks only fill up)
        open_blocks: list[list] = []  # [size index, ranks, load, tokens, ids]
        left = []
        for i in remaining:
            j = ks[i]
            cand = blocks[j]
            while first[j] < len(cand) and not all(free[r] for r in cand[first[j]]):
                first[j] += 1
            if first[j] < len(cand):
                home = cand[first[j]]
                for r in home:
                    free[r] = False
                open_blocks.append([j, home, t[i], lens[i], [i]])
                continue
            best = None
            row = rows[i]
            for b in open_blocks:
                tb = row[b[0]]
                if b[0] < j or tb == math.inf or b[3] + lens[i] > cap * sizes[b[0]]:
                    continue
                if b[2] + tb <= height and (best is None or b[2] + tb < best[0]):
                    best = (b[2] + tb, b, tb)
            if best is None:
                left.append(i)
                continue
            _, b, tb = best
            b[2] += tb
            b[3] += lens[i]
            b[4].append(i)
        if len(left) == len(remaining):  # nothing fit under the height: cannot happen, guard anyway
            raise AssertionError("rounds planner made no progress")
        open_blocks.sort(key=lambda b: (-len(b[1]), b[1][0]))
        rounds.append([(b[1], sorted(b[4])) for b in open_blocks])
        remaining = left
    return rounds


def _rounds_to_plan(rounds, world: int, cap: float) -> Plan:
    micro_batches, members = [], []
    for rnd in rounds:
        members.append(list(range(len(micro_batches), len(micro_batches) + len(rnd))))
        micro_batches.extend(rnd)
    return Plan(micro_batches, world, cap, rounds=members, fsdp="per_layer")


def plan_rounds(
    lengths,
    world_size: int,
    cap_tokens: float,
    cost_model: CostModel,
    cp_sizes=None,
    *,
    thetas: tuple[float, ...] = DEFAULT_THETAS,
    slacks: tuple[float, ...] = DEFAULT_SLACKS,
) -> Plan:
    """A per_layer plan (see the module docstring): ``rounds`` set, ``predicted_step_s`` priced by
    ``simulate_mode(..., 'per_layer')``."""
    t0 = time.perf_counter()
    check_world_size(world_size)
    if not cap_tokens > 0:
        raise ValueError(f"cap_tokens={cap_tokens} must be positive (see dynamic_cp.planning.memory)")
    L = check_lengths(lengths)
    sizes = normalize_cp_sizes(world_size, cp_sizes)
    if L.size == 0:
        return Plan(
            [], world_size, cap_tokens, predicted_step_s=0.0, solver_ms=0.0, rounds=[], fsdp="per_layer"
        )
    kmin = min_cp_index(L, cap_tokens, sizes)
    table = _time_table(L, sizes, kmin, cap_tokens, cost_model, world_size)
    size_arr = np.asarray(sizes)
    floor_s = WeightTraffic.of(cost_model, world_size).round_s
    choices = [_choose_sizes(table, size_arr, world_size, th) for th in thetas]
    # size floors up to a node (intra-node CP is cheap; bigger blocks pack long clips together)
    top_floor = max(int(kmin.max()), sum(c <= cost_model.hw.gpus_per_node for c in sizes) - 1)
    choices += [np.maximum(kmin, f) for f in range(1, top_floor + 1)]

    barrier_free = plan(lengths, world_size, cap_tokens, cost_model, cp_sizes)
    best = lockstep_rounds(barrier_free, world_size)
    best.fsdp = "per_layer"
    best_s = simulate_mode(best, L, cost_model, "per_layer").step_s
    seen = set()
    for k in choices:
        if k.tobytes() in seen:
            continue
        seen.add(k.tobytes())
        for slack in slacks:
            cand = _rounds_to_plan(
                _shelves(L, k, table, sizes, world_size, cap_tokens, floor_s, slack), world_size, cap_tokens
            )
            s = simulate_mode(cand, L, cost_model, "per_layer").step_s
            if s < best_s * (1 - 1e-9):
                best, best_s = cand, s
    best.predicted_step_s = best_s
    best.solver_ms = (time.perf_counter() - t0) * 1e3
    return best


def plan_for_mode(
    lengths, world_size: int, cap_tokens: float, cost_model: CostModel, fsdp: str, cp_sizes=None
) -> Plan:
    """The Dynamic-CP plan for a sharding mode: barrier-free (``planner.plan``) for none and
    per_step, lockstep rounds (``plan_rounds``) for per_layer. ``plan.fsdp`` records the mode."""
    if fsdp == "per_layer":
        return plan_rounds(lengths, world_size, cap_tokens, cost_model, cp_sizes)
    if fsdp not in ("none", "per_step"):
        raise ValueError(f"fsdp={fsdp!r}; use 'none', 'per_step' or 'per_layer' (resolve 'auto' first)")
    out = plan(lengths, world_size, cap_tokens, cost_model, cp_sizes)
    out.fsdp = fsdp
    return out
