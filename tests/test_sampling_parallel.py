"""Sampling on several gloo processes equals sampling in one (dynamic_cp/runtime/sampling.py).

A queue of uneven shapes runs on hand-made plans that cover CP sizes 1-4, Ulysses, ring and 2-D
layouts, CFG-parallel on and off, requests side by side on disjoint groups, and a LoRA; and on the
planner's own plan. Every clip must equal the one-process clip of the same request.

Tolerance 1e-5 (absolute, on clips in [-1, 1]), derived: the parallel forward differs from the
one-process forward only by float32 reassociation, in the ring's log-sum-exp merge of partial
softmaxes and in GEMMs blocked over different row counts. Each such sum of K <= 64 terms (head dim,
width, keys of a clip) is off by at most K u |terms| with u = 2^-24 = 6e-8, i.e. a relative 4e-6 per
sum in the worst (fully correlated) case and about sqrt(K) u = 5e-7 typically. The velocity passes
through 2 layers of such sums (the relative errors add: ~1e-6 typical), and 3 Euler steps move x by
|d sigma| <= 1 in total times the velocity (|v| of order 1), so the clip differs by about 1e-6 and
by design less than 1e-5; the bound does not depend on AVX2 vs AVX-512 or the thread count, which
only pick among such reassociations.
"""

from __future__ import annotations

import pytest
import torch

from data.hashed_text import HashedTextEncoder
from dit.model import VideoDiT
from dit.sample_requests import SampleRequest
from dit.sampling import sample_request
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.model_dims import ModelDims
from dynamic_cp.planning.sampling_planner import Placement, SamplingPlan
from dynamic_cp.runtime.testing import run_gloo

TOL = 1e-5  # see the module docstring

# (frames, height, width, guidance) in pixel space, patch (1, 2, 2): 45, 2, 30, 12, 21 and 35 tokens
SHAPES = [(3, 6, 10, 4.0), (1, 4, 2, 3.0), (2, 10, 6, 1.0), (3, 4, 4, 5.0), (7, 2, 6, 2.5), (5, 2, 14, 4.0)]
REQUESTS = [
    SampleRequest(
        i,
        f"prompt {i}",
        f,
        h,
        w,
        steps=3,
        guidance=g,
        seed=100 + i,
        negative_prompt="blurry" if i % 2 else "",
    )
    for i, (f, h, w, g) in enumerate(SHAPES)
]


def P(job, ranks, layout=(1, 1), cfg=None):
    return Placement(job, tuple(ranks), None if cfg is None else tuple(cfg), layout, 0.0, 0.0)


# Each plan lists placements in the order every rank runs them; several use disjoint ranks at once.
PLANS = {
    2: [P(0, (0, 1), (2, 1)), P(1, (0, 1), (1, 2)), P(3, (0,), cfg=(1,)), P(2, (0,)), P(4, (1,)), P(5, (0, 1), (1, 2))],
    3: [P(0, (0, 1, 2), (1, 3)), P(1, (0, 1), (2, 1)), P(2, (2,)), P(3, (0,), cfg=(1,)), P(4, (2,)), P(5, (0, 1, 2), (1, 3))],
    4: [P(0, (0, 1, 2, 3), (2, 2)), P(3, (0, 1), (2, 1), cfg=(2, 3)), P(5, (0, 1, 2, 3), (4, 1)),
        P(1, (0, 1, 2, 3), (1, 4)), P(4, (0, 1), (1, 2), cfg=(2, 3)), P(2, (0, 1), (2, 1))],
}  # fmt: skip


def make_model(lora: bool) -> VideoDiT:
    torch.manual_seed(0)
    model = VideoDiT(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=3, text_dim=16,
        freq_dim=16, ffn_dim=48, num_layers=2, adaln_zero_init=False,
    ).eval()  # fmt: skip
    if lora:
        from dit.lora import add_lora, peft_config
        from dit.model_config import LoraSettings

        add_lora(model, peft_config(LoraSettings(rank=2, target_modules=["to_q", "to_v", "ffn.net.2"])))
        with torch.no_grad():  # peft starts B at zero: give the adapter an effect to get wrong
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape) * 0.3)
    return model


def cost_model(model) -> CostModel:
    return CostModel(ModelDims.from_config(model.config, text_tokens=8), Hardware.load("h100")).forward()


def _worker(rank, world_size, placements, lora, use_planner):
    import torch.distributed as dist

    from dynamic_cp.runtime.groups import build_cp_groups
    from dynamic_cp.runtime.sampling import run_plan
    from dynamic_cp.runtime.sampling_plan import plan_queue

    model, enc = make_model(lora), HashedTextEncoder(dim=16)
    cost = cost_model(model)
    if use_planner:
        plan = plan_queue(model, None, REQUESTS, world_size, cost, None, cfg_parallel=True)
    else:
        plan = SamplingPlan(world_size, placements)
    groups = build_cp_groups(dist.group.WORLD, None, splits=cost.cp_layout)
    videos = {}
    run_plan(
        model, enc, None, REQUESTS, plan, groups, None, lambda r, v, p, s: videos.__setitem__(r.index, v)
    )
    return videos, [(p.job, p.ranks, p.cfg_ranks, p.layout) for p in plan.placements]


@pytest.fixture(scope="module")
def references():
    enc = HashedTextEncoder(dim=16)
    return {
        lora: [sample_request(make_model(lora), enc, None, r) for r in REQUESTS] for lora in (False, True)
    }


