"""Two-expert (Wan2.2 A14B) sampling on 2 gloo processes equals sampling in one.

Requests with guidance_2 run on a Ulysses group of 2, a ring group of 2, and CFG-parallel (one branch
per rank); at shift 12 and boundary 0.875 three steps run the high expert twice and the low expert
once, on every rank of a group alike. Tolerance 1e-5 as derived in tests/test_sampling_parallel.py
(float32 reassociation only, whichever expert runs).

Planted and caught: the low expert's guidance taken from ``guidance`` on the ranks only (guidance_at
returning request.guidance in dynamic_cp/runtime/sampling.py): request 0 differs by 8e-2.
"""

from __future__ import annotations

import torch
from test_sampling_parallel import TOL, P, cost_model

from data.hashed_text import HashedTextEncoder
from dit.experts import ExpertPair
from dit.model import VideoDiT
from dit.sample_requests import SampleRequest
from dit.sampling import sample_request
from dynamic_cp.planning.sampling_planner import SamplingPlan
from dynamic_cp.runtime.testing import run_gloo

SHIFT = 12.0
REQUESTS = [
    SampleRequest(0, "a cat", 3, 6, 10, steps=3, guidance=4.0, seed=1, guidance_2=2.0),
    SampleRequest(
        1, "a dog", 2, 4, 6, steps=3, guidance=3.0, seed=2, negative_prompt="blurry", guidance_2=1.5
    ),
    SampleRequest(2, "a hen", 1, 8, 6, steps=3, guidance=5.0, seed=3),  # guidance_2 = guidance
]
PLAN = [P(0, (0, 1), (2, 1)), P(1, (0,), cfg=(1,)), P(2, (0, 1), (1, 2))]  # Ulysses, CFG-parallel, ring


def expert(seed: int) -> VideoDiT:
    torch.manual_seed(seed)
    return VideoDiT(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=3, text_dim=16,
        freq_dim=16, ffn_dim=48, num_layers=2, adaln_zero_init=False,
    ).eval()  # fmt: skip


def pair() -> ExpertPair:
    return ExpertPair(expert(0), expert(1), 0.875)


def _worker(rank, world_size):
    import torch.distributed as dist

    from dynamic_cp.runtime.groups import build_cp_groups
    from dynamic_cp.runtime.sampling import run_plan

    model = pair()
    cost = cost_model(model)
    groups = build_cp_groups(dist.group.WORLD, None, splits=cost.cp_layout)
    videos = {}
    plan = SamplingPlan(world_size, PLAN)
    enc = HashedTextEncoder(dim=16)
    run_plan(
        model, enc, None, REQUESTS, plan, groups, SHIFT, lambda r, v, p, s: videos.__setitem__(r.index, v)
    )
    return videos


def test_two_expert_requests_on_2_ranks_give_the_one_process_clips():
    model, enc = pair(), HashedTextEncoder(dim=16)
    calls = {"high": 0, "low": 0}
    for name in calls:
        getattr(model, name).register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    refs = [sample_request(model, enc, None, r, SHIFT) for r in REQUESTS]
    assert calls == {"high": 6, "low": 3}, calls  # 2 + 1 steps of each of 3 requests
    owned = {}
    for videos in run_gloo(_worker, 2):
        for index, video in videos.items():
            assert index not in owned, f"request {index} written by two ranks"
            owned[index] = video
    assert sorted(owned) == [0, 1, 2]
    for index, video in owned.items():
        diff = float((video - refs[index]).abs().max())
        assert diff <= TOL, f"request {index} differs from one process by {diff:.2e}"


def test_the_memory_check_prices_both_resident_experts():
    """Memory for one expert's bf16 weights and 40 tokens: a 30-token request fits one model but not
    the pair, whose idle expert stays resident (planted: pricing one expert: no error). The pair is in
    bf16, as ``--precision bf16`` loads it: the weights are priced in their own dtype."""
    import pytest

    from dit.model import cast_weights
    from dynamic_cp.planning.memory import BYTES_BF16, sampling_token_cap
    from dynamic_cp.runtime.sampling_plan import check_memory

    model = cast_weights(pair(), torch.bfloat16, keep_fp32=False)
    dims = cost_model(model).dims
    per_token = (16 * dims.d + 2 * dims.ffn) * BYTES_BF16
    memory = (BYTES_BF16 * dims.num_params + 40.5 * per_token) / 0.9
    assert sampling_token_cap(dims, memory) == 40
    request = [
        SampleRequest(0, "a cat", 2, 6, 10, steps=3, guidance=1.0, seed=1)
    ]  # 2x3x5 = 30 tokens, unguided
    check_memory(model.high, None, request, memory)
    with pytest.raises(ValueError, match="lower its frames, height or width"):
        check_memory(model, None, request, memory)
