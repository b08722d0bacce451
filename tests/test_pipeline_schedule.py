"""dynamic_cp/planning/pipeline_schedule.py: each stage's op order, and that ranks running their
subsequences of it never wait on each other in a cycle (executed here as a token game)."""

from __future__ import annotations

import random

import pytest

from dynamic_cp.planning.pipeline_schedule import rank_ops, stage_ops


def test_orders_by_hand():
    assert stage_ops(3, 2, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert stage_ops(3, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert stage_ops(1, 3, 0) == [("F", 0), ("B", 0)]
    assert stage_ops(2, 2, 0, "gpipe") == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert rank_ops(stage_ops(3, 2, 1), {0, 2}) == [("F", 0), ("B", 0), ("F", 2), ("B", 2)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("n, pp", [(1, 1), (4, 1), (5, 2), (3, 3), (7, 4)])
def test_every_op_once_and_in_flight_bound(schedule, n, pp):
    for stage in range(pp):
        ops = stage_ops(n, pp, stage, schedule)
        assert sorted(ops) == sorted([("F", m) for m in range(n)] + [("B", m) for m in range(n)])
        in_flight, most = 0, 0
        for kind, m in ops:
            assert kind == "F" or ("F", m) in ops[: ops.index((kind, m))]  # forward before backward
            in_flight += 1 if kind == "F" else -1
            most = max(most, in_flight)
        assert most == (n if schedule == "gpipe" else min(n, pp - stage))


def _runs_to_the_end(plan_groups: list[tuple[int, ...]], ranks: int, pp: int, schedule: str) -> bool:
    """Play every rank's op list: an op fires when the rank's previous ops are done, its CP peers are
    at the same op (a collective), and its neighbour stage has done the op it receives from."""
    progs = {}
    for p in range(pp):
        ops = stage_ops(len(plan_groups), pp, p, schedule)
        for r in range(ranks):
            progs[p, r] = rank_ops(ops, {m for m, g in enumerate(plan_groups) if r in g})
    done: set[tuple[int, int, str, int]] = set()
    pos = dict.fromkeys(progs, 0)
    moved = True
    while moved:
        moved = False
        for (p, r), prog in progs.items():
            if pos[p, r] == len(prog):
                continue
            kind, m = prog[pos[p, r]]
            peers = plan_groups[m]
            if any(pos[p, q] == len(progs[p, q]) or progs[p, q][pos[p, q]] != (kind, m) for q in peers):
                continue
            src = p - 1 if kind == "F" else p + 1
            if 0 <= src < pp and any((src, q, kind, m) not in done for q in peers):
                continue
            for q in peers:
                done.add((p, q, kind, m))
                pos[p, q] += 1
            moved = True
    return all(pos[k] == len(v) for k, v in progs.items())


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_random_dynamic_plans_never_deadlock(schedule):
    rng = random.Random(0)
    for _ in range(300):
        ranks, pp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4])
        blocks = [(r,) for r in range(ranks)] + [tuple(range(i, i + 2)) for i in range(0, ranks - 1, 2)]
        groups = [rng.choice(blocks) for _ in range(rng.randint(1, 8))]
        assert _runs_to_the_end(groups, ranks, pp, schedule), (groups, ranks, pp)


def test_orders_built_per_rank_would_deadlock():
    """Why the order is per stage: ranks 0 and 1 share micro-batches 0 and 2, and rank 0 has 1 alone.
    A 1F1B built from each rank's own list puts B(0) before F(2) on rank 0 and after it on rank 1."""
    per_rank_0 = stage_ops(3, 2, 0)  # rank 0's own list: 0, 1, 2
    per_rank_1 = [(k, [0, 2][m]) for k, m in stage_ops(2, 2, 0)]  # rank 1's own list: 0, 2
    assert per_rank_0.index(("B", 0)) < per_rank_0.index(("F", 2))
    assert per_rank_1.index(("B", 0)) > per_rank_1.index(("F", 2))
    shared = rank_ops(stage_ops(3, 2, 0), {0, 2})
    assert shared.index(("B", 0)) < shared.index(("F", 2))  # one stage order: both ranks agree


def test_bad_arguments():
    with pytest.raises(ValueError, match="use one of"):
        stage_ops(2, 2, 0, "zero-bubble")
    with pytest.raises(ValueError, match="outside 0..1"):
        stage_ops(2, 2, 2)
