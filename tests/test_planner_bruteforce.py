"""The planner against exhaustive search on tiny cases.

Under plan-ordered execution on laminar groups, the best step for a given choice of (group, packing)
per clip is max over ranks of the summed micro-batch times covering that rank (running bigger groups
first reaches it, and no order can beat it). So the optimum is a minimum over every assignment of
clips to allowed groups and every packing of each group's clips into micro-batches under the cap.
"""

from __future__ import annotations

import itertools
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import allowed_groups
from dynamic_cp.planning.planner import plan

CM = CostModel.from_name("wan-1.3b", "h100")


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1 :]
        yield [[first]] + part


@cache
def mb_time(lengths: tuple[int, ...], cp: int) -> float:
    return CM.micro_batch_time(list(lengths), cp)


def brute_force(lengths, world, cap):
    groups = allowed_groups(world)
    best = float("inf")
    options = [[g for g in groups if L <= cap * len(g)] for L in lengths]
    for choice in itertools.product(*options):
        by_group: dict = {}
        for s, g in enumerate(choice):
            by_group.setdefault(g, []).append(s)
        per_group_parts = []
        for g, ids in by_group.items():
            parts = [
                p for p in set_partitions(ids) if all(sum(lengths[s] for s in mb) <= cap * len(g) for mb in p)
            ]
            per_group_parts.append([(g, p) for p in parts])
        for combo in itertools.product(*per_group_parts):
            load = [0.0] * world
            for g, parts in combo:
                t = sum(mb_time(tuple(sorted(lengths[s] for s in mb)), len(g)) for mb in parts)
                for r in g:
                    load[r] += t
            best = min(best, max(load))
    return best


@st.composite
def video_batches(draw, cap: int = 30_000) -> tuple[int, list[int]]:
    """(world, lengths) with every clip placeable: no clip longer than the whole world holds, so each
    drawn example is a real comparison (a skipped example would pass without testing anything)."""
    world = draw(st.sampled_from([1, 2, 4]))
    longest = min(60_000, cap * world)
    return world, draw(st.lists(st.integers(4_000, longest), min_size=1, max_size=4))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(case=video_batches())
def test_optimal_on_video_sized_clips(case):
    world, lengths = case
    cap = 30_000
    opt = brute_force(lengths, world, cap)
    assert opt < float("inf")
    ours = plan(lengths, world, cap, CM).predicted_step_s
    assert ours >= opt * (1 - 1e-9)  # the brute force really is a lower bound on any plan
    assert ours <= opt * 1.02  # 300 random cases: worst 1.00014


@settings(max_examples=25, deadline=None, derandomize=True)
@given(world=st.sampled_from([2, 4]), lengths=st.lists(st.integers(100, 4_000), min_size=1, max_size=4))
def test_tiny_clips_within_factor(world, lengths):
    """A step of a few sub-4K-token clips is dominated by per-micro-batch overhead and text
    projections, where the planner's additive per-clip estimate is weakest (worst seen: 1.26x)."""
    opt = brute_force(lengths, world, 30_000)
    assert opt * (1 - 1e-9) <= plan(lengths, world, 30_000, CM).predicted_step_s <= opt * 1.35


@pytest.mark.parametrize(
    "lengths, world",
    [
        ([20_000, 20_000, 20_000, 20_000], 4),
        ([50_000, 256, 256], 2),
        ([8448, 8448, 256, 256], 2),
        ([1000], 4),
    ],
)
def test_equals_optimal_on_easy_cases(lengths, world):
    opt = brute_force(lengths, world, 30_000)
    assert plan(lengths, world, 30_000, CM).predicted_step_s == pytest.approx(opt, rel=1e-3)
