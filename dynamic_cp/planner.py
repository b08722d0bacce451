"""Dynamic-CP planner: pack clips into micro-batches and give each micro-batch a CP group.

Input: clip lengths (tokens), world size W, per-rank token cap, a cost model. Output: a ``Plan``, an
ordered list of (ranks, sample ids). Pure and deterministic: no clocks, no randomness, stable sorts,
so every rank computes the same plan from the same all-gathered lengths.

Algorithm
---------
1. **Feasibility.** Each clip's smallest CP size is the first allowed size c with L <= cap * c.
   A clip above cap * (largest size) raises a ValueError naming it.
2. **CP size from cost, not only memory.** A table gives every clip's additive time at every allowed
   size (``CostModel.sample_times``: its share of a micro-batch packed to the cap). For a threshold
   theta, a clip keeps its smallest size unless its time exceeds theta * target, where target is
   max(total rank-seconds / W, the slowest clip at its fastest size); then it takes the smallest size
   that brings it under, or its fastest one. The target moves as sizes grow, so this is iterated.
   Several thetas are tried (long clips split wider or not) and the best predicted step wins.
3. **Placement, hole-free by construction.** Allowed groups are aligned blocks, a laminar family.
   Clips are placed biggest CP size first; within a size, longest-processing-time first onto the
   block whose ranks finish earliest. Because every earlier placement covered whole aligned blocks of
   a size >= c, all ranks in a c-block are equally loaded when c-clips arrive, so running the plan in
   size-descending order leaves no idle gaps: a rank's finish time is just the sum of what covers it.
4. **Local search.** While the most loaded rank can shed work, move one clip (or swap two) between
   blocks of the same size, choosing the exchange that best evens the two blocks. The objective
   (sum of covering times per rank) is exact under step 3's ordering, so every accepted step lowers
   the busiest rank. Bounded by an iteration count, not a clock, to stay deterministic.
5. **Packing.** Each block's clips are packed first-fit-decreasing into micro-batches of at most
   cap * c tokens, which amortizes the per-micro-batch overhead and keeps GEMMs large. Micro-batches
   are emitted by CP size (descending), then block, and the simulator's critical path is the
   predicted step time.

Cost: O(n log W) per theta for placement plus a bounded local search; see bench/bench_planner.py.
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_left

import numpy as np

from dynamic_cp.cost_model import CostModel
from dynamic_cp.groups_layout import check_world_size, normalize_cp_sizes
from dynamic_cp.plan_types import Plan
from dynamic_cp.simulator import simulate

DEFAULT_THETAS = (float("inf"), 1.0, 0.6, 0.35, 0.2)


def check_lengths(lengths) -> np.ndarray:
    L = np.asarray(lengths)
    if L.ndim != 1:
        raise ValueError(f"lengths must be a flat list of token counts, got shape {L.shape}")
    if L.size and (not np.issubdtype(L.dtype, np.integer) or L.min() < 1):
        raise ValueError("lengths must be positive integers (tokens per clip); drop empty clips first")
    return L.astype(np.int64)


def min_cp_index(L: np.ndarray, cap_tokens: float, sizes: tuple[int, ...]) -> np.ndarray:
    """Index into ``sizes`` of each clip's smallest CP size that fits; ValueError if one fits none."""
    capacity = np.asarray(sizes, dtype=np.float64) * cap_tokens
    if L.size and L.max() > capacity[-1]:
        i = int(np.argmax(L > capacity[-1]))
        raise ValueError(
            f"sample {i} has {int(L[i])} tokens, more than the largest capacity {int(capacity[-1])} "
            f"(cap {cap_tokens:g} tokens/rank x CP {sizes[-1]}); raise the cap (activation "
            "checkpointing, more memory), allow a larger CP size, or drop or crop the clip"
        )
    return np.searchsorted(capacity, L, side="left")


def _choose_sizes(table: np.ndarray, sizes: np.ndarray, world: int, theta: float) -> np.ndarray:
    """Step 2: one size index per clip for threshold ``theta``."""
    best_time = table.min(axis=1)
    k = np.argmax(np.isfinite(table), axis=1)  # smallest feasible size
    if not np.isfinite(theta):
        return k
    rows = np.arange(len(k))
    fastest = np.argmin(table, axis=1)
    for _ in range(4):
        t = table[rows, k]
        target = max(float((t * sizes[k]).sum()) / world, float(best_time.max()))
        ok = table <= theta * target
        new_k = np.where(ok.any(axis=1), np.argmax(ok, axis=1), fastest)
        if np.array_equal(new_k, k):
            break
        k = new_k
    return k


class _Placement:
    """Clips assigned to aligned blocks; ``finish[r]`` is the sum of times of the clips covering r."""

    def __init__(self, world: int, sizes: tuple[int, ...]):
        self.world = world
        self.sizes = sizes
        self.finish = np.zeros(world)
        self.blocks: dict[tuple[int, int], list[int]] = {}  # (cp, first rank) -> sample ids

    def block_starts(self, c: int) -> list[int]:
        return [0] if c == self.world else list(range(0, self.world - c + 1, c))

    def place(self, c: int, ids: list[int], t: np.ndarray) -> None:
        """LPT: longest clip first onto the block that is free earliest (ties: lowest rank)."""
        starts = self.block_starts(c)
        heap = [(float(self.finish[s : s + c].max()), s) for s in starts]
        heapq.heapify(heap)
        added = dict.fromkeys(starts, 0.0)
        for i in sorted(ids, key=lambda i: (-t[i], i)):
            load, s = heapq.heappop(heap)
            self.blocks.setdefault((c, s), []).append(i)
            added[s] += t[i]
            heapq.heappush(heap, (load + t[i], s))
        for s, a in added.items():
            self.finish[s : s + c] += a

    def makespan(self) -> float:
        return float(self.finish.max())


