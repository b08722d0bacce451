"""Order a plan's micro-batches for pipeline stages, and pick the plan whose order steps fastest.

The runtime runs ``plan.micro_batches`` in list order through ``pipeline_schedule.stage_ops``, so the
order returned here IS the pipeline schedule. Why order matters: a stage's op list is one sequence
over all micro-batches, so a rank gets a forward ahead of its pending backward only when its next
micro-batch sits within the stage's warm-up distance (``Plan.pp_warmup`` x (pp - stage - 1)) in the
list. Where a rank leaves one CP group for another (a run of micro-batches of one group ends) it
drains and refills: it idles for the round trip of the run's last micro-batch through the later
stages, and the next run's first micro-batch fills the stages again. The planner already emits
each group's micro-batches as one run; the order

    1. keeps the runs, and within each run puts the micro-batch with the shortest round trip last
       (the drain) and the next shortest first (the fill), the others rising then falling in size
       between them, so neighbours are alike and the steady 1F1B pairs stall little;
    2. tries the runs in the planner's order (CP size descending) and in ascending size;
    3. local search: swaps of a run's end with another member of the run, and of two neighbouring
       runs, each scored by ``simulate_pipeline``, up to ``evals`` simulations (a count, not a
       clock: every rank computes the same order);
    4. under 1F1B, deeper warm-ups (``WARMUPS``): steady 1F1B has no slack, so each micro-batch
       larger than its neighbours stalls stage 0 for its round trip, and a warm-up of w x
       (pp - stage - 1) forwards covers that with more micro-batches in flight. Plain 1F1B's memory
       is pp - p micro-batches at the cap on stage p; a deeper warm-up is kept only where the
       replay's peak tokens stay within it, which packs under a fraction of the cap allow.

The result never steps slower than the input order (the input is a candidate). ``plan_for_pipeline``
also lets the planner choose CP sizes and micro-batch sizes under PP: its default sizes, and the
sizes from a node up (fewer, larger groups: fewer runs, so fewer drains), each under the memory's
token cap and under ``CAP_FRACTIONS`` of it (more, smaller micro-batches: a shorter fill and drain
and smaller steps between neighbours, against GEMM efficiency and overheads), each ordered, the
fastest kept.
"""

from __future__ import annotations

import time

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import normalize_cp_sizes
from dynamic_cp.planning.pipeline_sim import StageCosts, simulate_pipeline, stage_costs
from dynamic_cp.planning.plan_types import Plan

# Pack caps tried under PP, as fractions of the memory's cap: smaller micro-batches, more of them,
# shorter fill and drain, at some GEMM efficiency and per-micro-batch overhead. The steps are flat
# near the best (wan-14b, 64 GPUs, openvid: pp 4 86.1 s at 3/8, 88.2 s at 1/2, 89.2 s at 1/4), so
# a grid of five, not a finer search (docs/planner.md).
CAP_FRACTIONS = (1.0, 0.5, 0.375, 0.25, 0.125)
NUM_CANDIDATES = 3  # orders tried before the local search: input, shaped runs, shaped runs by size
# 1F1B warm-ups plan_for_pipeline tries (``Plan.pp_warmup``), within plain 1F1B's memory at the cap
WARMUPS = (1, 2, 3)


def _permuted(costs: StageCosts, order: list[int]) -> StageCosts:
    pick = lambda rows: [[row[i] for i in order] for row in rows]  # noqa: E731
    return StageCosts(pick(costs.fwd), pick(costs.bwd), pick(costs.p2p), costs.sync)


def _runs(plan: Plan) -> list[list[int]]:
    """Maximal stretches of consecutive micro-batches on the same CP group."""
    runs: list[list[int]] = []
    for i, (ranks, _) in enumerate(plan.micro_batches):
        if runs and plan.micro_batches[runs[-1][-1]][0] == ranks:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _mountain(run: list[int], trip: list[float]) -> list[int]:
    """The run rising then falling in round trip: every other micro-batch in ascending order from the
    second shortest up, then the rest back down to the shortest, which goes last (the drain) while
    the second shortest goes first (the fill); neighbours stay alike, so 1F1B pairs stay even."""
    asc = sorted(run, key=lambda i: (trip[i], i))
    return asc[1::2] + asc[::2][::-1]


