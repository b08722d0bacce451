"""Every planner under the same pipeline stages: step, bubble, memory per GPU and each plan's bound.

Used by ``python -m dynamic_cp.simulate --pp N``. The world is pp stages of R = W / pp ranks; every
method plans the global batch over R ranks under the same per-rank token cap (``memory.
pipeline_token_cap``: 1F1B's pp - stage micro-batches in flight on the stage's blocks), and every
plan is replayed by ``pipeline_sim.simulate_pipeline``: static CP and static-balanced CP in their
own order, Megatron's scheduler with its barriers (each group its own pipeline), Dynamic-CP by
``pipeline_order.plan_for_pipeline`` (CP sizes, pack size and order chosen for the pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dynamic_cp.planning.compare import METHODS, run_method
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.pipeline_memory import stage_memory
from dynamic_cp.planning.pipeline_order import plan_for_pipeline
from dynamic_cp.planning.pipeline_sim import (
    PipelineSchedule,
    order_lower_bound,
    simulate_pipeline,
    stage_costs,
)
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.simulator import best_single_time


@dataclass
class PipeRow:
    method: str
    step_s: float = float("nan")
    bubble: float = float("nan")
    stage_bytes: list = field(default_factory=list)  # per stage: states + peak activations per GPU
    bound_s: float = float("nan")  # no order of this plan's micro-batches is faster
    solver_ms: float = float("nan")
    cp_sizes: dict = field(default_factory=dict)
    plan: Plan | None = None
    schedule: PipelineSchedule | None = None
    error: str = ""

    @property
    def gb_per_gpu(self) -> float:
        return max(self.stage_bytes) / 1e9 if self.stage_bytes else float("nan")


def work_bound(lengths, cm: CostModel, pp: int, ranks_per_stage: int, cap: float) -> float:
    """Bound for any plan and order: all the ideal work over every GPU, or the longest clip alone at
    its best CP size within a stage (its stages run one after another, so at least its whole time)."""
    L = np.asarray(lengths)
    work = float(cm.ideal_time(L).sum()) / (pp * ranks_per_stage)
    return max(work, best_single_time(int(L.max()), cm, ranks_per_stage, cap))


def pipeline_row(
    method: str, p: Plan, lengths, cm: CostModel, layers: list[int], schedule: str, shard: int, ckpt: bool
) -> PipeRow:
    """Replay ``p`` and fill its row: step, bubble, per-stage memory and the order bound."""
    costs = stage_costs(p, lengths, cm, layers)
    s = simulate_pipeline(p, lengths, cm, layers, schedule, costs=costs)
    mem = []
    for stage, tokens in enumerate(s.peak_tokens):
        states, act = stage_memory(cm.dims, layers, stage, shard, ckpt)
        mem.append(states + tokens * act)
    return PipeRow(
        method, s.step_s, s.bubble_fraction(), mem, order_lower_bound(p, costs, schedule), p.solver_ms,
        p.cp_histogram(), p, s,
    )  # fmt: skip


def compare_pipeline(
    lengths,
    pp: int,
    ranks_per_stage: int,
    cap: float,
    cm: CostModel,
    layers: list[int],
    schedule: str = "1f1b",
    ckpt: bool = False,
    methods=METHODS,
) -> list[PipeRow]:
    rows = []
    for m in methods:
        try:
            if m == "dynamic-cp":
                p = plan_for_pipeline(lengths, ranks_per_stage, cap, cm, layers, schedule)
            else:
                p = run_method(m, lengths, ranks_per_stage, cap, cm)
        except Exception as e:  # a baseline's own failure is a result worth showing
            rows.append(PipeRow(m, error=repr(e)[:120]))
            continue
        rows.append(pipeline_row(m, p, lengths, cm, layers, schedule, ranks_per_stage, ckpt))
    return rows


def format_pipeline_rows(
    rows: list[PipeRow], bound: float, memory_bytes: float, fraction: float = 0.9
) -> str:
    static = next((r.step_s for r in rows if r.method == "static"), float("nan"))
    lines = [
        f"work bound {bound:.3f} s (any plan, any order); order bound: no order of that plan's micro-batches is faster",
        f"{'method':<16} {'step s':>8} {'vs static':>9} {'bubble':>7} {'GB/GPU':>7} {'fits':>4} "
        f"{'order bd':>8} {'gap':>6} {'solver ms':>9}  cp sizes",
    ]
    for r in rows:
        if r.error:
            lines.append(f"{r.method:<16} failed: {r.error}")
            continue
        sizes = " ".join(f"{c}:{n}" for c, n in r.cp_sizes.items())
        fits = "yes" if max(r.stage_bytes) <= memory_bytes * fraction else "no"
        lines.append(
            f"{r.method:<16} {r.step_s:>8.3f} {static / r.step_s:>8.2f}x {r.bubble:>7.3f} {r.gb_per_gpu:>7.1f} "
            f"{fits:>4} {r.bound_s:>8.3f} {r.step_s / r.bound_s - 1:>6.1%} {r.solver_ms:>9.1f}  {sizes}"
        )
    dyn = next((r for r in rows if r.method == "dynamic-cp" and not r.error), None)
    if dyn is not None:
        per_stage = ", ".join(f"stage {p} {b / 1e9:.1f}" for p, b in enumerate(dyn.stage_bytes))
        warmup = dyn.plan.pp_warmup
        lines.append(f"dynamic-cp GB per GPU by stage: {per_stage}; 1F1B warm-up {warmup} x (pp - stage - 1)")
    return "\n".join(lines)
