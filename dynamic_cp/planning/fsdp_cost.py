"""Step time of a plan under a weight-sharding mode: the plan's compute plus the weight collectives.

Weight collectives run over all W ranks (ring all-gather / reduce-scatter: each rank moves
(W - 1) / W of the buffer), at the intra-node bandwidth when W fits in one node, else the
inter-node one. P parameters, L layers:

    none       the barrier-free plan, then an fp32 gradient all-reduce (8P bytes: reduce-scatter +
               all-gather of 4P). ``simulate`` leaves it out because it is the same for every plan;
               here it is counted so that modes compare like for like.
    per_step   one bf16 gather (2P) at step start, the barrier-free plan, one fp32 reduce-scatter (4P)
               at step end: every rank issues the same collectives once, whatever its micro-batches.
    per_layer  lockstep rounds (``rounds.py``). In each round every layer is gathered for forward (2P
               over the round), again for backward (2P, resharded after forward) and its gradient
               reduce-scattered (4P). FSDP2 prefetches the next layer while this one computes, so a
               round costs max(slowest micro-batch in it, its weight traffic) plus one layer's
               traffic that cannot hide (the first gather, the last reduce-scatter). Ranks without
               a micro-batch in a round still join its collectives (an empty micro-batch).

This is a model: the CP all-to-alls of the micro-batches share links with the weight traffic and
are not charged for the contention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.memory import FSDP_MODES
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.rounds import lockstep_rounds
from dynamic_cp.planning.simulator import lower_bound, simulate, spans_nodes

BYTES_FP32 = 4
BYTES_BF16 = 2


def collective_s(nbytes: float, world_size: int, cm: CostModel, calls: int = 1) -> float:
    """Seconds for a ring all-gather or reduce-scatter of a ``nbytes`` (full, unsharded) buffer over
    ``world_size`` ranks, issued as ``calls`` collectives (one latency each)."""
    if world_size <= 1:
        return 0.0
    hw = cm.hw
    far = world_size > hw.gpus_per_node
    bw = hw.inter_node_bandwidth if far else hw.intra_node_bandwidth
    lat = hw.inter_node_latency_s if far else hw.intra_node_latency_s
    return calls * lat + nbytes * (world_size - 1) / world_size / bw


@dataclass(frozen=True)
class WeightTraffic:
    """Seconds of weight collectives per mode for one model on W ranks."""

    gather_s: float  # bf16 weights, all layers
    reduce_scatter_s: float  # fp32 gradients, all layers
    layers: int

    @classmethod
    def of(cls, cm: CostModel, world_size: int) -> WeightTraffic:
        P, L = float(cm.dims.num_params), cm.dims.layers
        return cls(
            collective_s(BYTES_BF16 * P, world_size, cm, L),
            collective_s(BYTES_FP32 * P, world_size, cm, L),
            L,
        )

    @property
    def all_reduce_s(self) -> float:
        return 2 * self.reduce_scatter_s

    @property
    def round_s(self) -> float:
        """per_layer weight traffic of one round: gather for forward and backward, reduce-scatter."""
        return 2 * self.gather_s + self.reduce_scatter_s

    def per_layer_round(self, slowest_s: float) -> float:
        return max(slowest_s, self.round_s) + self.round_s / self.layers

    def fixed_s(self, mode: str) -> float:
        """Collective seconds per step outside the micro-batches (none, per_step)."""
        if mode == "none":
            return self.all_reduce_s
        if mode == "per_step":
            return self.gather_s + self.reduce_scatter_s
        raise ValueError(f"mode {mode!r} has no fixed per-step traffic; per_layer is priced per round")


@dataclass
class ModeSchedule:
    """A plan priced under a sharding mode."""

    mode: str
    step_s: float
    compute_s: float  # the plan's critical path (none, per_step) or sum of round maxima (per_layer)
    comm_s: float  # weight collectives charged on top
    num_rounds: int = 0


def round_maxima(plan: Plan, lengths, cm: CostModel) -> list[float]:
    """Slowest micro-batch of each round (``plan.rounds`` must be set)."""
    lengths = np.asarray(lengths)
    hw = cm.hw
    all_ids = [s for _, ids in plan.micro_batches for s in ids]
    times = cm.flat_micro_batch_times(
        lengths[all_ids] if all_ids else np.zeros(0),
        [len(ids) for _, ids in plan.micro_batches],
        [len(r) for r, _ in plan.micro_batches],
        [spans_nodes(r, hw.gpus_per_node) for r, _ in plan.micro_batches],
    )
    return [float(max((times[i] for i in members), default=0.0)) for members in plan.rounds]


def simulate_mode(plan: Plan, lengths, cm: CostModel, mode: str) -> ModeSchedule:
    """Price ``plan`` under ``mode`` (see the module docstring). For per_layer, ``plan.rounds`` is
    used when set, else the plan's greedy lockstep rounds."""
    if mode not in FSDP_MODES:
        raise ValueError(f"fsdp mode {mode!r}; use one of {FSDP_MODES}")
    traffic = WeightTraffic.of(cm, plan.world_size)
    if mode != "per_layer":
        compute = simulate(plan, lengths, cm, timeline=False).step_s
        fixed = traffic.fixed_s(mode)
        return ModeSchedule(mode, compute + fixed, compute, fixed)
    if plan.rounds is None:
        plan = lockstep_rounds(plan, plan.world_size)
    maxima = round_maxima(plan, lengths, cm)
    step = sum(traffic.per_layer_round(m) for m in maxima)
    compute = sum(maxima)
    return ModeSchedule(mode, step, compute, step - compute, len(maxima))


def mode_lower_bound(lengths, cm: CostModel, world_size: int, cap_tokens: float, mode: str) -> float:
    """``simulator.lower_bound`` plus the traffic no plan avoids: the step-end collectives (none,
    per_step), or for per_layer at least K = ceil(tokens / (W * cap)) rounds, since a round holds at
    most cap tokens per rank: sum_k max(s_k, c) >= max(sum_k s_k, K c), plus K exposed layers."""
    bound = lower_bound(lengths, cm, world_size, cap_tokens)
    traffic = WeightTraffic.of(cm, world_size)
    if mode == "per_layer":
        total = float(np.sum(np.asarray(lengths, dtype=np.float64)))
        k = max(1, math.ceil(total / (world_size * cap_tokens) - 1e-9)) if total else 0
        return max(bound, k * traffic.round_s) + k * traffic.round_s / traffic.layers
    return bound + traffic.fixed_s(mode)
