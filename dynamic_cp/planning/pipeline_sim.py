"""Replay a Dynamic-CP plan on pipeline stages: per-stage timelines, the step, the bubble and a bound.

The world is ``pp`` stages of R ranks (``pipeline_stages``); the plan is over R ranks and every stage
runs it. Stage p runs the ops of ``pipeline_schedule.stage_ops`` and each rank the subsequence naming
it (``rank_ops``), exactly as the runtime does. An op (stage p, kind, micro-batch m) starts when

    - every rank of m's CP group on stage p has finished its previous op (the op is a collective),
    - its input has arrived: F needs F of m on stage p-1, B needs B of m on stage p+1 (the last
      stage's B needs its own F), each plus the p2p time of that boundary.

Times come from the one cost model. A micro-batch's fwd+bwd time T (``flat_micro_batch_times``) is
split into forward F = the cost model's forward-only price (``CostModel.forward()``: linear and
attention at forward FLOPs, the forward's collectives, a third of the overhead) and backward T - F;
roughly 1:2, as the FLOPs give (linear backward 2x forward, attention 2.5x). Stage p gets the share
(blocks_p + extra_p) / (blocks + extras) of both, the extras being the patch embedding (first stage)
and the output projection (last) in block units (``stage_extras``), so the stages sum to T and one
stage replays ``simulator.simulate`` exactly. Sends are asynchronous (the sender goes on); the p2p
of boundary p -> p+1 carries each rank's hidden states (tokens / c x d) and its clips' context
embeddings (context tokens x d per clip), bf16, over the inter-node link when stage p's rank and
stage p+1's rank sit on different nodes (one latency per send). Backward sends the gradient: the
same bytes.

Step = max over stages of (the stage's last op + its gradient all-reduce over its R ranks, fp32 of
the stage's parameters, ``fsdp_cost.collective_s``): a later stage finishes its backwards first and
reduces while the earlier ones drain. Bubble fraction = 1 - busy rank-seconds / (pp R x the last
op's end): idle time of every kind (fill, drain, waiting on CP peers), gradient sync excluded.

Megatron's barriers: its groups run one after another with a barrier over every rank between them,
so under PP each group is its own pipeline (``stage_ops`` over the group, a flush after it).

Lower bound over every order of the plan's micro-batches under the schedule (``order_lower_bound``),
see docs/planner.md "Pipeline stages: planning": rank r of stage p cannot start before its first
micro-batch i has crossed stages 0..p-1 (head_i), must do all its work W_pr, and after its last op
(the backward of its last micro-batch j, not i when it runs two or more) that backward must cross
stages p-1..0 (tail_j). Between the forward and the backward of i on stage p lies i's round trip
through the later stages (trip_i), and the rank can fill it with at most `lead` of its other
forwards (1F1B: the warm-up, ``Plan.pp_warmup`` x (pp - p - 1); GPipe: all); likewise j's round
trip with at most `lead` of its other backwards. So, with fill_i = max(0, trip_i - the `lead` largest other forwards) and drain_j alike,

    step >= W_pr + min over i != j of head_i + fill_i + drain_j + max(tail_j, sync_p)

the two waits adding when the rank's first backward precedes its last forward (1F1B with more than
lead + 1 micro-batches), else only the larger; the bound is the largest over (p, r).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dit.flops import linear_flops_per_token, patch_flops_per_token
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.fsdp_cost import BYTES_FP32, collective_s
from dynamic_cp.planning.memory import BYTES_BF16
from dynamic_cp.planning.model_dims import ModelDims
from dynamic_cp.planning.pipeline_memory import stage_params
from dynamic_cp.planning.pipeline_schedule import stage_ops
from dynamic_cp.planning.pipeline_stages import stage_layers
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.simulator import spans_nodes


def stage_extras(dims: ModelDims) -> tuple[float, float]:
    """(first, last) stage's work outside the blocks, in block units: the patch embedding and the
    output projection, half of the patch FLOPs each (``dit.flops``)."""
    ratio = patch_flops_per_token(dims.d, dims.patch_values) / linear_flops_per_token(dims.d, dims.ffn)
    return ratio / 2, ratio / 2


def default_stage_layers(dims: ModelDims, pp: int) -> list[int]:
    """``parallel.pp_layers: null``: the least-bottleneck split with the extras of ``stage_extras``."""
    return stage_layers(dims.layers, pp, *stage_extras(dims))


def stage_shares(dims: ModelDims, layers_per_stage: list[int]) -> list[float]:
    """Fraction of a micro-batch's time each stage spends; they sum to 1."""
    if sum(layers_per_stage) != dims.layers or min(layers_per_stage) < 1:
        raise ValueError(
            f"pipeline layers {layers_per_stage} must be positive and sum to the model's {dims.layers} "
            "blocks; fix parallel.pp_layers (or leave it null)"
        )
    first, last = stage_extras(dims)
    work = [float(n) for n in layers_per_stage]
    work[0] += first
    work[-1] += last
    total = sum(work)
    return [w / total for w in work]


