"""``CostModel.fit``: features equal the model's formulas, the fit recovers a known cluster, terms the
data do not determine keep their prior, outliers do not drag it, and online learning recovers the
planning efficiency of the true model (simulation, ``cost_recovery``)."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest

from dynamic_cp.planning.cost_fit import Observation, Shape, comm_features, compute_features
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.cost_recovery import layout_times, recover, true_cluster

PRIOR = CostModel.from_name("wan-1.3b", "h100")
TRUE = true_cluster(PRIOR, link_slowdown=3.0)


def _shape(cm: CostModel) -> Shape:
    return Shape(
        cm.dims.d,
        cm.dims.layers,
        cm.dims.text_tokens,
        cm._lin_per_token,
        cm._text_per_clip,
        cm._attn_coef,
        cm.hw.gpus_per_node,
    )


def _observations(model: CostModel, n: int, seed: int, noise: float = 0.03, sizes=(1, 2, 4, 8, 16)):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cp = int(rng.choice(sizes))
        L = [int(x) for x in rng.integers(300, 40000, size=int(rng.integers(1, 5)))]
        cross = cp > model.hw.gpus_per_node
        layouts = model.cp_layout(cp)
        layout = layouts[int(rng.integers(len(layouts)))]  # every layout, as exploration runs them
        secs, comm = layout_times(model, L, cp, layout, cross)
        f = 1 + noise * rng.standard_normal()
        out.append(Observation(tuple(L), cp, layout, cross, secs * f, comm * f))
    return out


def test_features_reproduce_the_cost_model():
    """Features x terms == micro_batch_time: the fit solves for the planner's own formulas."""
    hw = TRUE.hw
    shape = _shape(TRUE)
    inv_gemm = 1 / (hw.peak_flops * hw.gemm_efficiency)
    inv_attn = 1 / (hw.peak_flops * hw.attention_efficiency)
    rng = np.random.default_rng(0)
    for _ in range(20):
        L = tuple(int(x) for x in rng.integers(1, 50000, size=int(rng.integers(1, 6))))
        obs = Observation(L, 1, (1, 1), False, 1.0)
        f = compute_features([obs], shape, hw.gemm_half_tokens, hw.attention_half_tokens)[0]
        pred = f @ [hw.micro_batch_overhead_s, hw.clip_overhead_s, inv_gemm, inv_attn]
        assert pred == pytest.approx(TRUE.micro_batch_time(list(L), 1), rel=1e-12)
        # Ulysses 4 in one node: all its communication is exposed and linear in the link terms
        u4 = Observation(L, 4, (4, 1), False, 1.0)
        uly, ring = comm_features([u4], shape)
        comm = uly[0] @ [hw.intra_node_latency_s, 1 / hw.intra_node_bandwidth, 0, 0]
        assert not ring.any()
        assert comm == pytest.approx(layout_times(TRUE, list(L), 4, (4, 1), False)[1], rel=1e-12)


def test_fit_recovers_a_known_cluster():
    fitted = PRIOR.fit(_observations(TRUE, 400, seed=1))
    held_out = _observations(TRUE, 200, seed=2, noise=0.0)
    err = [
        abs(fitted.micro_batch_time(list(o.lengths), o.cp, o.cross_node) - o.seconds) / o.seconds
        for o in held_out
        if o.layout == TRUE.layout(list(o.lengths), o.cp, o.cross_node)
    ]
    prior_err = [
        abs(PRIOR.micro_batch_time(list(o.lengths), o.cp, o.cross_node) - o.seconds) / o.seconds
        for o in held_out
    ]
    assert np.median(prior_err) > 0.2  # the prior is far off...
    assert np.median(err) < 0.02 and max(err) < 0.08  # ...the fit is not
    assert fitted.hw.intra_node_bandwidth == pytest.approx(TRUE.hw.intra_node_bandwidth, rel=0.1)


def test_outliers_do_not_drag_the_fit():
    """10% stragglers at 5x their time: Huber keeps the typical micro-batch within 1.5% (plain
    least squares: about 4%)."""
    obs = _observations(TRUE, 400, seed=3, noise=0.01)
    obs = [
        Observation(o.lengths, o.cp, o.layout, o.cross_node, 5 * o.seconds, 5 * o.comm_seconds)
        if i % 10 == 0
        else o
        for i, o in enumerate(obs)
    ]
    fitted = PRIOR.fit(obs)
    err = [
        abs(fitted.micro_batch_time(list(o.lengths), o.cp, o.cross_node) - o.seconds) / o.seconds
        for o in _observations(TRUE, 100, seed=4, noise=0.0)
        if o.layout == TRUE.layout(list(o.lengths), o.cp, o.cross_node)
    ]
    assert np.median(err) < 0.015


def test_terms_the_data_do_not_determine_keep_their_prior():
    """One node only (CP <= 8): inter-node terms stay bitwise at the prior; no CP > 1 at all: the
    intra-node ones too."""
    within = PRIOR.fit(_observations(TRUE, 200, seed=5, sizes=(1, 2, 4, 8)))
    assert within.hw.inter_node_bandwidth == PRIOR.hw.inter_node_bandwidth
    assert within.hw.inter_node_latency_s == PRIOR.hw.inter_node_latency_s
    assert within.hw.intra_node_bandwidth != PRIOR.hw.intra_node_bandwidth
    alone = PRIOR.fit(_observations(TRUE, 100, seed=6, sizes=(1,)))
    assert alone.hw.intra_node_bandwidth == PRIOR.hw.intra_node_bandwidth
    assert alone.hw.intra_node_latency_s == PRIOR.hw.intra_node_latency_s
    assert replace(PRIOR.fit([]).hw, name="h100") == PRIOR.hw


def test_fit_is_deterministic_and_bounded():
    obs = _observations(TRUE, 150, seed=7)
    a, b = PRIOR.fit(obs), PRIOR.fit(list(obs))
    assert a.hw == b.hw  # bitwise, field by field
    for f in fields(a.hw):
        v = getattr(a.hw, f.name)
        assert f.name == "name" or (np.isfinite(v) and v >= 0)


def test_observation_checks_and_round_trip():
    o = Observation((5, 7), 4, (2, 2), False, 0.5, 0.1)
    assert Observation.from_dict(o.to_dict()) == o
    with pytest.raises(ValueError, match="ulysses \\* ring == cp"):
        Observation((5,), 4, (2, 1), False, 0.5)


def test_recovery_from_a_wrong_prior():
    """Plan from h100 on a cluster with 3x slower links and other curves: within 20 steps, planning
    efficiency against the true lower bound is within 2% of planning with the true model, and step
    predictions are within 5% (from about 30% off at step 0)."""
    steps = recover("opensora", 32, PRIOR, TRUE, steps=20, samples_per_gpu=2.0)
    assert steps[0].prediction_error > 0.2
    late = steps[-5:]
    assert all(s.efficiency >= s.efficiency_true - 0.02 for s in late)
    assert np.median([s.prediction_error for s in late]) < 0.05
