"""cost_fit.py's features, bounds and edge cases worked by hand on a toy shape (d = 2, one layer).

The features are the cost model's formulas with the knees fixed (cost_fit's module docstring); the
test writes each out for a few observations. Values are ratios of small integers, compared to 1e-12.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dynamic_cp.planning.cost_fit import (
    COMM,
    COMPUTE,
    Observation,
    Shape,
    Terms,
    _bounds,
    comm_features,
    compute_features,
    fit_terms,
)

SHAPE = Shape(
    d=2, layers=1, text_tokens=3, lin_per_token=10.0, text_per_clip=5.0, attn_coef=0.5, gpus_per_node=2
)


def obs(lengths, cp=1, layout=(1, 1), cross=False, seconds=1.0, comm=0.0):
    return Observation(tuple(lengths), cp, layout, cross, seconds, comm)


def test_compute_features_worked_by_hand():
    got = compute_features([obs((4, 2), 2, (2, 1)), obs((6,))], SHAPE, gemm_half=1.0, attn_half=1.0)
    # two clips on 2 ranks: b = 2, n = 6 / 2 = 3 tokens per rank; text 5 b (T b + h_g) / (T b) = 70 / 6;
    # attention 0.5 (L^2 + 3 L) / c * (q + h_a) / q with q = L / c: 7 * 3/2 + 2.5 * 2 = 15.5
    # one clip of 6 on 1 rank: text 5 * 4 / 3; attention 0.5 * 54 * 7 / 6 = 31.5
    want = [[1, 2, 10 * (3 + 1) + 70 / 6, 15.5], [1, 1, 10 * (6 + 1) + 20 / 3, 31.5]]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    no_text = compute_features([obs((6,))], replace(SHAPE, text_tokens=0), 2.0, 0.0)
    np.testing.assert_allclose(no_text, [[1, 1, 10 * (6 + 2), 0.5 * 36]], rtol=1e-12)


def test_comm_features_worked_by_hand():
    cases = [
        obs((4, 2), 2, (2, 1)),  # Ulysses 2 in a node: 8 calls, 8 * 3 * 2 * 2 * (1 / 2) = 48 bytes
        obs((8,), 4, (2, 2), cross=True),  # Ulysses in the node (ring spans), ring across: 3 calls
        obs((2, 2), 2, (2, 1), cross=True),  # Ulysses alone across nodes: the inter-node link
        obs((8,), 4, (4, 1)),  # Ulysses 4 > 2 GPUs per node: inter-node
        obs((6,), 2, (1, 2)),  # ring in a node: 3 calls, 3 * 4 * 3 * 2 = 72 bytes
        obs((6,)),  # CP 1: no communication
    ]
    uly, ring = comm_features(cases, SHAPE)
    np.testing.assert_allclose(
        uly,
        [[8, 48, 0, 0], [8, 32, 0, 0], [0, 0, 8, 32], [0, 0, 8, 48], [0, 0, 0, 0], [0, 0, 0, 0]],
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        ring,
        [[0, 0, 0, 0], [0, 0, 3, 48], [0, 0, 0, 0], [0, 0, 0, 0], [3, 72, 0, 0], [0, 0, 0, 0]],
        rtol=1e-12,
    )


PRIOR = Terms(
    overhead=0.0,
    clip_overhead=2.0,
    inv_gemm=3.0,
    inv_attn=4.0,
    gemm_half=100.0,
    attn_half=50.0,
    intra_latency=1e-5,
    intra_inv_bw=1e-9,
    inter_latency=0.0,
    inter_inv_bw=5e-9,
)


def test_bounds_keep_rates_within_a_million_of_the_prior():
    p, scale, lower, upper = _bounds(COMPUTE, PRIOR)
    np.testing.assert_array_equal(p, [0.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(scale, [1.0, 2.0, 3.0, 4.0])  # a zero prior is scaled by 1
    np.testing.assert_array_equal(lower, [0.0, 0.0, 3e-6, 4e-6])  # rates never reach 0
    np.testing.assert_array_equal(upper, [1e6, 2e6, 3e6, 4e6])
    p, scale, lower, upper = _bounds(COMM, PRIOR)
    np.testing.assert_array_equal(lower, [0.0, 1e-15, 0.0, 5e-15])
    np.testing.assert_array_equal(upper, [10.0, 1e-3, 1e6, 5e-3])


def test_observation_checks_and_dict_defaults():
    for bad in [dict(lengths=()), dict(cp=0, layout=(1, 0)), dict(cp=2, layout=(1, 1))]:
        args = {"lengths": (3,), "cp": 1, "layout": (1, 1), **bad}
        with pytest.raises(ValueError, match="ulysses \\* ring == cp"):
            obs(args["lengths"], args["cp"], args["layout"])
    o = obs((3, 5), 2, (1, 2), cross=True, seconds=0.5, comm=0.25)
    assert o.to_dict() == {
        "lengths": [3, 5],
        "cp": 2,
        "layout": [1, 2],
        "cross_node": True,
        "seconds": 0.5,
        "comm_seconds": 0.25,
    }
    assert Observation.from_dict(o.to_dict()) == o
    d = o.to_dict()
    del d["comm_seconds"]  # files from before comm was measured
    assert Observation.from_dict(d).comm_seconds == 0.0


def test_fit_ignores_unmeasured_micro_batches_and_keeps_link_terms_without_cp():
    true = replace(PRIOR, overhead=0.5, clip_overhead=0.25)
    one_rank = [obs(lengths) for lengths in [(10,), (40, 80), (160,), (640, 100, 30), (300, 20)]]
    x = compute_features(one_rank, SHAPE, true.gemm_half, true.attn_half) @ [0.5, 0.25, 3.0, 4.0]
    measured = [replace(o, seconds=float(s)) for o, s in zip(one_rank, x)]
    assert fit_terms([], SHAPE, PRIOR) == PRIOR
    assert fit_terms([replace(o, seconds=0.0) for o in measured], SHAPE, PRIOR) == PRIOR
    fitted = fit_terms(measured, SHAPE, PRIOR)
    assert fit_terms([*measured, replace(measured[0], seconds=0.0)], SHAPE, PRIOR) == fitted
    assert [getattr(fitted, n) for n in COMM] == [getattr(PRIOR, n) for n in COMM]  # no CP > 1 seen
    assert fitted != PRIOR  # the compute terms moved