@dataclass
class StageCosts:
    """Seconds per stage per micro-batch (``fwd[p][m]``, ``bwd[p][m]``), per boundary p -> p+1
    (``p2p[p][m]``, one way), and each stage's gradient all-reduce (``sync[p]``)."""

    fwd: list[list[float]]
    bwd: list[list[float]]
    p2p: list[list[float]]
    sync: list[float]


def stage_costs(plan: Plan, lengths, cm: CostModel, layers_per_stage: list[int]) -> StageCosts:
    """The cost model's times of ``plan`` split over the stages (see the module docstring)."""
    lengths = np.asarray(lengths)
    pp, R, hw, dims = len(layers_per_stage), plan.world_size, cm.hw, cm.dims
    shares = stage_shares(dims, layers_per_stage)
    mbs = plan.micro_batches
    ids = [s for _, m in mbs for s in m]
    flat = lengths[ids]  # an empty index list gives an empty array
    counts = [len(m) for _, m in mbs]
    cps = [len(r) for r, _ in mbs]
    cross = [spans_nodes(r, hw.gpus_per_node) for r, _ in mbs]
    total = cm.flat_micro_batch_times(flat, counts, cps, cross)
    # forward < total: each term of the forward is at most half the training one but the ring's
    # exposed part, which exceeds its training share by under A/6 (A: forward attention seconds)
    fwd = cm.forward().flat_micro_batch_times(flat, counts, cps, cross)
    bwd = total - fwd
    p2p = []
    for p in range(pp - 1):
        row = []
        for (ranks, m), c in zip(mbs, cps):
            nbytes = (
                (sum(int(lengths[s]) for s in m) / c + len(m) * dims.context_tokens) * dims.d * BYTES_BF16
            )
            far = any((p * R + r) // hw.gpus_per_node != ((p + 1) * R + r) // hw.gpus_per_node for r in ranks)
            bw, lat = (hw.inter_node_bandwidth, hw.inter_node_latency_s) if far else (
                hw.intra_node_bandwidth, hw.intra_node_latency_s)  # fmt: skip
            row.append(lat + nbytes / bw)
        p2p.append(row)
    sync = []
    for p, n in enumerate(layers_per_stage):
        params = stage_params(dims, layers_per_stage, p)
        sync.append(2 * collective_s(BYTES_FP32 * params, R, cm, n))  # reduce-scatter + all-gather
    return StageCosts([(fwd * s).tolist() for s in shares], [(bwd * s).tolist() for s in shares], p2p, sync)


@dataclass
class PipelineSchedule:
    """Simulated pipeline: ``segments[p][r]`` = (start, end, micro-batch, 'F' or 'B') in run order."""

    step_s: float
    compute_s: float  # the last op's end (no gradient sync)
    stage_end: list[float]
    segments: list[list[list[tuple[float, float, int, str]]]]
    busy_s: float  # rank-seconds of ops, all stages
    peak_tokens: list[float]  # per stage: most activation tokens a rank holds at once

    def bubble_fraction(self) -> float:
        ranks = sum(len(s) for s in self.segments)
        return 1.0 - self.busy_s / (ranks * self.compute_s) if self.compute_s > 0 else 0.0


def _segments_of(plan: Plan) -> list[range]:
    """Barrier-separated runs of micro-batches (one run without barriers)."""
    n = len(plan.micro_batches)
    edges = [0, *sorted({b + 1 for b in plan.barriers_after if 0 <= b < n - 1}), n]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def pipeline_ops(plan: Plan, pp: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Every stage's op order: ``stage_ops`` over the plan, or over each barrier-separated run."""
    out: list[list[tuple[str, int]]] = [[] for _ in range(pp)]
    for seg in _segments_of(plan):
        for p in range(pp):
            out[p] += [(k, m + seg.start) for k, m in stage_ops(len(seg), pp, p, schedule, plan.pp_warmup)]
    return out


def _rank_classes(plan: Plan) -> list[int]:
    """Per rank, an id shared by exactly the ranks that run the same micro-batches."""
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(tuple(ms), len(ids)) for ms in plan.per_rank()]


def simulate_pipeline(
    plan: Plan,
    lengths,
    cm: CostModel,
    layers_per_stage: list[int],
    schedule: str = "1f1b",
    barrier_s: float | None = None,
    costs: StageCosts | None = None,
    timeline: bool = True,
) -> PipelineSchedule:
    """Event replay of ``plan`` on ``len(layers_per_stage)`` stages; see the module docstring.
    ``timeline=False`` leaves ``segments`` empty (faster: the order search only needs the step)."""
    pp, R, mbs = len(layers_per_stage), plan.world_size, plan.micro_batches
    c = costs or stage_costs(plan, lengths, cm, layers_per_stage)
    if barrier_s is None:
        far = pp * R > cm.hw.gpus_per_node
        barrier_s = cm.hw.inter_node_latency_s if far else cm.hw.intra_node_latency_s
    tokens = [sum(int(lengths[s]) for s in m) / len(r) for r, m in mbs]
    # ranks that run the same micro-batches keep the same clock: replay one of each (speed only)
    cls = _rank_classes(plan)
    C = max(cls) + 1
    groups = [sorted({cls[r] for r in ranks}) for ranks, _ in mbs]
    free = [[0.0] * C for _ in range(pp)]
    held, peak = [[0.0] * C for _ in range(pp)], [0.0] * pp
    done = {"F": [[None] * len(mbs) for _ in range(pp)], "B": [[None] * len(mbs) for _ in range(pp)]}
    segs_of = [[[] for _ in range(C)] for _ in range(pp)]
    busy = 0.0
    segs = _segments_of(plan)
    for k, seg in enumerate(segs):
        ops = [
            [(k, m + seg.start) for k, m in stage_ops(len(seg), pp, p, schedule, plan.pp_warmup)]
            for p in range(pp)
        ]
        pos = [0] * pp
        while any(pos[p] < len(ops[p]) for p in range(pp)):
            progressed = False
            for p in range(pp):
                stage_free, stage_held, stage_segs = free[p], held[p], segs_of[p]
                while pos[p] < len(ops[p]):
                    kind, m = ops[p][pos[p]]
                    if kind == "F" and p == 0:
                        ready = 0.0
                    else:
                        if kind == "F":
                            dep, delay = done["F"][p - 1][m], c.p2p[p - 1][m]
                        elif p < pp - 1:
                            dep, delay = done["B"][p + 1][m], c.p2p[p][m]
                        else:
                            dep, delay = done["F"][p][m], 0.0  # the last stage turns round in place
                        if dep is None:
                            break
                        ready = dep + delay
                    start = ready
                    for g in groups[m]:
                        if stage_free[g] > start:
                            start = stage_free[g]
                    dur = (c.fwd if kind == "F" else c.bwd)[p][m]
                    t = done[kind][p][m] = start + dur
                    busy += dur * len(mbs[m][0])
                    add = tokens[m] if kind == "F" else -tokens[m]
                    for g in groups[m]:
                        stage_free[g] = t
                        if timeline:
                            stage_segs[g].append((start, t, m, kind))
                        stage_held[g] += add
                        if stage_held[g] > peak[p]:
                            peak[p] = stage_held[g]
                    pos[p] += 1
                    progressed = True
            if not progressed:  # pragma: no cover - stage_ops is deadlock-free (test_pipeline_schedule)
                raise RuntimeError("pipeline schedule deadlocked")
        if k < len(segs) - 1:  # a barrier between runs, none after the last
            t = max(max(f) for f in free) + barrier_s
            free = [[t] * C for _ in range(pp)]
    segments = [[list(stage[cls[r]]) for r in range(R)] for stage in segs_of]
    stage_end = [max(f) for f in free] if mbs else [0.0] * pp
    compute = max(stage_end)
    step = max(e + s for e, s in zip(stage_end, c.sync)) if mbs else 0.0
    return PipelineSchedule(step, compute, stage_end, segments, busy, peak)


def order_lower_bound(plan: Plan, costs: StageCosts, schedule: str = "1f1b") -> float:
    """No order of ``plan``'s micro-batches (same groups, this ``stage_ops`` schedule) steps faster;
    see the module docstring for the derivation. Barriers only add time, so they are left out."""
    cls = _rank_classes(plan)
    runs = {cls[r]: ms for r, ms in enumerate(plan.per_rank()) if ms}  # one rank of each class: its own
    return max(
        (
            _rank_bound(costs, p, ms, schedule, plan.pp_warmup)
            for p in range(len(costs.fwd))
            for ms in runs.values()
        ),
        default=0.0,
    )


def _rank_bound(costs: StageCosts, p: int, ms: list[int], schedule: str, warmup: int) -> float:
    """The bound of one rank of stage ``p`` running micro-batches ``ms`` (module docstring)."""
    pp, n = len(costs.fwd), len(ms)
    f, b = costs.fwd[p], costs.bwd[p]
    head = {m: sum(costs.fwd[q][m] + costs.p2p[q][m] for q in range(p)) for m in ms}
    tail = {m: max(sum(costs.bwd[q][m] + costs.p2p[q][m] for q in range(p)), costs.sync[p]) for m in ms}
    trip = {
        m: sum(costs.fwd[q][m] + costs.bwd[q][m] for q in range(p + 1, pp))
        + 2 * sum(costs.p2p[q][m] for q in range(p, pp - 1))
        for m in ms
    }
    # at most `lead` of the rank's other forwards run between F(m) and B(m) of its first m, and at
    # most `lead` other backwards between F(m) and B(m) of its last: 1F1B's warm-up, GPipe's all
    lead = warmup * (pp - p - 1) if schedule == "1f1b" else n - 1

    def covered(row, m):  # the most `lead` of the other micro-batches' `row` can cover
        top = sorted((row[i] for i in ms if i != m), reverse=True)
        return sum(top[:lead])

    fill = {m: max(0.0, trip[m] - covered(f, m)) for m in ms}
    drain = {m: max(0.0, trip[m] - covered(b, m)) for m in ms}
    work = sum(f[m] + b[m] for m in ms)
    if n == 1:  # its one forward waits its own round trip, then its backward
        (m,) = ms
        return head[m] + work + fill[m] + tail[m]
    # the first and the last micro-batch differ; their waits are disjoint idle spans once the rank's
    # first backward precedes its last forward (n > lead + 1), else only the larger one counts
    if n > lead + 1:
        starts = sorted((head[m] + fill[m], m) for m in ms)[:2]
        ends = sorted((drain[m] + tail[m], m) for m in ms)[:2]
        return work + min(a + e for a, i in starts for e, j in ends if i != j)
    return work + min(head[i] + max(fill[i], drain[j]) + tail[j] for i in ms for j in ms if i != j)


def gantt_pipeline(sched: PipelineSchedule, plan: Plan, path: str, title: str = "") -> None:
    """Gantt PNG with one row per (stage, rank), stage 0 on top; forwards light, backwards dark."""
    from dynamic_cp.planning.simulator import draw_gantt

    rows, labels = [], []
    for p, stage in enumerate(sched.segments):
        for r, segs in enumerate(stage):
            rows.append([(s, e, len(plan.micro_batches[m][0]), kind == "F") for s, e, m, kind in segs])
            labels.append(f"s{p} r{r}")
    draw_gantt(rows, labels, sched.step_s, [], path, title or f"step {sched.step_s:.3f} s", "stage, rank")
