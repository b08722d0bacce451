"""The order of forwards and backwards on one pipeline stage: one list, read by the runtime and the simulator.

A stage's order is a single sequence over the plan's micro-batches (all of them, not one rank's),
and every rank of the stage runs the subsequence that names it. So two ranks of a stage that share
micro-batches (a CP group) meet their collectives in the same order: with orders built per rank, a
rank with an extra micro-batch of its own would reach the backward of a shared one before its peer
had run the next shared forward, and the two would wait in different collectives of one group.

Ops are ``("F", m)`` or ``("B", m)`` with ``m`` an index into ``plan.micro_batches``.
"""

from __future__ import annotations

SCHEDULES = ("1f1b", "gpipe")


def stage_ops(
    num_micro_batches: int, pp_size: int, stage: int, schedule: str = "1f1b", warmup: int = 1
) -> list[tuple[str, int]]:
    """Stage ``stage``'s ops in execution order.

    gpipe: every forward, then every backward (the most activations in flight: all of them).
    1f1b: ``warmup x (pp_size - stage - 1)`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards; at most that + 1 micro-batches in flight (``pp_size - stage``
    at ``warmup=1``, plain 1F1B). The warm-up never grows with the stage, so no stage waits on a
    backward its successor can only run after a forward it has not been sent.
    Backwards run in forward order under both, so the last stage can start each as soon as its
    forward is done.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}; use one of {SCHEDULES}")
    if not 0 <= stage < pp_size:
        raise ValueError(f"stage {stage} outside 0..{pp_size - 1}")
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"pipeline warm-up multiple {warmup!r}; use an integer >= 1 (1: plain 1F1B)")
    n = num_micro_batches
    if schedule == "gpipe":
        return [("F", m) for m in range(n)] + [("B", m) for m in range(n)]
    lead = min(warmup * (pp_size - stage - 1), n)
    ops = [("F", m) for m in range(lead)]
    for m in range(lead, n):
        ops += [("F", m), ("B", m - lead)]
    ops += [("B", m) for m in range(n - lead, n)]
    return ops


def rank_ops(ops: list[tuple[str, int]], runs: set[int] | list[int]) -> list[tuple[str, int]]:
    """The subsequence of a stage's ops that a rank runs (``runs``: its micro-batch indices)."""
    mine = set(runs)
    return [op for op in ops if op[1] in mine]
