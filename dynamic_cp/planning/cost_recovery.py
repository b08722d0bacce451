"""Recovery from a wrong prior, simulated: plan with a wrong cost model, learn the true one online.

A synthetic "true" cluster (``true_cluster``: links 2-4x slower, other efficiency curves and
overheads than the prior) executes every planned micro-batch; the fit sees its timings (seconds and
collective seconds, with multiplicative noise) exactly as the runtime would, and the planner uses
each refit from the next step on. Each step's plan is scored under the *true* model against the true
lower bound, next to the plan the true model itself would make. ``bench/bench_cost_recovery.py``
prints the table; ``tests/test_cost_fit.py`` checks one cell.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from dynamic_cp.planning.cost_fit import Observation
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.planner import plan as dynamic_plan
from dynamic_cp.planning.simulator import lower_bound, simulate, spans_nodes
from dynamic_cp.planning.workloads import workload


def layout_times(model: CostModel, lengths, cp: int, layout, cross: bool) -> tuple[float, float]:
    """(seconds, exposed comm seconds) of a micro-batch run in ``layout`` (not necessarily the
    cheapest one, as exploration may force): what ``model`` says the hardware would measure."""
    total = model.micro_batch_time(lengths, cp, cross)
    if cp <= 1:
        return total, 0.0
    L = np.asarray(lengths, dtype=np.float64)
    layouts, times = model._layout_times(L.sum(), cp, model._attn_time(L, cp).sum(), cross)
    comm = float(times[layouts.index(tuple(layout))])
    return total - float(times.min()) + comm, comm


def true_cluster(prior: CostModel, link_slowdown: float = 3.0) -> CostModel:
    """The prior's GPUs on a worse cluster: links ``link_slowdown``x slower (2-4x), other GEMM and
    attention efficiency curves, slower launches and collective calls."""
    hw = prior.hw
    true = replace(
        hw,
        name=f"true-{hw.name}",
        intra_node_bandwidth=hw.intra_node_bandwidth / link_slowdown,
        inter_node_bandwidth=hw.inter_node_bandwidth / (link_slowdown * 1.3),
        intra_node_latency_s=hw.intra_node_latency_s * 2,
        inter_node_latency_s=hw.inter_node_latency_s * 3,
        gemm_efficiency=hw.gemm_efficiency * 0.75,
        gemm_half_tokens=hw.gemm_half_tokens * 2.5,
        attention_efficiency=hw.attention_efficiency * 0.7,
        attention_half_tokens=hw.attention_half_tokens * 3,
        micro_batch_overhead_s=hw.micro_batch_overhead_s * 2,
    )
    return CostModel(prior.dims, true, prior.comm)


def observe(
    plan: Plan, lengths, planner_model: CostModel, true: CostModel, rng, noise: float
) -> list[Observation]:
    """What the runtime would measure of ``plan`` on the true cluster: each micro-batch in the
    layout the planning model chose, its seconds and collective seconds times (1 + noise * N(0, 1))."""
    gpn = true.hw.gpus_per_node
    out = []
    for ranks, ids in plan.micro_batches:
        L = [int(lengths[i]) for i in ids]
        cross = spans_nodes(ranks, gpn)
        layout = planner_model.layout(L, len(ranks), cross)
        secs, comm = layout_times(true, L, len(ranks), layout, cross)
        f = max(1.0 + noise * rng.standard_normal(), 0.5)
        out.append(Observation(tuple(L), len(ranks), layout, cross, secs * f, comm * f))
    return out


@dataclass
class RecoveryStep:
    step: int
    efficiency: float  # true lower bound / true step time of the plan from the learned model
    efficiency_true: float  # the same for the plan the true model makes
    prediction_error: float  # |predicted - true| / true step time of the learned plan


def recover(
    workload_name: str,
    world_size: int,
    prior: CostModel,
    true: CostModel,
    steps: int = 20,
    samples_per_gpu: float = 4.0,
    refit_every: int = 1,
    noise: float = 0.05,
    seed: int = 0,
) -> list[RecoveryStep]:
    """Plan ``steps`` global batches from ``prior``, learning from the true cluster's timings."""
    rng = np.random.default_rng(seed)
    cap = true.token_cap(shard_world=world_size)
    model, seen, out = prior, [], []
    n = max(1, int(round(samples_per_gpu * world_size)))
    for s in range(steps):
        lengths = workload(workload_name, n, seed=seed * 1000 + s)
        p = dynamic_plan(lengths, world_size, cap, model)
        ref = dynamic_plan(lengths, world_size, cap, true)
        bound = lower_bound(lengths, true, world_size, cap)
        step_s = simulate(p, lengths, true, timeline=False).step_s
        out.append(
            RecoveryStep(
                s,
                bound / step_s,
                bound / simulate(ref, lengths, true, timeline=False).step_s,
                abs(p.predicted_step_s - step_s) / step_s,
            )
        )
        seen.extend(observe(p, lengths, model, true, rng, noise))
        if (s + 1) % refit_every == 0:
            model = prior.fit(seen[-1024:])
    return out
