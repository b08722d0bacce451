"""Dynamic-CP planner: pack clips into micro-batches and give each micro-batch a CP group.

Input: clip lengths (tokens), world size W, per-rank token cap, a cost model. Output: a ``Plan``, an
ordered list of (ranks, sample ids). Pure and deterministic: no clocks, no randomness, stable sorts,
so every rank computes the same plan from the same all-gathered lengths.

Algorithm
---------
1. **Feasibility.** Each clip's smallest CP size is the first allowed size c with L <= cap * c.
   A clip above cap * (largest size) raises a ValueError naming it, its length and that capacity.
2. **CP size from cost, not only memory.** A table gives every clip's additive time at every allowed
   size (``CostModel.sample_times``: its share of a packed micro-batch). Candidate size choices:
     thresholds  for theta in (inf, 1, 0.6, 0.35, 0.2): a clip keeps its smallest size unless its
                 time exceeds theta * target, target = max(total rank-seconds / W, slowest clip at
                 its fastest size); then it takes the smallest size that brings it under (or its
                 fastest). The target moves as sizes grow, so this is iterated.
     floors      every clip at least size 2, 4, ... up to a node (intra-node CP is cheap and evens
                 out lumpy work) and up to static CP's size (so static CP's shape is a candidate).
3. **Placement, hole-free by construction.** Allowed groups are aligned blocks, a laminar family.
   Clips are placed biggest size first; within a size, longest-processing-time first onto the block
   whose ranks finish earliest. Every earlier placement covered whole aligned blocks of a size >= c,
   so all ranks of a c-block are equally loaded when the c-clips arrive, and running the plan in
   size-descending order leaves no idle gaps: a rank's finish time is the sum of what covers it.
   One more candidate chooses size and block together (``_place_joint``): the clips that are a
   visible share of the step, most work first, each take the (size, block) that minimises
   max(its finish, (rank-seconds so far + its own + the rest's cheapest) / W), so a mid-size clip
   grows onto idle ranks instead of queueing behind a big one; small clips then go LPT.
4. **Local search** on the best candidates (by that sum): while the busiest rank can shed work, move
   a clip to another block of its size, swap two clips of one size, or resize a clip one or two
   sizes up or down (onto the least-loaded block, or the block nested with its own), taking the
   step that leaves the lowest maximum. The objective is exact under step 3's ordering, so each step
   strictly unloads the busiest rank. Bounded by an iteration count, not a clock: deterministic.
5. **Packing and the exact pick.** Each block's clips are packed best-fit-decreasing into
   micro-batches of at most cap * c tokens (amortizes the per-micro-batch overhead, keeps GEMMs
   large). Micro-batches are emitted by size (descending), then block. The refined candidates and
   static CP's shape are scored by the simulator (the additive estimate cannot see how a pack hides
   ring traffic behind its longest clip), and the fastest is returned with that predicted step.

Cost: O(n K) for the table, O(n log W) per candidate placement, a bounded local search and
O(n log n) packing: about 20 ms of CPU for 1,000 clips on 128 ranks (bench/bench_planner.py).
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_left, insort

import numpy as np

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import check_world_size, normalize_cp_sizes
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.simulator import simulate

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

    def place(self, c: int, ids: np.ndarray, t: np.ndarray) -> None:
        """LPT: longest clip first onto the block that is free earliest (ties: lowest rank)."""
        starts = self.block_starts(c)
        nb = len(starts)
        loads = (
            self.finish[: nb * c].reshape(nb, c).max(axis=1).tolist()
            if c < self.world
            else [self.finish.max()]
        )
        heap = list(zip(loads, starts))
        heapq.heapify(heap)
        added = dict.fromkeys(starts, 0.0)
        tid = t[ids]
        order = np.lexsort((ids, -tid))  # time descending, then id: deterministic
        for i, ti in zip(ids[order].tolist(), tid[order].tolist()):
            load, s = heapq.heappop(heap)
            self.blocks.setdefault((c, s), []).append(i)
            added[s] += ti
            heapq.heappush(heap, (load + ti, s))
        for s, a in added.items():
            self.finish[s : s + c] += a

    def makespan(self) -> float:
        return float(self.finish.max())


def _place_all(n: int, k: np.ndarray, table: np.ndarray, world: int, sizes: tuple[int, ...]) -> _Placement:
    """Step 3 for one size choice ``k``: biggest sizes first, LPT within each size."""
    pl = _Placement(world, sizes)
    _place_lpt(pl, np.ones(n, dtype=bool), k, table)
    return pl


def _place_lpt(pl: _Placement, which: np.ndarray, k: np.ndarray, table: np.ndarray) -> None:
    """Add the clips selected by the mask ``which`` to ``pl`` at sizes ``k``: biggest size first,
    LPT within a size onto the blocks that finish earliest."""
    t = table[np.arange(len(k)), k]
    for j in range(len(pl.sizes) - 1, -1, -1):
        ids = np.flatnonzero(which & (k == j))
        if ids.size:
            pl.place(pl.sizes[j], ids, t)


def _place_joint(
    table: np.ndarray, world: int, sizes: tuple[int, ...], big_share: float = 0.05
) -> tuple[_Placement, np.ndarray]:
    """Step 3b: choose each clip's size *and* block together, biggest work first.

    Step 2 fixes sizes before placement, so a mid-size clip can keep a small group and end up on
    ranks already busy with a big clip, when one size up on idle ranks would finish sooner. Here each
    clip takes the (size, block) that minimises the step estimate

        max(block finish + t_i(c), (placed rank-seconds + c * t_i(c) + remaining cheapest work) / W)

    so a clip grows while the idle ranks it uses would otherwise wait, and stops growing once the
    extra rank-seconds (communication, small-shard inefficiency) raise the whole step. Ties: fewer
    rank-seconds, then the smaller size, then the lower block. Any assignment to aligned blocks is
    hole-free when run in size-descending order (step 3), so ``finish`` stays exact.

    Only clips that are a visible share of the step (``big_share`` of the target), and at most the
    2 W with the most work, get this search; the rest take their cheapest size and go LPT onto the
    least-loaded blocks afterwards, which keeps the cost at O(min(big clips, 2 W) x sizes) numpy calls.
    """
    n, K = table.shape
    size_arr = np.asarray(sizes, dtype=np.float64)
    work = table * size_arr  # rank-seconds of clip i at size j (inf where it does not fit)
    cheapest = work.min(axis=1)
    k = np.argmin(work, axis=1)  # small clips keep their cheapest size
    target = max(float(cheapest.sum()) / world, float(table.min(axis=1).max()))
    big = np.flatnonzero(table[np.arange(n), k] > big_share * target)
    # most work first, then id: deterministic; at most 2 W of them, to bound the cost. The cap can
    # lose: five equal clips on 2 ranks finish at 3.0 where searching all five reaches 2.55
    # (test_joint_placement_searches_at_most_2w_clips); local search and the simulator's pick of
    # the best candidate run afterwards
    big = big[np.lexsort((big, -cheapest[big]))][: 2 * world]
    remaining = float(cheapest.sum())
    placed_work = 0.0
    pl = _Placement(world, sizes)
    for i in big.tolist():
        remaining -= cheapest[i]
        best = None  # (estimate, rank-seconds, j, start)
        for j, c in enumerate(sizes):
            t = table[i, j]
            if not np.isfinite(t):
                continue
            starts = pl.block_starts(c)
            nb = len(starts)
            loads = pl.finish[: nb * c].reshape(nb, c).max(axis=1)
            b = int(np.argmin(loads))
            est = max(float(loads[b]) + t, (placed_work + work[i, j] + remaining) / world)
            cand = (est, float(work[i, j]), j, starts[b])
            if best is None or cand < best:
                best = cand
        _, w, j, s = best
        k[i] = j
        placed_work += w
        pl.blocks.setdefault((sizes[j], s), []).append(i)
        pl.finish[s : s + sizes[j]] += table[i, j]
    small = np.ones(n, dtype=bool)
    small[big] = False
    _place_lpt(pl, small, k, table)
    return pl, k


def _local_search(pl: _Placement, table: np.ndarray, k: np.ndarray, iters: int) -> None:
    """Step 4: unload the busiest rank by moving, swapping or resizing one clip at a time.

    ``table[i, j]`` is clip i's time at size ``sizes[j]`` (inf where it does not fit) and ``k[i]`` its
    current size index. Candidate steps for the clips of each block covering the busiest rank r:
      move    same size, to the least-loaded other block;
      swap    same size, trading for the clip in that block that best evens the pair;
      resize  a size up to two steps smaller or larger, onto the least-loaded block of that size
              (a clip grows to fill idle ranks, or shrinks to cut communication).
    The step giving the lowest resulting maximum over the ranks it touches wins; it must be below
    the current maximum, so each step strictly unloads r. Candidates are scored with numpy per block.
    """
    world, sizes = pl.world, pl.sizes
    num_sizes = len(sizes)
    nblocks = [1 if c == world else world // c for c in sizes]
    for _ in range(iters):
        f = pl.finish
        r = int(np.argmax(f))
        top = float(f[r])
        if top <= f.mean() * (1 + 1e-3):  # already level: nothing left to gain
            return
        bar = top * (1 - 1e-9)
        bmax = [f[: nb * c].reshape(nb, c).max(axis=1) for nb, c in zip(nblocks, sizes)]
        best = None  # (result, action)
        for j, c in enumerate(sizes):
            src = 0 if c == world else (r // c) * c
            ids = pl.blocks.get((c, src))
            if not ids or src + c > world:
                continue
            ids_arr = np.asarray(ids)
            ta = table[ids_arr, j]
            if c < world and nblocks[j] > 1:
                bm = bmax[j].copy()
                bm[src // c] = np.inf
                dst = int(np.argmin(bm)) * c
                low = float(bm[dst // c])
                gap = top - low
                dst_ids = np.asarray(pl.blocks.get((c, dst), []), dtype=np.int64)
                dst_t = table[dst_ids, j]
                order = np.argsort(dst_t, kind="stable")
                dst_ids, dst_t = dst_ids[order], dst_t[order]
                # delta = t_a - t_b moves from src to dst (t_b = 0: a plain move); gap / 2 is ideal.
                deltas = [ta]
                partners = [np.full(ta.shape, -1)]
                if dst_ids.size:
                    pos = np.searchsorted(dst_t, ta - gap / 2)
                    for p in (np.clip(pos - 1, 0, dst_ids.size - 1), np.clip(pos, 0, dst_ids.size - 1)):
                        deltas.append(ta - dst_t[p])
                        partners.append(dst_ids[p])
                for delta, partner in zip(deltas, partners):
                    res = np.where((delta > 0) & (delta < gap), np.maximum(top - delta, low + delta), np.inf)
                    a = int(np.argmin(res))
                    if res[a] < bar and (best is None or res[a] < best[0]):
                        best = (
                            float(res[a]),
                            ("swap", ids[a], int(partner[a]), c, src, dst, float(delta[a])),
                        )
            for j2 in range(max(0, j - 2), min(num_sizes, j + 3)):
                if j2 == j:
                    continue
                c2 = sizes[j2]
                t2 = table[ids_arr, j2]
                if not np.isfinite(t2).any():
                    continue
                # Destinations: the least-loaded block of that size, and the block nested with src
                # (the one containing it when growing, its least-loaded sub-block when shrinking).
                dsts = {int(np.argmin(bmax[j2])) * c2 if c2 < world else 0}
                if c2 > c:
                    dsts.add(0 if c2 == world else (src // c2) * c2)
                elif c % c2 == 0:
                    dsts.add(src + int(np.argmin(f[src : src + c].reshape(c // c2, c2).max(axis=1))) * c2)
                for dst in dsts:
                    if dst + c2 > world:
                        continue
                    dmax = float(f[dst : dst + c2].max())
                    if dst + c2 <= src or src + c <= dst:  # disjoint blocks
                        res = np.maximum(top - ta, dmax + t2)
                    elif c2 > c:  # dst contains src
                        g = f[dst : dst + c2].copy()
                        g[src - dst : src - dst + c] = -np.inf
                        res = np.maximum(top - ta + t2, float(g.max()) + t2)
                    else:  # dst inside src
                        g = f[src : src + c].copy()
                        g[dst - src : dst - src + c2] = -np.inf
                        res = np.maximum(dmax - ta + t2, float(g.max()) - ta)
                    res = np.where(np.isfinite(t2), res, np.inf)
                    a = int(np.argmin(res))
                    if res[a] < bar and (best is None or res[a] < best[0]):
                        best = (
                            float(res[a]),
                            ("resize", ids[a], c, src, c2, dst, float(ta[a]), float(t2[a])),
                        )
        if best is None:
            return
        act = best[1]
        if act[0] == "swap":
            _, a, b, c, src, dst, delta = act
            pl.blocks[(c, src)].remove(a)
            pl.blocks.setdefault((c, dst), []).append(a)
            if b >= 0:
                pl.blocks[(c, dst)].remove(b)
                pl.blocks[(c, src)].append(b)
            pl.finish[src : src + c] -= delta
            pl.finish[dst : dst + c] += delta
        else:
            _, a, c, src, c2, dst, ta, t2 = act
            pl.blocks[(c, src)].remove(a)
            pl.blocks.setdefault((c2, dst), []).append(a)
            k[a] = sizes.index(c2)
            pl.finish[src : src + c] -= ta
            pl.finish[dst : dst + c2] += t2


def _pack(ids: list[int], L: np.ndarray, capacity: float) -> list[list[int]]:
    """Best-fit decreasing by tokens into bins of ``capacity`` tokens: O(m log m) with a sorted list
    of (room left, bin) pairs; ties go to the lowest bin, so the result is deterministic."""
    bins: list[list[int]] = []
    rooms: list[tuple[float, int]] = []  # sorted ascending
    for i in sorted(ids, key=lambda i: (-int(L[i]), i)):
        need = float(L[i])
        j = bisect_left(rooms, (need, -1))
        if j < len(rooms):
            room, b = rooms.pop(j)
            bins[b].append(i)
            insort(rooms, (room - need, b))
        else:
            bins.append([i])
            insort(rooms, (capacity - need, len(bins) - 1))
    return bins


def _emit(pl: _Placement, L: np.ndarray, cap_tokens: float) -> list:
    """Step 5: pack each block's clips into micro-batches, biggest CP size first, then by block."""
    micro_batches = []
    for c, s in sorted(pl.blocks, key=lambda cs: (-cs[0], cs[1])):
        if pl.blocks[(c, s)]:
            ranks = tuple(range(s, s + c))
            micro_batches.extend((ranks, ids) for ids in _pack(pl.blocks[(c, s)], L, cap_tokens * c))
    return micro_batches