def _check(results, refs, label):
    owned = {}
    for videos, _ in results:
        for index, video in videos.items():
            assert index not in owned, f"{label}: request {index} written by two ranks"
            owned[index] = video
    assert sorted(owned) == list(range(len(REQUESTS))), f"{label}: clips {sorted(owned)} came back"
    for index, video in owned.items():
        assert video.shape == refs[index].shape
        diff = float((video - refs[index]).abs().max())
        assert diff <= TOL, (
            f"{label}: request {index} differs from one process by {diff:.2e} (tolerance {TOL:.0e})"
        )


@pytest.mark.parametrize("world_size, lora", [(2, True), (3, False), (4, False)])
def test_hand_plans_give_the_one_process_clips(references, world_size, lora):
    results = run_gloo(_worker, world_size, PLANS[world_size], lora, False)
    _check(results, references[lora], f"W={world_size}")


def test_the_planners_plan_gives_the_one_process_clips(references):
    results = run_gloo(_worker, 2, None, False, True)
    plans = [placements for _, placements in results]
    assert all(p == plans[0] for p in plans)  # every rank planned the same
    _check(results, references[False], "planned W=2")


# Image-to-video, pixel space: 3 noisy + 1 mask + 3 image channels in, 3 out; CLIP tokens (image_dim)
# through the small random CLIP of tests/conftest.py. (frames, height, width, guidance, FLF2V)
I2V_SHAPES = [(3, 6, 10, 4.0), (2, 4, 6, 1.0), (5, 2, 14, 3.0)]
I2V_PLAN = [
    P(0, (0, 1, 2), (1, 3)),
    P(1, (0, 1), (2, 1)),
    P(2, (2,), cfg=(0,)),
]  # ring, Ulysses, CFG-parallel


def make_i2v_model() -> VideoDiT:
    torch.manual_seed(1)
    return VideoDiT(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=7, out_channels=3,
        text_dim=16, freq_dim=16, ffn_dim=48, num_layers=2, adaln_zero_init=False, image_dim=12,
        added_kv_proj_dim=32,
    ).eval()  # fmt: skip


def _i2v_worker(rank, world_size, requests, clip_path):
    import torch.distributed as dist

    from data.image_encoders import load_image_encoder
    from dynamic_cp.runtime.groups import build_cp_groups
    from dynamic_cp.runtime.sampling import run_plan

    model, enc, clip = make_i2v_model(), HashedTextEncoder(dim=16), load_image_encoder(clip_path)
    groups = build_cp_groups(dist.group.WORLD, None, splits=cost_model(model).cp_layout)
    videos = {}
    done = lambda r, v, p, s: videos.__setitem__(r.index, v)  # noqa: E731
    run_plan(model, enc, None, requests, SamplingPlan(world_size, I2V_PLAN), groups, None, done, clip)
    return videos, None


def test_image_to_video_requests_on_3_ranks_give_the_one_process_clips(tmp_path):
    """The condition (mask + image latent) and the CLIP tokens go with every shard and every CFG
    branch: a ring over 3 ranks, Ulysses over 2 and CFG-parallel give the one-process clips."""
    import imageio.v2 as imageio
    from conftest import save_small_clip

    from data.image_encoders import load_image_encoder

    clip_path = save_small_clip(tmp_path / "clip")
    rng = torch.Generator().manual_seed(3)
    requests = []
    for i, (f, h, w, g) in enumerate(I2V_SHAPES):
        image = tmp_path / f"first{i}.png"
        imageio.imwrite(image, torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
        requests.append(SampleRequest(i, f"prompt {i}", f, h, w, 3, g, 200 + i, "", str(image)))
    model, clip = make_i2v_model(), load_image_encoder(clip_path)
    refs = [sample_request(model, HashedTextEncoder(dim=16), None, r, None, clip) for r in requests]
    without = SampleRequest(0, "prompt 0", 3, 6, 10, 3, 4.0, 200)  # the image matters
    assert (refs[0] - sample_request(model, HashedTextEncoder(dim=16), None, without, None, clip, (
        torch.zeros(3, 6, 10), None))).abs().max() > 1e-3  # fmt: skip
    results = run_gloo(_i2v_worker, 3, requests, clip_path)
    owned = {i: v for videos, _ in results for i, v in videos.items()}
    assert sorted(owned) == [0, 1, 2]
    for i, video in owned.items():
        diff = float((video - refs[i]).abs().max())
        assert diff <= TOL, f"image-to-video request {i} differs from one process by {diff:.2e}"


def test_the_queue_plan_prices_each_clips_decode_by_its_pixels():
    """``plan_queue`` (what sample.py plans under torchrun) gives the planner each request's decoded
    pixels, frames x height x width, so the owner's decode is priced at the profile's rate. Planted:
    the pixels left out (0) -> fails."""
    from dynamic_cp.runtime.sampling_plan import plan_queue

    model = make_model(False)
    cost = cost_model(model)
    assert cost.hw.vae_decode_s_per_pixel > 0  # the H100 profile prices decodes
    plan = plan_queue(model, None, REQUESTS, 2, cost, None, cfg_parallel=True)
    for p in plan.placements:
        r = REQUESTS[p.job]
        assert p.decode == pytest.approx(r.frames * r.height * r.width * cost.hw.vae_decode_s_per_pixel)
