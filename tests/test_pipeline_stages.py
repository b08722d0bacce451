"""dynamic_cp/planning/pipeline_stages.py: the stage split is the least-bottleneck contiguous one,
and the stage-major rank layout mirrors stage 0's ranks on every stage."""

from __future__ import annotations

import itertools

import pytest

from dynamic_cp.planning.pipeline_stages import (
    check_pipeline,
    layer_ranges,
    stage_layers,
    stage_ranks,
)


def _bottleneck(split, first_extra, last_extra):
    costs = [float(n) for n in split]
    costs[0] += first_extra
    costs[-1] += last_extra
    return max(costs)


def _best_by_search(num_layers, pp_size, first_extra, last_extra):
    best = float("inf")
    for cuts in itertools.combinations(range(1, num_layers), pp_size - 1):
        bounds = (0, *cuts, num_layers)
        split = [b - a for a, b in itertools.pairwise(bounds)]
        best = min(best, _bottleneck(split, first_extra, last_extra))
    return best


@pytest.mark.parametrize("num_layers", [1, 2, 5, 7, 12])
@pytest.mark.parametrize("pp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("extras", [(0.0, 0.0), (1.5, 0.0), (0.0, 2.0), (0.7, 0.3)])
def test_split_is_the_least_bottleneck_one(num_layers, pp_size, extras):
    if pp_size > num_layers:
        with pytest.raises(ValueError):
            stage_layers(num_layers, pp_size, *extras)
        return
    split = stage_layers(num_layers, pp_size, *extras)
    assert len(split) == pp_size and sum(split) == num_layers and min(split) >= 1
    assert _bottleneck(split, *extras) == pytest.approx(_best_by_search(num_layers, pp_size, *extras))


def test_even_split_and_ranges():
    assert stage_layers(40, 2) == [20, 20]
    assert _bottleneck(stage_layers(40, 4, first_extra=2.0), 2.0, 0.0) == 11  # (40 + 2) / 4 rounded up
    assert stage_layers(5, 2) == [3, 2]  # no extras by default: the greedy fill front-loads the odd block
    assert layer_ranges([2, 3]) == [range(0, 2), range(2, 5)]


def test_ranks_are_stage_major():
    assert [stage_ranks(6, 2, p) for p in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [stage_ranks(3, 3, p) for p in range(3)] == [[0], [1], [2]]


@pytest.mark.parametrize(
    "world, pp, layers, message",
    [
        (5, 2, 8, "does not divide the world of 5"),
        (4, 4, 3, "more stages than the model's 3 blocks"),
        (4, 0, 3, "must be >= 1"),
    ],
)
def test_bad_layouts_name_the_fix(world, pp, layers, message):
    with pytest.raises(ValueError, match=message):
        check_pipeline(world, pp, layers)
    check_pipeline(6, 2, 4)
    check_pipeline(1, 1, 1)  # the boundaries: one stage; as many stages as blocks
    check_pipeline(3, 3, 3)
