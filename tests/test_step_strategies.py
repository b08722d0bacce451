"""The step strategies' own pieces: the flat gradient sum, the rounds of a plan, the choice of strategy.

The strategies' end-to-end numerics are the spawned parity tests' (test_runtime.py: replicated;
test_fsdp.py: per_step and per_layer; test_pipeline.py: stages; test_wan22_both.py: two experts).
Here, on 3 gloo ranks, ``sum_gradients``: sums are exact (small integers in float32, any summation
order), a parameter no rank gave a gradient keeps ``grad=None``, a parameter one rank gave a gradient
gets the sum on every rank, ``extra`` comes back summed, and the dtype of each gradient is kept.

Planted and seen to fail: the used-count test ``u > 0`` as ``u >= 0`` (the unused parameter gets a
zero gradient); the offset of ``extra`` one slot early (extra sums the last used count); gradients
left in the buffer's dtype (the bf16 parameter's gradient comes back float32).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.rounds import round_violations
from dynamic_cp.runtime.step_strategies import (
    PerLayerStep,
    PerStepStep,
    ReplicatedStep,
    step_strategy,
    sum_gradients,
    with_rounds,
)
from dynamic_cp.runtime.testing import run_gloo


def _sum_worker(rank: int, world_size: int):
    import torch.distributed as dist

    shapes = [(3,), (2, 2), (4,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    params.append(torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)))
    params[0].grad = torch.full((3,), float(rank + 1))  # every rank: 1 + 2 + 3
    if rank == 1:
        params[1].grad = torch.arange(4.0).reshape(2, 2)  # one rank only
    # params[2]: no rank has a gradient
    params[3].grad = torch.full((2,), float(rank), dtype=torch.bfloat16)
    extra = torch.tensor([float(rank), 10.0 * rank], dtype=torch.float64)
    summed = sum_gradients(params, dist.group.WORLD, extra)
    return {
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "dtypes": [None if p.grad is None else p.grad.dtype for p in params],
        "extra": summed.tolist(),
    }


def test_sum_gradients_over_three_ranks():
    for got in run_gloo(_sum_worker, 3):
        grads = got["grads"]
        assert torch.equal(grads[0], torch.full((3,), 6.0))
        assert torch.equal(grads[1], torch.arange(4.0).reshape(2, 2))
        assert grads[2] is None
        assert torch.equal(grads[3], torch.full((2,), 3.0, dtype=torch.bfloat16))
        assert got["dtypes"] == [torch.float32, torch.float32, None, torch.bfloat16]
        assert got["extra"] == [3.0, 30.0]


def _plan(micro_batches, experts=None) -> Plan:
    info = {"experts": experts} if experts is not None else {}
    return Plan(micro_batches=micro_batches, world_size=4, cap_tokens=1e9, info=info)


def test_with_rounds_keeps_a_plans_own_rounds_and_cuts_the_others():
    mbs = [((0, 1), [0]), ((2,), [1]), ((3,), [2]), ((2, 3), [3]), ((0,), [4])]  # (ranks, clip ids)
    own = dataclasses.replace(_plan(mbs), rounds=[[0, 1, 2], [3, 4]])
    assert with_rounds(own, False, 4) is own
    cut = with_rounds(_plan(mbs), False, 4)
    assert sorted(m for r in cut.rounds for m in r) == list(range(len(mbs)))
    assert round_violations(cut) == []


def test_with_rounds_never_mixes_the_two_experts():
    mbs = [((0, 1), [0]), ((2,), [1]), ((3,), [2]), ((2, 3), [3]), ((0,), [4]), ((1,), [5])]
    experts = ["high", "low", "high", "low", "low", "high"]
    cut = with_rounds(_plan(mbs, experts), True, 4)
    assert sorted(m for r in cut.rounds for m in r) == list(range(len(mbs)))
    for r in cut.rounds:
        assert len({experts[m] for m in r}) == 1, r
    firsts = [experts[r[0]] for r in cut.rounds]
    assert firsts == sorted(firsts)  # the high expert's rounds, then the low one's
    assert round_violations(cut) == []


@pytest.mark.parametrize(
    "mode, cls, every_rank",
    [("none", ReplicatedStep, False), ("per_step", PerStepStep, True), ("per_layer", PerLayerStep, True)],
)
def test_each_mode_gets_its_strategy(mode, cls, every_rank):
    strategy = step_strategy(None, mode)
    assert type(strategy) is cls
    assert strategy.validates_on_every_rank is every_rank


def test_the_pipeline_timeline_sums_each_micro_batch_over_the_stages():
    """PP 2 x 2: every rank fills its stage's segment; the world SUM gathers them, and a micro-batch's
    seconds and comm seconds are the sums over stages (the whole model's), its start stage 0's.
    Planted and seen to fail: a segment of float32 (the seconds round), a start read from the last
    stage, the seconds of one stage only."""
    from dynamic_cp.runtime.pipeline import PipelineTimeline

    plan = Plan(micro_batches=[((0, 1), [0]), ((0,), [1]), ((1,), [2])], world_size=2, cap_tokens=1e9)
    # (stage, plan rank) -> {m: (ready, end, comm)}; stage 1 runs later and longer
    runs = {
        (0, 0): {0: (0.1, 1.1, 0.2), 1: (1.1, 2.6, 0.0)},
        (0, 1): {0: (0.3, 1.2, 0.4), 2: (1.2, 1.7, 0.0)},
        (1, 0): {0: (0.5, 2.5, 0.6), 1: (2.5, 3.0, 0.0)},
        (1, 1): {0: (0.6, 2.6, 0.8), 2: (2.6, 4.1, 0.0)},
    }
    gathered = 0
    for (stage, rank), mine in runs.items():
        t = PipelineTimeline(plan, rank, stage, 2)
        for m, (ready, end, comm) in mine.items():
            t.record(m, ready, end, comm)
        t.finish(max(e for _, e, _ in mine.values()))
        assert t.local().dtype == torch.float64
        gathered = gathered + t.local()
    rows = PipelineTimeline(plan, 0, 0, 2).micro_batch_seconds(gathered)
    expected = [  # start on stage 0; seconds and comm: stage 0's plus stage 1's
        (0.3, (1.2 - 0.3) + (2.6 - 0.6), (0.2 + 0.4) / 2 + (0.6 + 0.8) / 2),
        (1.1, 1.5 + 0.5, 0.0),
        (1.2, 0.5 + 1.5, 0.0),
    ]
    for got, want in zip(rows, expected):
        assert got == pytest.approx(want, abs=1e-12)  # float32 slots would be ~1e-8 off
