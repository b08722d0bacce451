"""The per_layer rounds planner's steps worked by hand (rounds_planner.py's docstring, steps 1-3).

``_shelves`` gets a hand-written time table (seconds per clip and CP size) so every height, block and
choice below can be followed on paper; the numbers are small integers, so comparisons are exact.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.plan_types import plan_violations
from dynamic_cp.planning.planner import min_cp_index
from dynamic_cp.planning.rounds import round_violations
from dynamic_cp.planning.rounds_planner import _shelves, _time_table, plan_for_mode, plan_rounds

INF = math.inf
CM = CostModel.from_name("wan-1.3b", "h100")


def shelves(t_size1, t_size2, k, *, world=2, lens=None, cap=1000.0, floor_s=0.0, slack=1.0):
    table = np.array([t_size1, t_size2], dtype=float).T  # (clips, sizes (1, 2))
    L = np.array(lens or [10] * len(k))
    return _shelves(L, np.array(k), table, (1, 2), world, cap, floor_s, slack)


def test_longest_first_into_free_blocks_then_the_least_loaded_block_under_the_height():
    # times 2, 4, 1, 3 on one rank; work 10 over 2 ranks -> height max(4, 5) = 5.
    # 1 (4s) opens rank 0, 3 (3s) opens rank 1; 0 (2s) joins rank 1 (5 <= 5; rank 0 would reach 6);
    # 2 (1s) joins rank 0 (5; rank 1 would reach 6).
    assert shelves([2, 4, 1, 3], [9, 9, 9, 9], [0, 0, 0, 0]) == [[((0,), [1, 2]), ((1,), [0, 3])]]


def test_height_is_the_work_spread_times_the_slack_or_the_floor():
    # times 4, 4, 3, 3, 1: height max(4, 15 / 2) = 7.5; 2 and 3 fill ranks 0 and 1 to 7; clip 4 would
    # make 8 > 7.5, so it waits for a second round (whose height is max(1, 1 / 2) = 1)
    t = [4, 4, 3, 3, 1]
    two_rounds = [[((0,), [0, 2]), ((1,), [1, 3])], [((0,), [4])]]
    assert shelves(t, [9] * 5, [0] * 5) == two_rounds
    one_round = [[((0,), [0, 2, 4]), ((1,), [1, 3])]]
    assert shelves(t, [9] * 5, [0] * 5, slack=1.1) == one_round  # height 8.25
    assert shelves(t, [9] * 5, [0] * 5, floor_s=8.0) == one_round  # the weight traffic: height 8 (<= 8)
    assert shelves(t, [9] * 5, [0] * 5, floor_s=7.9) == two_rounds
    # the cap in tokens: 3 clips of 10 tokens exceed 25 per rank, so clip 4 waits despite the slack
    assert shelves(t, [9] * 5, [0] * 5, slack=1.1, cap=25.0) == two_rounds
    assert shelves(t, [9] * 5, [0] * 5, slack=1.1, cap=30.0) == one_round  # exactly 30 fits


def test_fewest_rounds_the_cap_allows_lowers_the_height():
    # 4 clips of 1 s and 10 tokens, cap 10 per rank: at least ceil(40 / 20) = 2 rounds, so height
    # max(1, 4 / (2 * 2)) = 1 and each rank takes one clip per round
    got = shelves([1, 1, 1, 1], [9] * 4, [0] * 4, cap=10.0)
    assert got == [[((0,), [0]), ((1,), [1])], [((0,), [2]), ((1,), [3])]]


def test_a_clip_joins_only_a_block_of_its_size_or_larger_priced_at_that_size():
    # clip 0 runs on both ranks (5 s); clip 1 (size 1) finds no free rank and joins the 2-rank block
    # at its 2-rank time, 1 s: 5 + 1 <= height max(5, (10 + 2) / 2 = 6)
    assert shelves([INF, 2], [5, 1], [1, 0]) == [[((0, 1), [0, 1])]]
    # clip 2 needs 2 ranks; open blocks are 1-rank: it waits for the next round
    got = shelves([4, 4, INF], [9, 9, 1], [0, 0, 1])
    assert got == [[((0,), [0]), ((1,), [1])], [((0, 1), [2])]]
    # a clip that cannot run at a block's size (inf) does not join it
    got = shelves([INF, 2], [5, INF], [1, 0])
    assert got == [[((0, 1), [0])], [((0,), [1])]]


def test_blocks_of_a_round_are_listed_largest_first_then_by_first_rank():
    got = shelves([3, INF, 1], [9, 2, 9], [0, 1, 0], world=4)
    # 0 (3 s) opens rank 0; 1 (2 s, size 2) opens ranks 2-3 (0-1 is taken); 2 (1 s) opens rank 1
    assert got == [[((2, 3), [1]), ((0,), [0]), ((1,), [2])]]


def test_time_table_packs_a_ranks_even_share_up_to_the_cap():
    L = np.array([3000, 1000, 200])
    sizes = (1, 2, 4)
    kmin = np.array([1, 0, 0])  # clip 0 does not fit one rank
    table = _time_table(L, sizes, kmin, 2000.0, CM, 4)
    assert table[0, 0] == INF and np.isfinite(table[0, 1:]).all() and np.isfinite(table[1:]).all()
    for j, c in enumerate(sizes):  # packed = min(cap, max(4200 / 4, 1)) = 1050 tokens
        rows = [0, 1, 2] if j else [1, 2]
        np.testing.assert_array_equal(table[rows, j], CM.sample_times(L[rows], c, 1050.0))
    capped = _time_table(L, sizes, kmin, 500.0, CM, 4)  # packed = the cap
    np.testing.assert_array_equal(capped[1:, 0], CM.sample_times(L[1:], 1, 500.0))
    tiny = _time_table(np.array([1, 1]), (1,), np.array([0, 0]), 10.0, CM, 4)  # share 0.5 -> 1 token
    np.testing.assert_array_equal(tiny[:, 0], CM.sample_times(np.array([1, 1]), 1, 1.0))


def test_plan_rounds_of_nothing_and_its_recorded_fields():
    empty = plan_rounds([], 4, 1000.0, CM)
    assert (empty.micro_batches, empty.rounds, empty.fsdp) == ([], [], "per_layer")
    assert (empty.predicted_step_s, empty.solver_ms, empty.world_size, empty.cap_tokens) == (
        0.0,
        0.0,
        4,
        1000.0,
    )
    lengths = [30000, 12000, 5000, 800, 800, 300]
    p = plan_rounds(lengths, 8, 20000.0, CM)
    assert p.fsdp == "per_layer" and round_violations(p) == [] and plan_violations(p, lengths, 20000.0) == []
    assert p.solver_ms > 0 and np.isfinite(p.predicted_step_s) and p.predicted_step_s > 0
    with pytest.raises(ValueError, match="cap_tokens=0"):
        plan_rounds(lengths, 8, 0, CM)
    assert plan_for_mode(lengths, 8, 20000.0, CM, "per_step").fsdp == "per_step"
    with pytest.raises(ValueError, match="fsdp='auto'"):
        plan_for_mode(lengths, 8, 20000.0, CM, "auto")
    assert (min_cp_index(np.array(lengths), 20000.0, (1, 2, 4, 8)) == [1, 0, 0, 0, 0, 0]).all()


def test_solver_ms_is_the_wall_time_of_the_call(monkeypatch):
    import types

    import dynamic_cp.planning.rounds_planner as rounds_planner

    ticks = iter([100.0, 100.25])  # the module's own clock: start and end of plan_rounds
    monkeypatch.setattr(rounds_planner, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert plan_rounds([5_000, 3_000], 2, 20_000.0, CM).solver_ms == pytest.approx(250.0)


def test_a_waiting_clip_joins_the_least_loaded_block_that_stays_under_the_height():
    # times 4, 3, 1, slack 1.5: height 1.5 * max(4, 8 / 2) = 6; clip 2 fits under it on both ranks
    # (5 and 4) and takes rank 1, the less loaded
    assert shelves([4, 3, 1], [9] * 3, [0] * 3, slack=1.5) == [[((0,), [0]), ((1,), [1, 2])]]


def test_the_fewest_rounds_in_tokens_lower_the_first_rounds_height():
    # 31 tokens over 2 ranks of cap 15: at least 2 rounds, so height max(2, 6 / (2 * 2)) = 2 and the
    # short clips 2 and 3 wait; in round 2 (11 tokens: 1 round) they take a rank each. Counting one
    # round would give height 3 and put clip 3 (5 tokens, 15 in all) beside clip 0 in round 1.
    got = shelves([2, 2, 1, 1], [9] * 4, [0] * 4, lens=[10, 10, 6, 5], cap=15.0)
    assert got == [[((0,), [0]), ((1,), [1])], [((0,), [2]), ((1,), [3])]]


def test_one_clip_is_planned():
    p = plan_rounds([5000], 2, 20000.0, CM)
    assert [ids for _, ids in p.micro_batches] == [[0]] and p.rounds == [[0]]


def test_a_cap_of_one_token_is_a_valid_cap():
    p = plan_rounds([1, 1], 2, 1.0, CM)
    assert sorted(ids for _, ids in p.micro_batches) == [[0], [1]] and round_violations(p) == []
