"""Replay a plan under the cost model: per-rank timelines, the step time, the lower bound, a Gantt chart.

Execution rules are the runtime's: every rank runs its micro-batches in plan order, and a micro-batch
starts when all of its ranks are free. A barrier (Megatron's scheduler only) makes every rank wait for
the slowest. The step time is the critical path: the last rank to finish. The gradient all-reduce at
the end of the step is the same for every plan and is left out.

Lower bound (DESIGN.md): the step cannot beat the larger of (a) all the work at best efficiency with
no communication or overhead, spread evenly over every rank, and (b) the largest clip alone at its
best feasible CP size. Efficiency = bound / step time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import normalize_cp_sizes
from dynamic_cp.planning.plan_types import Plan


@dataclass
class Schedule:
    """Simulated timeline: one (start, end, micro-batch index) list per rank."""

    step_s: float
    rank_segments: list[list[tuple[float, float, int]]]
    mb_times: list[float]

    def busy_fraction(self) -> float:
        busy = sum(e - s for segs in self.rank_segments for s, e, _ in segs)
        return busy / (self.step_s * len(self.rank_segments)) if self.step_s > 0 else 1.0


def spans_nodes(ranks, gpus_per_node: int) -> bool:
    """Whether the ranks sit on more than one node (node = rank // gpus_per_node), in any order.

    Node indices grow with the rank, so the lowest and the highest rank decide."""
    return min(ranks) // gpus_per_node != max(ranks) // gpus_per_node


def simulate(
    plan: Plan, lengths, cost_model: CostModel, barrier_s: float | None = None, timeline: bool = True
) -> Schedule:
    """Critical-path replay of ``plan``. ``barrier_s`` is the cost of one barrier (default: one
    inter-node collective latency). ``timeline=False`` skips the per-rank segments (faster)."""
    lengths = np.asarray(lengths)
    hw = cost_model.hw
    if barrier_s is None:
        barrier_s = hw.inter_node_latency_s if plan.world_size > hw.gpus_per_node else hw.intra_node_latency_s
    free = [0.0] * plan.world_size  # plain lists: micro-batches are small, numpy calls cost more
    segments: list[list[tuple[float, float, int]]] = [[] for _ in range(plan.world_size)]
    barriers = set(plan.barriers_after)
    all_ids = [s for _, ids in plan.micro_batches for s in ids]
    times = cost_model.flat_micro_batch_times(
        lengths[all_ids] if all_ids else np.zeros(0),
        [len(ids) for _, ids in plan.micro_batches],
        [len(r) for r, _ in plan.micro_batches],
        [spans_nodes(r, hw.gpus_per_node) for r, _ in plan.micro_batches],
    ).tolist()
    for i, (ranks, _) in enumerate(plan.micro_batches):
        t = times[i]
        start = max(free[r] for r in ranks)
        end = start + t
        for r in ranks:
            free[r] = end
        if timeline:
            for r in ranks:
                segments[r].append((start, end, i))
        if i in barriers:
            free = [max(free) + barrier_s] * plan.world_size
    return Schedule(max(free) if free else 0.0, segments, times)


def best_single_time(
    length: int, cost_model: CostModel, world_size: int, cap_tokens: float, cp_sizes=None
) -> float:
    """Fastest time of one clip alone over the CP sizes where it fits in memory."""
    best = np.inf
    for c in normalize_cp_sizes(world_size, cp_sizes):
        if length <= cap_tokens * c:
            best = min(best, cost_model.micro_batch_time([length], c))
    return float(best)


def lower_bound(lengths, cost_model: CostModel, world_size: int, cap_tokens: float, cp_sizes=None) -> float:
    """max(total ideal work / world size, largest clip at its best feasible CP size)."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return 0.0
    work = float(cost_model.ideal_time(lengths).sum()) / world_size
    longest = int(lengths.max())
    return max(work, best_single_time(longest, cost_model, world_size, cap_tokens, cp_sizes))


def gantt(schedule: Schedule, plan: Plan, lengths, path: str, title: str = "") -> None:
    """Per-rank Gantt chart PNG: one row per rank, one bar per micro-batch, coloured by CP size, a
    red line at each barrier (at the latest end of the micro-batches before it). See ``draw_gantt``."""
    rows = [
        [(s, e, len(plan.micro_batches[i][0]), False) for s, e, i in segs] for segs in schedule.rank_segments
    ]
    lines = []
    for b in plan.barriers_after:
        ends = [e for segs in schedule.rank_segments for s, e, i in segs if i <= b]
        if ends:
            lines.append(max(ends))
    title = title or f"step {schedule.step_s:.3f} s on {plan.world_size} ranks"
    draw_gantt(rows, [str(r) for r in range(plan.world_size)], schedule.step_s, lines, path, title, "rank")


def draw_gantt(rows, labels, step_s: float, lines, path: str, title: str, ylabel: str) -> None:
    """Gantt PNG: ``rows[i]`` = (start, end, CP size, light) bars of row i, colour by CP size, light
    bars (pipeline forwards) at 45% opacity; red vertical ``lines``.

    Row 0 is the top row; bars are centred on their row, thinner than it; the x axis spans the step;
    the legend (one entry per CP size) sits centred under the axes. Every row is labelled up to 32
    rows, beyond that matplotlib picks the ticks. The image is 12 in x 110 dpi = 1320 px wide and
    0.22 in per row plus 1.5 in for the axis and legend tall, clamped to 3-13.5 in (330-1485 px), so
    rows stay readable and the file bounded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(rows)
    sizes = sorted({bar[2] for row in rows for bar in row})
    cmap = plt.get_cmap("viridis", max(len(sizes), 2))
    color = {c: cmap(i) for i, c in enumerate(sizes)}
    fig, ax = plt.subplots(figsize=(12, max(3.0, min(0.22 * n, 12.0) + 1.5)))
    for r, row in enumerate(rows):
        bars = [(s, e - s) for s, e, _, _ in row]
        cols = [(*color[c][:3], 0.45 if light else 1.0) for _, _, c, light in row]
        ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=cols, edgecolor="white", linewidth=0.4)
    for x in lines:
        ax.axvline(x, color="red", linewidth=0.6, alpha=0.6)
    ax.set_ylim(-0.6, n - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, step_s * 1.02)
    ax.set_xlabel("seconds into the step")
    ax.set_ylabel(ylabel)
    if n <= 32:
        ax.set_yticks(range(n), labels)
    ax.set_title(title)
    ax.legend(
        handles=[Patch(color=color[c], label=f"CP {c}") for c in sizes],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=len(sizes),
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