def _local_search(pl: _Placement, t: np.ndarray, iters: int) -> None:
    """Step 4: move or swap clips between same-size blocks to unload the busiest rank."""
    world = pl.world
    used = sorted({c for c, _ in pl.blocks if c < world})
    for _ in range(iters):
        r = int(np.argmax(pl.finish))
        top = pl.finish[r]
        best = None  # (resulting pair max, c, src, dst, a, b)
        for c in used:
            src = (r // c) * c
            if src + c > world or (c, src) not in pl.blocks:
                continue
            nb = world // c
            block_max = pl.finish[: nb * c].reshape(nb, c).max(axis=1)
            block_max[src // c] = np.inf
            dst = int(np.argmin(block_max)) * c
            gap = top - block_max[dst // c]
            if gap <= 1e-12 * max(top, 1e-30):
                continue
            src_ids = pl.blocks[(c, src)]
            dst_ids = sorted(pl.blocks.get((c, dst), []), key=lambda i: (t[i], i))
            dst_t = [t[i] for i in dst_ids]
            for a in src_ids:
                # Moving ``a`` and taking ``b`` back shifts delta = t_a - t_b from src to dst; the best
                # delta is gap / 2, and any 0 < delta < gap lowers the busiest rank.
                options = [(t[a], None)]
                j = bisect_left(dst_t, t[a] - gap / 2)
                for jj in (j - 1, j):
                    if 0 <= jj < len(dst_ids):
                        options.append((t[a] - dst_t[jj], dst_ids[jj]))
                for delta, b in options:
                    if 0 < delta < gap:
                        pair = max(top - delta, top - gap + delta)
                        key = (pair, c, src, a, -1 if b is None else b)
                        if best is None or key < best[0]:
                            best = (key, c, src, dst, a, b, delta)
        if best is None:
            return
        _, c, src, dst, a, b, delta = best
        pl.blocks[(c, src)].remove(a)
        pl.blocks.setdefault((c, dst), []).append(a)
        if b is not None:
            pl.blocks[(c, dst)].remove(b)
            pl.blocks[(c, src)].append(b)
        pl.finish[src : src + c] -= delta
        pl.finish[dst : dst + c] += delta


def _pack(ids: list[int], L: np.ndarray, capacity: float) -> list[list[int]]:
    """First-fit decreasing by tokens into bins of ``capacity`` tokens."""
    bins: list[list[int]] = []
    room: list[float] = []
    for i in sorted(ids, key=lambda i: (-int(L[i]), i)):
        for b, free in enumerate(room):
            if L[i] <= free:
                bins[b].append(i)
                room[b] -= L[i]
                break
        else:
            bins.append([i])
            room.append(capacity - L[i])
    return bins


def plan(
    lengths,
    world_size: int,
    cap_tokens: float,
    cost_model: CostModel,
    cp_sizes=None,
    *,
    thetas: tuple[float, ...] = DEFAULT_THETAS,
    search_iters: int = 400,
) -> Plan:
    """Plan one global batch. See the module docstring for the algorithm.

    lengths: tokens per clip (sample id = position). cap_tokens: most tokens a rank may hold in one
    micro-batch. cp_sizes: allowed CP sizes (default: powers of two up to world size, plus the world).
    """
    t0 = time.perf_counter()
    check_world_size(world_size)
    if not cap_tokens > 0:
        raise ValueError(f"cap_tokens={cap_tokens} must be positive (see CostModel.token_cap)")
    L = check_lengths(lengths)
    sizes = normalize_cp_sizes(world_size, cp_sizes)
    if L.size == 0:
        return Plan([], world_size, cap_tokens, predicted_step_s=0.0, solver_ms=0.0)
    kmin = min_cp_index(L, cap_tokens, sizes)
    size_arr = np.asarray(sizes)

    table = np.full((L.size, len(sizes)), np.inf)
    for k, c in enumerate(sizes):
        fits = kmin <= k
        if fits.any():
            table[fits, k] = cost_model.sample_times(L[fits], c, cap_tokens)

    best = None
    seen = set()
    for theta in thetas:
        k = _choose_sizes(table, size_arr, world_size, theta)
        key = k.tobytes()
        if key in seen:
            continue
        seen.add(key)
        t = table[np.arange(L.size), k]
        pl = _Placement(world_size, sizes)
        for j in range(len(sizes) - 1, -1, -1):
            ids = np.flatnonzero(k == j).tolist()
            if ids:
                pl.place(sizes[j], ids, t)
        if best is None or pl.makespan() < best[0].makespan() - 1e-12:
            best = (pl, t, theta)
    pl, t, theta = best
    _local_search(pl, t, search_iters)

    micro_batches = []
    for c, s in sorted(pl.blocks, key=lambda cs: (-cs[0], cs[1])):
        ranks = tuple(range(s, s + c))
        for ids in _pack(pl.blocks[(c, s)], L, cap_tokens * c):
            micro_batches.append((ranks, ids))
    out = Plan(micro_batches, world_size, cap_tokens, info={"theta": theta, "estimate_s": pl.makespan()})
    out.predicted_step_s = simulate(out, L, cost_model).step_s
    out.solver_ms = (time.perf_counter() - t0) * 1e3
    return out
