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
    # a warm-up of 2 x (pp - stage - 1): 2 forwards ahead on stage 0 of 2, none on the last stage
    assert stage_ops(4, 2, 0, "1f1b", 2) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]  # fmt: skip
    assert stage_ops(4, 2, 1, "1f1b", 3) == stage_ops(4, 2, 1)
    assert stage_ops(3, 3, 0, "1f1b", 2) == stage_ops(3, 3, 0, "gpipe")  # warm-up 4 > 3 micro-batches
    assert stage_ops(3, 2, 0, "gpipe", 2) == stage_ops(3, 2, 0, "gpipe")


@pytest.mark.parametrize("schedule, warmup", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2), ("1f1b", 3)])
@pytest.mark.parametrize("n, pp", [(1, 1), (4, 1), (5, 2), (3, 3), (7, 4), (12, 4)])
def test_every_op_once_and_in_flight_bound(schedule, warmup, n, pp):
    for stage in range(pp):
        ops = stage_ops(n, pp, stage, schedule, warmup)
        assert sorted(ops) == sorted([("F", m) for m in range(n)] + [("B", m) for m in range(n)])
        in_flight, most = 0, 0
        for kind, m in ops:
            assert kind == "F" or ("F", m) in ops[: ops.index((kind, m))]  # forward before backward
            in_flight += 1 if kind == "F" else -1
            most = max(most, in_flight)
        assert most == (n if schedule == "gpipe" else min(n, warmup * (pp - stage - 1) + 1))


def _runs_to_the_end(
    plan_groups: list[tuple[int, ...]], ranks: int, pp: int, schedule: str, warmup: int = 1, lists=None
) -> bool:
    """Play every rank's op list: an op fires when the rank's previous ops are done, its CP peers are
    at the same op (a collective), and its neighbour stage has done the op it receives from."""
    progs = {}
    for p in range(pp):
        ops = lists[p] if lists else stage_ops(len(plan_groups), pp, p, schedule, warmup)
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


@pytest.mark.parametrize("schedule, warmup", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2), ("1f1b", 3)])
def test_random_dynamic_plans_never_deadlock(schedule, warmup):
    rng = random.Random(0)
    for _ in range(300):
        ranks, pp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4])
        blocks = [(r,) for r in range(ranks)] + [tuple(range(i, i + 2)) for i in range(0, ranks - 1, 2)]
        groups = [rng.choice(blocks) for _ in range(rng.randint(1, 12))]
        assert _runs_to_the_end(groups, ranks, pp, schedule, warmup), (groups, ranks, pp)


def test_a_warm_up_growing_with_the_stage_would_deadlock():
    """Why the warm-up is a multiple of pp - stage - 1 (never growing with the stage): stage 0 with
    fewer warm-up forwards than stage 1 blocks on B(0), which stage 1 runs only after F(2), which
    stage 0 has not sent."""
    one = [(0,)] * 4
    lists = [stage_ops(4, 3, 1), stage_ops(4, 3, 0), stage_ops(4, 3, 2)]  # warm-ups 1, 2, 0
    assert not _runs_to_the_end(one, 1, 3, "1f1b", lists=lists)
    assert _runs_to_the_end(one, 1, 3, "1f1b", lists=[stage_ops(4, 3, p, "1f1b", 2) for p in range(3)])


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
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=r"warm-up multiple .*use an integer >= 1"):
            stage_ops(2, 2, 0, "1f1b", bad)