def round_trips(costs: StageCosts) -> list[float]:
    """Per micro-batch: what stage 0 waits between its forward and its backward, the forwards and
    backwards of stages 1.. and the p2p both ways of every boundary."""
    pp = len(costs.fwd)
    return [
        sum(costs.fwd[q][m] + costs.bwd[q][m] for q in range(1, pp))
        + 2 * sum(costs.p2p[q][m] for q in range(pp - 1))
        for m in range(len(costs.fwd[0]))
    ]


def candidate_orders(plan: Plan, trip: list[float]) -> list[list[int]]:
    """The input order, its runs shaped (``_mountain``), and the shaped runs by ascending CP size."""
    runs = _runs(plan)
    shaped = [_mountain(r, trip) for r in runs]
    by_size = sorted(range(len(runs)), key=lambda k: (len(plan.micro_batches[runs[k][0]][0]), k))
    return [list(range(len(trip))), [i for r in shaped for i in r], [i for k in by_size for i in shaped[k]]]


def search_moves(runs: list[list[int]], trip: list[float]) -> list[tuple]:
    """The local search's moves over positions: for each run, the run with the longest round trip
    first, its last then its first member swapped with each inner one; then each pair of
    neighbouring runs swapped (``("runs", k)``: runs k and k + 1)."""
    moves: list[tuple] = []
    for run in sorted(runs, key=lambda r: (-max(trip[i] for i in r), r[0])):
        for j in run[1:-1]:
            moves += [("swap", run[-1], j), ("swap", run[0], j)]
    return moves + [("runs", k) for k in range(len(runs) - 1)]


def apply_move(order: list[int], move: tuple, runs: list[list[int]]) -> list[int]:
    """``order`` with ``move`` done (positions ``runs`` describe ``order``); a new list."""
    out = order[:]
    if move[0] == "swap":
        out[move[1]], out[move[2]] = order[move[2]], order[move[1]]
    else:
        a, b = runs[move[1]], runs[move[1] + 1]
        out[a[0] : b[-1] + 1] = order[b[0] : b[-1] + 1] + order[a[0] : a[-1] + 1]
    return out