def plan(
    lengths,
    world_size: int,
    cap_tokens: float,
    cost_model: CostModel,
    cp_sizes=None,
    *,
    thetas: tuple[float, ...] = DEFAULT_THETAS,
    search_iters: int = 100,
    num_refine: int = 2,
    exact_work: int = 2000,
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

    # Micro-batches fill up to the cap when there is enough work, and hold about a rank's even share
    # of the batch when there is not: that is the pack size the per-clip times assume.
    packed_tokens = min(float(cap_tokens), max(float(L.sum()) / world_size, 1.0))
    table = np.full((L.size, len(sizes)), np.inf)
    for k, c in enumerate(sizes):
        fits = kmin <= k
        if fits.any():
            table[fits, k] = cost_model.sample_times(L[fits], c, packed_tokens)

    # Step 2 candidates: cost thresholds, and size floors (every clip at least size c_f; the floor at
    # the largest minimum size is static CP's shape, so the search starts no worse than it).
    candidates = [_choose_sizes(table, size_arr, world_size, th) for th in thetas]
    # Floors up to a node's size are cheap to try: intra-node CP costs little and evens out tiny work.
    top_floor = max(int(kmin.max()), sum(c <= cost_model.hw.gpus_per_node for c in sizes) - 1)
    candidates += [np.maximum(kmin, f) for f in range(1, top_floor + 1)]
    static_shape = np.full_like(kmin, kmin.max())
    placed = []
    seen = set()
    for k in candidates:
        key = k.tobytes()
        if key in seen:
            continue
        seen.add(key)
        placed.append((_place_all(L.size, k, table, world_size, sizes), k))
    placed.append(_place_joint(table, world_size, sizes))
    placed.sort(key=lambda pk: pk[0].makespan())
    refine = placed[:num_refine]
    # Static CP's shape is refined too, and also kept as placed (LPT, no search), so the result is
    # never worse than balanced static CP even where the additive estimate misleads the search.
    refine += [pk for pk in placed[num_refine:] if np.array_equal(pk[1], static_shape)]
    static_pl = _place_all(L.size, static_shape, table, world_size, sizes)
    # Small batches: score every candidate exactly (cheap there, and where tiny micro-batches make
    # the additive estimate least reliable).
    unrefined = [static_pl] + (
        [pk[0] for pk in placed[num_refine:]] if L.size * len(placed) <= exact_work else []
    )
    # Refine the most promising candidates, then pick by the exact simulated step: the additive
    # estimate cannot see how a packed micro-batch hides ring traffic behind its longest clip.
    best = None
    for pl, k in refine:
        _local_search(pl, table, k.copy(), search_iters)
        micro_batches = _emit(pl, L, cap_tokens)
        step = simulate(Plan(micro_batches, world_size, cap_tokens), L, cost_model, timeline=False).step_s
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, micro_batches, pl.makespan())
    for pl in unrefined:
        micro_batches = _emit(pl, L, cap_tokens)
        step = simulate(Plan(micro_batches, world_size, cap_tokens), L, cost_model, timeline=False).step_s
        if step < best[0] * (1 - 1e-9):
            best = (step, micro_batches, pl.makespan())
    step, micro_batches, estimate = best
    out = Plan(micro_batches, world_size, cap_tokens, predicted_step_s=step, info={"estimate_s": estimate})
    out.solver_ms = (time.perf_counter() - t0) * 1e3
    return out
