"""Planner invariants over random inputs (hypothesis), errors, and the required API shape."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamic_cp.planning.baselines import static_plan
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import allowed_groups, default_cp_sizes
from dynamic_cp.planning.plan_types import plan_violations
from dynamic_cp.planning.planner import plan
from dynamic_cp.planning.simulator import lower_bound, simulate
from dynamic_cp.planning.workloads import workload

CM = CostModel.from_name("wan-1.3b", "h100")


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]))
    sizes = default_cp_sizes(world)
    if draw(st.booleans()) and len(sizes) > 1:
        sizes = tuple(sorted(draw(st.sets(st.sampled_from(sizes), min_size=1))))
    cap = draw(st.integers(200, 40_000))
    top = cap * max(sizes)
    lengths = draw(st.lists(st.integers(1, top), min_size=1, max_size=60))
    return lengths, world, cap, sizes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_invariants(case):
    lengths, world, cap, sizes = case
    p = plan(lengths, world, cap, CM, cp_sizes=sizes)
    assert plan_violations(p, lengths, cap, sizes) == []
    # predicted step is the simulator's critical path and can never beat the lower bound
    assert p.predicted_step_s == pytest.approx(simulate(p, lengths, CM).step_s)
    assert p.predicted_step_s >= lower_bound(lengths, CM, world, cap, sizes) * (1 - 1e-9)
    # deterministic: the same input gives the same plan
    assert plan(lengths, world, cap, CM, cp_sizes=sizes).micro_batches == p.micro_batches


@settings(max_examples=25, deadline=None, derandomize=True)
@given(cases())
def test_never_worse_than_balanced_static(case):
    lengths, world, cap, sizes = case
    ours = plan(lengths, world, cap, CM, cp_sizes=sizes).predicted_step_s
    static = static_plan(lengths, world, cap, CM, cp_sizes=sizes, balanced=True).predicted_step_s
    assert ours <= static * 1.02


def test_api_shape():
    lengths = [256, 8448, 32760, 75600, 256, 256]
    p = plan(lengths, 8, 20_000, CM)
    assert isinstance(p.micro_batches, list)
    for ranks, ids in p.micro_batches:
        assert isinstance(ranks, tuple) and all(isinstance(r, int) for r in ranks)
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    per_rank = p.per_rank()
    assert sorted({i for r in per_rank for i in r}) == list(range(len(p.micro_batches)))
    assert all(p.micro_batches[i] in p.rank_micro_batches(r) for r in range(8) for i in per_rank[r])
    assert p.predicted_step_s > 0 and p.solver_ms >= 0


def test_sample_that_fits_nowhere_is_named():
    with pytest.raises(ValueError, match=r"sample 2 has 90000 tokens.*largest capacity 80000"):
        plan([10, 20, 90_000, 5], 4, 20_000, CM)
    with pytest.raises(ValueError, match=r"sample 0 has 50000 tokens.*largest capacity 40000"):
        plan([50_000], 8, 20_000, CM, cp_sizes=[1, 2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=[[1, 2]], world_size=4, cap_tokens=10), "flat list"),
        (dict(lengths=[0, 3], world_size=4, cap_tokens=10), "positive integers"),
        (dict(lengths=[1.5], world_size=4, cap_tokens=10), "positive integers"),
        (dict(lengths=[3], world_size=0, cap_tokens=10), "world_size"),
        (dict(lengths=[3], world_size=4, cap_tokens=0), "cap_tokens"),
        (dict(lengths=[3], world_size=8, cap_tokens=10, cp_sizes=[3]), "CP size 3 is not allowed"),
    ],
)
def test_user_mistakes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(cost_model=CM, **kwargs)


def test_empty_batch():
    p = plan([], 8, 1000, CM)
    assert p.micro_batches == [] and p.predicted_step_s == 0.0


def test_long_clips_get_big_groups_short_ones_small():
    lengths = [118_800] + [256] * 40
    p = plan(lengths, 16, 20_000, CM)
    group_of = {s: ranks for ranks, ids in p.micro_batches for s in ids}
    assert len(group_of[0]) >= 8
    assert max(len(group_of[s]) for s in range(1, 41)) < len(group_of[0])


def test_only_allowed_groups_on_odd_world():
    lengths = workload("opensora", 48, seed=3)
    p = plan(lengths, 12, 27_000, CM)
    allowed = set(allowed_groups(12))
    assert all(ranks in allowed for ranks, _ in p.micro_batches)


def test_builtin_workloads_efficient():
    """Quality smoke check at one size (the full table is bench/bench_planner.py)."""
    for name in ("openvid", "opensora", "longtail", "panda70m"):
        lengths = workload(name, 64, seed=1)
        p = plan(lengths, 16, 27_000, CM)
        assert lower_bound(lengths, CM, 16, 27_000) / p.predicted_step_s >= 0.9, name


def test_groups_are_laminar_blocks():
    groups = allowed_groups(8)
    assert groups[:8] == [(r,) for r in range(8)]
    assert (0, 1, 2, 3) in groups and (4, 5, 6, 7) in groups and (2, 3, 4, 5) not in groups
    assert allowed_groups(6) == [
        (0,),
        (1,),
        (2,),
        (3,),
        (4,),
        (5,),
        (0, 1),
        (2, 3),
        (4, 5),
        (0, 1, 2, 3),
        tuple(range(6)),
    ]
    for a in groups:
        for b in groups:
            assert set(a) <= set(b) or set(b) <= set(a) or not set(a) & set(b)
    assert np.all(np.diff(default_cp_sizes(64)) > 0)


def test_groups_for_a_subset_of_sizes_and_per_rank_count():
    from dynamic_cp.planning.groups_layout import groups_of_rank

    assert allowed_groups(8, [2, 8]) == [(0, 1), (2, 3), (4, 5), (6, 7), tuple(range(8))]
    for rank in (0, 5, 63):
        mine = groups_of_rank(rank, 64)
        assert len(mine) == 7 and all(rank in g for g in mine)  # log2(64) + 1 groups per rank
    p = plan([5_000] * 6 + [60_000], 8, 20_000, CM, cp_sizes=[2, 8])
    assert {len(r) for r, _ in p.micro_batches} <= {2, 8}


def _table(lengths, world, cap):
    from dynamic_cp.planning.planner import min_cp_index

    L = np.asarray(lengths)
    sizes = default_cp_sizes(world)
    kmin = min_cp_index(L, cap, sizes)
    table = np.full((L.size, len(sizes)), np.inf)
    for j, c in enumerate(sizes):
        fits = kmin <= j
        table[fits, j] = CM.sample_times(L[fits], c, min(cap, L.sum() / world))
    return table, sizes


def test_joint_placement_is_consistent_and_beats_sizes_fixed_first():
    """_place_joint's blocks, sizes and per-rank finish agree, and on a batch where one mid-size clip
    queues behind a big one under every fixed-size choice, choosing size and block together wins."""
    from dynamic_cp.planning.planner import DEFAULT_THETAS, _choose_sizes, _place_all, _place_joint

    lengths, world, cap = workload("opensora", 32, seed=0), 32, 26_907
    table, sizes = _table(lengths, world, cap)
    pl, k = _place_joint(table, world, sizes)
    placed = sorted(i for ids in pl.blocks.values() for i in ids)
    assert placed == list(range(len(lengths)))  # every clip exactly once
    finish = np.zeros(world)
    for (c, start), ids in pl.blocks.items():
        assert start % c == 0 and all(sizes[k[i]] == c for i in ids)  # aligned, and k says the size
        finish[start : start + c] += table[ids, sizes.index(c)].sum()
    np.testing.assert_allclose(pl.finish, finish)
    fixed_first = min(
        _place_all(
            len(lengths), _choose_sizes(table, np.asarray(sizes), world, th), table, world, sizes
        ).makespan()
        for th in DEFAULT_THETAS
    )
    assert pl.makespan() < 0.9 * fixed_first  # 0.58 s against 0.78 s (additive estimates) when written