def order_for_pipeline(
    plan: Plan,
    lengths,
    cost_model: CostModel,
    layers_per_stage: list[int],
    schedule: str = "1f1b",
    evals: int = 24,
    warmups: tuple[int, ...] = (),
    memory_cap: float | None = None,
) -> Plan:
    """``plan`` with its micro-batches reordered for ``len(layers_per_stage)`` stages (see the module
    docstring); ``predicted_step_s`` is its simulated pipeline step, ``info['pp_order']`` the
    permutation (new position -> old index), ``info['pp_evals']`` the replays it took. Under 1F1B,
    each of ``warmups`` (``Plan.pp_warmup``) is then tried on that order, one replay each beyond
    ``evals``, and kept where it is faster and fits: every stage p holds at most pp - p times
    ``memory_cap`` tokens a rank (plain 1F1B's memory at that cap; default the plan's cap). So the
    result never steps slower than the same call without ``warmups``."""
    t0 = time.perf_counter()
    pp = len(layers_per_stage)
    costs = stage_costs(plan, lengths, cost_model, layers_per_stage)
    trip = round_trips(costs)
    limit = plan.cap_tokens if memory_cap is None else memory_cap

    def reordered(order, warmup):
        return Plan(
            [plan.micro_batches[i] for i in order], plan.world_size, plan.cap_tokens, pp_warmup=warmup
        )

    def score(order, warmup):
        # the permuted costs are the reordered plan's (a replay, not a new pricing: speed only)
        sub, c = reordered(order, warmup), _permuted(costs, order)
        s = simulate_pipeline(sub, lengths, cost_model, layers_per_stage, schedule, costs=c, timeline=False)
        if warmup > 1 and any(held > (pp - p) * limit for p, held in enumerate(s.peak_tokens)):
            return float("inf")  # deeper than plain 1F1B's memory at the cap
        return s.step_s

    warmup = plan.pp_warmup
    best_s, _, best = min((score(o, warmup), k, o) for k, o in enumerate(candidate_orders(plan, trip)))
    used = NUM_CANDIDATES
    runs = _runs(reordered(best, warmup))
    for move in search_moves(runs, [trip[i] for i in best]):
        if used >= evals:
            break
        if move[0] == "runs" and move[1] + 1 >= len(runs):
            continue  # an accepted run swap joined two runs of one group: fewer runs now
        order = apply_move(best, move, runs)
        s = score(order, warmup)
        used += 1
        if s < best_s:  # strictly: each move is tried once, so no cycling on ties
            best_s, best = s, order
            runs = _runs(reordered(best, warmup))  # a run swap moved the later runs' positions
    for w in warmups if schedule == "1f1b" else ():  # on the searched order, beyond ``evals``
        if w != plan.pp_warmup:
            s = score(best, w)
            used += 1
            if s < best_s:
                best_s, warmup = s, w
    return Plan(
        reordered(best, warmup).micro_batches,
        plan.world_size,
        plan.cap_tokens,
        predicted_step_s=best_s,
        solver_ms=plan.solver_ms + (time.perf_counter() - t0) * 1e3,
        info={**plan.info, "pp_order": best, "pp_evals": used},
        pp_warmup=warmup,
    )


def plan_for_pipeline(
    lengths,
    ranks_per_stage: int,
    cap_tokens: float,
    cost_model: CostModel,
    layers_per_stage: list[int],
    schedule: str = "1f1b",
    evals: int = 24,
    cp_sizes=None,
) -> Plan:
    """Dynamic-CP under PP: the planner's plan with the allowed CP sizes (``cp_sizes``, default the
    planner's) and with those from a node up, at each of ``CAP_FRACTIONS`` of the cap, each ordered
    by ``order_for_pipeline``'s candidates alone and tried at ``WARMUPS`` within the memory of plain
    1F1B at ``cap_tokens``; the fastest gets the local search. ``cap_tokens`` stays the plan's cap."""
    from dynamic_cp.planning.planner import plan as dynamic_plan

    t0 = time.perf_counter()
    sizes = normalize_cp_sizes(ranks_per_stage, cp_sizes)
    node = min(cost_model.hw.gpus_per_node, ranks_per_stage)
    choices = [sizes]
    if any(c < node for c in sizes):
        choices.append(tuple(c for c in sizes if c >= node))
    best, first_error = None, None
    for cp in choices:
        for fraction in CAP_FRACTIONS:
            try:
                p = dynamic_plan(lengths, ranks_per_stage, cap_tokens * fraction, cost_model, cp)
            except ValueError as err:  # a clip too long for these sizes or this cap: not a candidate
                first_error = first_error or err
                continue
            quick = order_for_pipeline(
                p, lengths, cost_model, layers_per_stage, schedule, NUM_CANDIDATES, WARMUPS, cap_tokens
            )
            if best is None or quick.predicted_step_s < best[0].predicted_step_s:
                best = (quick, p)
    if best is None:
        raise first_error  # no candidate at all: the planner's own message (default sizes, full cap)
    # only the winner gets the local search; its warm-ups are retried on the searched order, which
    # can step slower at a deeper warm-up than the quick order did: keep the faster
    quick, p = best
    best = order_for_pipeline(p, lengths, cost_model, layers_per_stage, schedule, evals, WARMUPS, cap_tokens)
    if quick.predicted_step_s < best.predicted_step_s:
        best = quick
    best.cap_tokens = cap_tokens
    best.solver_ms = (time.perf_counter() - t0) * 1e3
    return best
