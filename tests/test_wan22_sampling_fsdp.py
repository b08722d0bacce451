"""FSDP-sharded sampling of a two-expert (Wan2.2 A14B) model, and of an image-to-video model, on gloo
processes equals sampling in one process (dynamic_cp/runtime/sampling.py).

Each expert is sharded over the whole world on its own (training's ``model.expert=both`` units), and
every lockstep round runs in two phases: H_k forwards of the high expert, then L_k of the low one,
every rank padding its request's forwards of each expert with empty ones (``RoundForwards``). The
queue is test_sampling_parallel's six uneven shapes with 1-6 steps at shift 5 (boundary 0.875), so the
requests switch experts at different steps: (high, low) = (2, 2), (1, 0), (1, 2), (3, 3), (1, 1),
(2, 3), and rounds put requests that switch at different steps side by side (checked below, so the
high phase's padding at the switch is exercised). W = 2 runs the planner's sharded plan (plan_queue,
as test_sampling_fsdp); W = 3 the hand plan of test_sampling_fsdp (ring over 3, Ulysses over 2
beside CP 1, CFG-parallel) turned into rounds by the planner's ``lockstep``.

Tolerance: test_sampling_parallel's TOL (1e-5), derived there; FSDP gathers the exact fp32 parameters
(test_sampling_fsdp), and which expert runs changes nothing in that derivation.

Planted bugs, each seen to fail and then restored:
- ``RoundForwards.before`` not padding the high phase at the switch (its padding then comes after
  the low forwards, in ``finish``): a rank's low forwards all-gather with another rank's empty high
  forwards (the experts have the same shapes, so gloo does not notice): request 3 differs by 3.0e-1
  on W=2 and 6.4e-1 on W=3;
- ``empty_forward`` running the other expert: the same kind of mismatch, request 3 off by 3.3e-1
  (W=2) and 1.5 (W=3);
- ``shard_for_sampling`` sharding only the high expert: the 1/W check on the low expert fails;
- the empty forward of the image-to-video model without its zero CLIP tokens (``fsdp.empty_micro_batch_loss``):
  the sharded I2V test fails (the model refuses a forward without image embeddings).
A hang would end in gloo's timeout: the runs pass ``timeout_s=60``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_sampling_fsdp import HAND_PLAN_3
from test_sampling_parallel import REQUESTS, TOL, cost_model, make_i2v_model
from test_wan22_sampling_parallel import pair

from data.hashed_text import HashedTextEncoder
from dit.sample_requests import SampleRequest
from dit.sampling import sample_request
from dynamic_cp.runtime.testing import run_gloo

SHIFT = 5.0
STEPS = [4, 1, 3, 6, 2, 5]
PHASES = [(2, 2), (1, 0), (1, 2), (3, 3), (1, 1), (2, 3)]  # (high, low) at SHIFT: asserted below
QUEUE = [
    dataclasses.replace(r, steps=s, guidance_2=2.0 if i % 3 == 0 else None)
    for i, (r, s) in enumerate(zip(REQUESTS, STEPS))
]


def _worker(rank, world_size, hand_plan):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dynamic_cp.planning.sampling_planner import SamplingPlan, lockstep, round_phases
    from dynamic_cp.runtime.groups import build_cp_groups
    from dynamic_cp.runtime.sampling import run_plan, shard_for_sampling
    from dynamic_cp.runtime.sampling_plan import plan_queue, sampling_jobs

    model, enc = pair(), HashedTextEncoder(dim=16)
    cost = cost_model(model)
    jobs = sampling_jobs(model, None, QUEUE, SHIFT)
    if hand_plan is None:
        plan = plan_queue(model, None, QUEUE, world_size, cost, None, True, sharded=True, shift=SHIFT)
    else:
        placements, rounds, forwards = lockstep(cost, jobs, hand_plan, world_size)
        phases = round_phases(jobs, placements, rounds)
        plan = SamplingPlan(world_size, placements, {}, rounds, forwards, phases)
    full = {n: sum(p.numel() for p in getattr(model, n).parameters()) for n in ("high", "low")}
    shard_for_sampling(model, dist.group.WORLD, torch.device("cpu"))
    local = {
        n: sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in getattr(model, n).parameters())
        for n in ("high", "low")
    }  # fmt: skip
    groups = build_cp_groups(dist.group.WORLD, None, splits=cost.cp_layout)
    videos = {}
    run_plan(model, enc, None, QUEUE, plan, groups, SHIFT, lambda r, v, p, s: videos.__setitem__(r.index, v))
    members = [[jobs[plan.placements[i].job].phases for i in r] for r in plan.rounds]
    return videos, (local, full, members, plan.round_phases, plan.round_forwards)


@pytest.fixture(scope="module")
def references():
    model, enc = pair(), HashedTextEncoder(dim=16)
    return [sample_request(model, enc, None, r, SHIFT) for r in QUEUE]


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_two_expert_sampling_gives_the_one_process_clips(references, world_size):
    from dynamic_cp.runtime.sampling_plan import sampling_jobs

    assert [j.phases for j in sampling_jobs(pair(), None, QUEUE, SHIFT)] == PHASES
    results = run_gloo(_worker, world_size, None if world_size == 2 else HAND_PLAN_3, timeout_s=60)
    for rank, (_, (local, full, members, phases, forwards)) in enumerate(results):
        for name in ("high", "low"):  # 1/W of each expert (FSDP pads dim 0 up to a multiple of W)
            assert local[name] < full[name] / world_size * 1.25, f"rank {rank} holds {local[name]} of {name}"
        assert phases == [tuple(max(c) for c in zip(*m)) for m in members]
        assert forwards == [sum(p) for p in phases]
    # some round has a request whose high phase ends before the round's and that then runs the low
    # expert: its rank must pad the high phase at the switch, inside the request
    members = results[0][1][2]
    assert any(hi < max(h for h, _ in m) and lo > 0 for m in members for hi, lo in m), members
    owned = {}
    for videos, _ in results:
        for index, video in videos.items():
            assert index not in owned, f"W={world_size}: request {index} written by two ranks"
            owned[index] = video
    assert sorted(owned) == list(range(len(QUEUE)))
    for index, video in owned.items():
        diff = float((video - references[index]).abs().max())
        assert diff <= TOL, f"W={world_size} two experts sharded: request {index} differs by {diff:.2e}"


def test_sharded_memory_holds_1_over_w_of_the_idle_expert():
    """plan_queue prices the idle expert's bf16 weights at 1/W when sharded (the cost model's Wan-14B
    experts, 28.1 GB each in bf16, 8 ranks): with the idle expert's 1/8 (3.5 GB) taken off, 90% of
    the rest must hold the running expert's 1/8 plus two gathered blocks (4.9 GB): 10 GB fits
    ((10 - 3.5) x 0.9 = 5.8), 8.5 GB does not (4.5). The pair is in bf16, as ``--precision bf16``
    loads it (the weights are priced in their own dtype). Planted: the idle expert priced whole -> the
    10 GB plan fails."""
    from dit.sampler_setup import sampling_weights
    from dynamic_cp.planning.cost_model import CostModel
    from dynamic_cp.runtime.sampling_plan import plan_with_weights

    wan14 = CostModel.from_name("wan-14b", "h100").forward()
    small = [dataclasses.replace(r, steps=2) for r in QUEUE[:2]]
    model = sampling_weights(pair(), torch.bfloat16)
    mode, plan = plan_with_weights("per_layer", model, None, small, 8, wan14, 10e9, True, shift=SHIFT)
    assert mode == "per_layer" and plan.round_phases is not None
    with pytest.raises(ValueError, match="do not fit"):
        plan_with_weights("per_layer", model, None, small, 8, wan14, 8.5e9, True, shift=SHIFT)


def _i2v_worker(rank, world_size, requests, clip_path):
    import torch.distributed as dist

    from data.image_encoders import load_image_encoder
    from dynamic_cp.runtime.groups import build_cp_groups
    from dynamic_cp.runtime.sampling import run_plan, shard_for_sampling
    from dynamic_cp.runtime.sampling_plan import plan_queue

    model, enc, clip = make_i2v_model(), HashedTextEncoder(dim=16), load_image_encoder(clip_path)
    cost = cost_model(model)
    # the requests on one rank each, side by side: the 3-step one's partner pads with empty
    # forwards, which carry zero CLIP tokens
    plan = plan_queue(model, None, requests, world_size, cost, None, False, sharded=True)
    shard_for_sampling(model, dist.group.WORLD, torch.device("cpu"))
    groups = build_cp_groups(dist.group.WORLD, None, splits=cost.cp_layout)
    videos = {}
    done = lambda r, v, p, s: videos.__setitem__(r.index, v)  # noqa: E731
    run_plan(model, enc, None, requests, plan, groups, None, done, clip)
    return videos, plan.round_forwards


def test_sharded_image_to_video_gives_the_one_process_clips(tmp_path):
    """An image-to-video request (condition channels and CLIP tokens) beside a shorter one, on 2
    ranks with the weights sharded: both equal the one-process clips. Planted: the empty forwards
    without CLIP tokens -> fails (module docstring)."""
    import imageio.v2 as imageio
    from conftest import save_small_clip

    from data.image_encoders import load_image_encoder

    clip_path = save_small_clip(tmp_path / "clip")
    rng = torch.Generator().manual_seed(3)
    requests = []
    for i, (f, h, w, g, steps) in enumerate([(3, 6, 10, 4.0, 3), (2, 4, 6, 3.0, 1)]):
        image = tmp_path / f"first{i}.png"
        imageio.imwrite(image, torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
        requests.append(SampleRequest(i, f"prompt {i}", f, h, w, steps, g, 200 + i, "", str(image)))
    model, clip = make_i2v_model(), load_image_encoder(clip_path)
    refs = [sample_request(model, HashedTextEncoder(dim=16), None, r, None, clip) for r in requests]
    results = run_gloo(_i2v_worker, 2, requests, clip_path, timeout_s=60)
    assert results[0][1] == [3], results[0][1]  # one round of 3 forwards: rank of request 1 pads 2
    owned = {i: v for videos, _ in results for i, v in videos.items()}
    assert sorted(owned) == [0, 1]
    for i, video in owned.items():
        diff = float((video - refs[i]).abs().max())
        assert diff <= TOL, f"sharded image-to-video request {i} differs from one process by {diff:.2e}"


def test_round_forwards_pad_the_high_phase_at_the_switch():
    """One process, replicated experts (an empty forward is then a plain zero-token forward): a rank
    in a round of (H, L) = (3, 2) whose request runs 1 high and 1 low forward runs the high expert 3
    times before its first low forward, then 2 low forwards in all. A forward beyond the round's
    count is an error, as is a one-phase plan for two experts. Planted: no padding at the switch ->
    no empty high forward before the low one, fails."""
    from dynamic_cp.runtime.sampling import RoundForwards

    model = pair()
    calls = []
    for name in ("high", "low"):
        getattr(model, name).register_forward_hook(lambda *_, n=name: calls.append(n))
    lockstep = RoundForwards(model, (3, 2))
    lockstep.before(torch.tensor(1000.0))  # the request's high forward (its forward is not run here)
    lockstep.before(torch.tensor(500.0))  # its low forward: the high phase is padded first
    assert calls == ["high", "high"]  # two empty high forwards: 1 real + 2 = 3
    lockstep.finish()
    assert calls == ["high", "high", "low"]  # one empty low forward: 1 real + 1 = 2
    over = RoundForwards(model, (1, 1))
    over.before(torch.tensor(1000.0))
    with pytest.raises(RuntimeError, match="more forwards of expert high than its lockstep round"):
        over.before(torch.tensor(999.0))
    with pytest.raises(ValueError, match="a plan of 1-phase rounds for a model of 2 expert"):
        RoundForwards(model, (4,))
