"""Lockstep rounds (FSDP per_layer): invariants over random plans (hypothesis) and worked examples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.rounds import lockstep_rounds, rank_round_schedule, round_violations


@st.composite
def plans(draw):
    world = draw(st.integers(1, 9))
    n = draw(st.integers(0, 25))
    mbs = []
    for s in range(n):
        ranks = draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world))
        mbs.append((tuple(sorted(ranks)), [s]))
    return Plan(mbs, world, 1000.0)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_rounds_invariants(p):
    out = lockstep_rounds(p, p.world_size)
    assert p.rounds is None, "the input plan must not be mutated"
    assert out.micro_batches == p.micro_batches
    assert round_violations(out) == []
    # greedy = earliest: each micro-batch in round k > 0 shares a rank with one in round k - 1
    for k in range(1, len(out.rounds)):
        prev = set().union(*(set(out.micro_batches[i][0]) for i in out.rounds[k - 1]))
        for i in out.rounds[k]:
            assert prev & set(out.micro_batches[i][0]), (k, i)
    # no fewer rounds than the busiest rank's micro-batch count; no more than micro-batches
    most = max((len(x) for x in p.per_rank()), default=0)
    assert most <= len(out.rounds) <= len(p.micro_batches)
    # each rank's per-round schedule lists its own micro-batches in plan order
    for r in range(p.world_size):
        sched = rank_round_schedule(out, r)
        assert len(sched) == len(out.rounds)
        assert [i for i in sched if i is not None] == p.per_rank()[r]


def test_rounds_example():
    # rank 0 runs two micro-batches, rank 1 one: the case that hangs plain FSDP
    p = Plan([((0,), [0]), ((1,), [1]), ((0,), [2]), ((0, 1), [3]), ((2, 3), [4])], 4, 100.0)
    out = lockstep_rounds(p, 4)
    assert out.rounds == [[0, 1, 4], [2], [3]]
    assert rank_round_schedule(out, 1) == [1, None, 3]
    assert rank_round_schedule(out, 3) == [4, None, None]


def test_round_violations_catch_bad_rounds():
    p = Plan([((0, 1), [0]), ((1,), [1]), ((0,), [2])], 2, 100.0)
    assert round_violations(p) == ["plan has no rounds"]
    p.rounds = [[0, 1], [2]]
    assert any("shares ranks" in e for e in round_violations(p))
    p.rounds = [[0], [2]]
    assert any("micro-batch 1 is in 0 rounds" in e for e in round_violations(p))
    p = Plan([((0,), [0]), ((0,), [1])], 1, 100.0, rounds=[[1], [0]])
    assert any("out of plan order" in e for e in round_violations(p))


def test_rounds_errors():
    p = Plan([((0,), [0])], 2, 100.0)
    with pytest.raises(ValueError, match="world_size"):
        lockstep_rounds(p, 3)
    with pytest.raises(ValueError, match="lockstep_rounds"):
        rank_round_schedule(p, 0)


def test_round_violations_name_every_broken_invariant():
    p = Plan([((0, 1), [0]), ((1,), [1]), ((0,), [2])], 2, 100.0, rounds=[[0, 1], [2]])
    assert round_violations(p) == [  # rank 1's two micro-batches in one round: shared and unordered
        "round 0: micro-batch 1 shares ranks [1]",
        "rank 1 runs its micro-batches out of plan order: rounds [0, 0]",
    ]
    p.rounds = [[0, 3], [-1], [2]]
    assert round_violations(p) == [
        "round 0 names micro-batch 3, outside 0..2",
        "round 1 names micro-batch -1, outside 0..2",
        "micro-batch 1 is in 0 rounds",
        "rank 1 runs its micro-batches out of plan order: rounds [0, -1]",
    ]
    p.rounds = [[0], [1], [2], [1]]
    assert round_violations(p) == ["micro-batch 1 is in 2 rounds"]
    p.rounds = [[0], [1, 2]]
    assert round_violations(p) == []


def test_lockstep_rounds_rejects_a_rank_outside_the_world():
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=f"micro-batch 1 names rank {bad}, outside 0..1"):
            lockstep_rounds(Plan([((0,), [0]), ((1, bad), [1])], 2, 100.0), 2)
