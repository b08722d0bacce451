"""FSDP-sharded sampling on gloo processes equals sampling in one process (dynamic_cp/runtime/sampling.py).

The DiT (with a LoRA) is sharded over the whole world with training's FSDP2 units, and the queue runs
in lockstep rounds padded with empty forwards. Requests of 1-4 steps make the padding matter: a rank
whose request has fewer steps than the round's longest, or none in the round, must still join every
all-gather. W = 2 runs the planner's own sharded plan; W = 3 a hand plan of a ring over 3 ranks,
Ulysses over 2 beside CP 1, and CFG-parallel, turned into rounds by the planner's ``lockstep``.

Tolerance: test_sampling_parallel's TOL (1e-5), derived there. FSDP adds no arithmetic: it all-gathers
the exact fp32 parameters (the policy keeps the dtype the model was loaded in), so the sharded
forward computes with the same numbers as the replicated CP forward and the same bound holds.

Planted bugs, each seen to fail and then restored:
- ``shard_for_sampling`` returning without sharding: the check that each rank holds about 1/W of
  the parameters fails;
- ``run_plan`` padding a round with one empty forward fewer on ranks that ran a request: the
  all-gathers pair up a block with another unit's (gloo errors on the size mismatch);
- rank 1's shard of ``blocks.0.attn1.to_q`` (a LoRA'd weight) scaled by 1.01 after sharding (a shard
  loaded from the wrong place): W=2's request 2 differs by 3.8e-4, 38x the tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_sampling_parallel import REQUESTS, TOL, P, cost_model, make_model

from data.hashed_text import HashedTextEncoder
from dit.sampling import sample_request
from dynamic_cp.planning.sampling_planner import SamplingJob, SamplingPlan, lockstep
from dynamic_cp.runtime.testing import run_gloo

# the queue of test_sampling_parallel with 1-4 steps, so rounds need padding
STEPS = [3, 2, 4, 1, 2, 3]
FSDP_REQUESTS = [dataclasses.replace(r, steps=s) for r, s in zip(REQUESTS, STEPS)]
# W = 3: ring over 3, Ulysses over 2 beside CP 1, CFG-parallel, CP 3 (2-D is not possible on 3)
HAND_PLAN_3 = [P(0, (0, 1, 2), (1, 3)), P(1, (0, 1), (2, 1)), P(2, (2,)), P(3, (0,), cfg=(1,)),
               P(4, (2,)), P(5, (0, 1, 2), (1, 3))]  # fmt: skip


def _worker(rank, world_size, hand_plan):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dynamic_cp.runtime.groups import build_cp_groups
    from dynamic_cp.runtime.sampling import run_plan, shard_for_sampling
    from dynamic_cp.runtime.sampling_plan import plan_queue, request_tokens

    model, enc = make_model(lora=True), HashedTextEncoder(dim=16)
    full = sum(p.numel() for p in model.parameters())
    cost = cost_model(model)
    if hand_plan is None:
        plan = plan_queue(model, None, FSDP_REQUESTS, world_size, cost, None, cfg_parallel=True, sharded=True)
    else:
        jobs = [SamplingJob(request_tokens(model, None, r), r.steps, r.guided) for r in FSDP_REQUESTS]
        placements, rounds, forwards = lockstep(cost, jobs, hand_plan, world_size)
        plan = SamplingPlan(world_size, placements, {}, rounds, forwards)
    shard_for_sampling(model, dist.group.WORLD, torch.device("cpu"))
    params = list(model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    groups = build_cp_groups(dist.group.WORLD, None, splits=cost.cp_layout)
    videos = {}
    run_plan(
        model, enc, None, FSDP_REQUESTS, plan, groups, None, lambda r, v, p, s: videos.__setitem__(r.index, v)
    )
    sharded = all(isinstance(p, DTensor) for p in params)
    return videos, (local, full, sharded, plan.rounds, plan.round_forwards)


@pytest.fixture(scope="module")
def references():
    enc = HashedTextEncoder(dim=16)
    return [sample_request(make_model(lora=True), enc, None, r) for r in FSDP_REQUESTS]


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_sharded_sampling_gives_the_one_process_clips(references, world_size):
    results = run_gloo(_worker, world_size, None if world_size == 2 else HAND_PLAN_3)
    for rank, (_, (local, full, sharded, rounds, forwards)) in enumerate(results):
        # each rank keeps its 1/W of every tensor (FSDP pads dim 0 up to a multiple of W)
        assert sharded and local < full / world_size * 1.25, f"rank {rank} holds {local} of {full} parameters"
        assert rounds is not None and len(forwards) == len(rounds)
    owned = {}
    for videos, _ in results:
        for index, video in videos.items():
            assert index not in owned, f"W={world_size}: request {index} written by two ranks"
            owned[index] = video
    assert sorted(owned) == list(range(len(FSDP_REQUESTS)))
    for index, video in owned.items():
        diff = float((video - references[index]).abs().max())
        assert diff <= TOL, f"W={world_size} FSDP: request {index} differs from one process by {diff:.2e}"


def test_auto_shards_only_when_replicated_weights_leave_no_room():
    """``--fsdp auto`` prices the weights as Wan-14B's (28 GB in bf16: the tiny model's weights are
    cast to bf16, as ``--precision bf16`` loads them, and the dtype is what is priced) against the
    memory per rank: replicated on 80 GB, sharded on 30 GB (27 GB usable), where ``none`` is refused
    naming the fix. fp32 weights (56 GB) are priced at 4 bytes: on 60 GB (54 usable) they are sharded
    where bf16 ones stay replicated. Planted: auto never sharding fails the 30 GB case; the weights
    priced at 2 bytes whatever their dtype fails the fp32 case."""
    from dit.model import cast_weights
    from dynamic_cp.planning.cost_model import CostModel
    from dynamic_cp.runtime.sampling_plan import plan_with_weights

    fp32, wan14 = make_model(lora=False), CostModel.from_name("wan-14b", "h100").forward()
    assert plan_with_weights("auto", fp32, None, FSDP_REQUESTS, 8, wan14, 60e9, True)[0] == "per_layer"
    with pytest.raises(ValueError, match=r"fp32 weights \(56.2 GB a rank\).* \(or --precision bf16\)"):
        plan_with_weights("none", fp32, None, FSDP_REQUESTS, 8, wan14, 50e9, True)
    model = cast_weights(make_model(lora=False), torch.bfloat16, keep_fp32=False)
    assert plan_with_weights("auto", model, None, FSDP_REQUESTS, 8, wan14, 60e9, True)[0] == "none"
    mode, plan = plan_with_weights("auto", model, None, FSDP_REQUESTS, 8, wan14, 80e9, True)
    assert mode == "none" and plan.rounds is None
    mode, plan = plan_with_weights("auto", model, None, FSDP_REQUESTS, 8, wan14, 30e9, True)
    assert mode == "per_layer" and plan.rounds is not None
    with pytest.raises(ValueError, match="shard them with --fsdp per_layer"):
        plan_with_weights("none", model, None, FSDP_REQUESTS, 8, wan14, 30e9, True)
    # a request too long for replicated weights on 32 GB (0.8 GB free: 3,600 tokens) fits sharded ones
    long = [dataclasses.replace(FSDP_REQUESTS[0], frames=61, height=60, width=60, where="--prompt 1")]
    with pytest.raises(ValueError, match=r"--prompt 1: .* or shard the weights with --fsdp per_layer"):
        plan_with_weights("none", model, None, long, 8, wan14, 32e9, True)
    assert plan_with_weights("auto", model, None, long, 8, wan14, 32e9, True)[0] == "per_layer"
    with pytest.raises(ValueError, match="--fsdp per_step: use one of auto, none, per_layer"):
        plan_with_weights("per_step", model, None, FSDP_REQUESTS, 8, wan14, None, True)


def _bf16_worker(rank, world_size):
    import torch.distributed as dist
    from test_sampling_parallel import P

    from dit.sampler_setup import sampling_weights
    from dynamic_cp.runtime.groups import build_cp_groups
    from dynamic_cp.runtime.sampling import run_plan, shard_for_sampling
    from dynamic_cp.runtime.sampling_plan import request_tokens

    model = sampling_weights(make_model(lora=True), torch.bfloat16)  # as sample.py --precision bf16
    enc, cost = HashedTextEncoder(dim=16), cost_model(model)
    jobs = [SamplingJob(request_tokens(model, None, r), r.steps, r.guided) for r in FSDP_REQUESTS]
    # data parallel: each request on one rank with both branches packed, as one process runs it
    hand = [P(i, (i % world_size,)) for i in range(len(FSDP_REQUESTS))]
    placements, rounds, forwards = lockstep(cost, jobs, hand, world_size)
    plan = SamplingPlan(world_size, placements, {}, rounds, forwards)
    # this rank's one-process clips, in this process before sharding (same threads, same kernels)
    references = {
        p.job: sample_request(model, enc, None, FSDP_REQUESTS[p.job]) for p in hand if p.owner == rank
    }
    shard_for_sampling(model, dist.group.WORLD, torch.device("cpu"))
    dtypes = {p.dtype for p in model.parameters()}
    videos = {}
    groups = build_cp_groups(dist.group.WORLD, None, splits=cost.cp_layout)
    run_plan(
        model, enc, None, FSDP_REQUESTS, plan, groups, None, lambda r, v, p, s: videos.__setitem__(r.index, v)
    )
    return videos, references, dtypes


def test_bf16_sharded_sampling_gives_the_one_process_clips():
    """``--precision bf16`` with sharded weights: every parameter bf16 (FSDP2 gathers a unit in one
    dtype; with the norms kept fp32 it refuses the model), the forwards and the empty forwards of the
    lockstep rounds under bf16 autocast. Each request runs on one rank with both branches packed,
    the same operations on the same shapes as one process, and FSDP's all-gather copies the bf16
    weights exactly: the clips are bitwise the one-process clips computed in the same worker (same
    thread count, same kernels), whatever those kernels are. Planted: the empty forward without
    autocast (fp32 zero rows against bf16 weights: an error), the norms left fp32 (FSDP's dtype
    assertion)."""
    for rank, (videos, references, dtypes) in enumerate(run_gloo(_bf16_worker, 3)):
        assert dtypes == {torch.bfloat16}, f"rank {rank} holds {dtypes}"
        assert sorted(videos) == sorted(references) and videos, rank
        for index, video in videos.items():
            assert torch.equal(video, references[index]), f"bf16 request {index} differs from one process"
