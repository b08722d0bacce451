"""Image conditioning (dit/image_cond.py) equals diffusers' WanImageToVideoPipeline.prepare_latents.

A small random AutoencoderKLWan (temporal stride 4, spatial 8) encodes the condition video; the mask
must equal the pipeline's exactly, the latents within 1e-5 (fp32: the pipeline multiplies by 1/std
where data.vaes divides by std, one rounding apart on O(1) values).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

from data.image_cond import condition_mask, condition_video, image_condition
from data.vaes import DiffusersVAE
from dit.image_cond import join_condition
from dit.packing import patchify


def small_vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()


@pytest.mark.parametrize("frames, last", [(9, False), (9, True), (5, False), (1, False)])
def test_condition_equals_the_pipelines(frames, last):
    vae = small_vae()
    pipe = WanImageToVideoPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        transformer=None,
    )
    gen = torch.Generator().manual_seed(1)
    height, width = 16, 24  # latent 2 x 3: not square
    first = torch.rand(3, height, width, generator=gen) * 2 - 1
    last_image = torch.rand(3, height, width, generator=gen) * 2 - 1 if last else None
    _, want = pipe.prepare_latents(
        first[None], 1, 16, height, width, frames, torch.float32, torch.device("cpu"), None, None,
        last_image=None if last_image is None else last_image[None],
    )  # fmt: skip
    got = image_condition(DiffusersVAE("wan", vae), first, frames, last_image)
    assert got.shape == want[0].shape == (20, 1 + (frames - 1) // 4, 2, 3)
    assert torch.equal(got[:4], want[0, :4])  # the mask, exactly
    assert float((got[4:] - want[0, 4:]).abs().max()) <= 1e-5


def test_mask_by_hand():
    mask = condition_mask(9, 1, 1)  # pixel frames 0..8 -> latent frames {0}, {1..4}, {5..8}
    assert mask[:, :, 0, 0].tolist() == [[1, 0, 0]] * 4
    flf2v = condition_mask(9, 1, 1, last_frame=True)
    assert flf2v[:, :, 0, 0].tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 1]]  # frame 8 is t=3 of f=2
    assert condition_mask(3, 2, 2, temporal=1).squeeze(0)[:, 0, 0].tolist() == [1, 0, 0]  # pixel space
    with pytest.raises(ValueError, match="temporal stride 4; use e.g. 5"):
        condition_mask(8, 1, 1)
    video = condition_video(torch.ones(3, 2, 2), 4, -torch.ones(3, 2, 2))
    assert video[:, :, 0, 0].tolist() == [[1, 0, 0, -1]] * 3
    with pytest.raises(ValueError, match="same size"):
        condition_video(torch.ones(3, 2, 2), 4, torch.ones(3, 4, 2))


def test_join_condition_is_patchify_of_the_channel_concat():
    x, cond = torch.randn(4, 3, 4, 6), torch.randn(5, 3, 4, 6)
    patch = (1, 2, 2)
    joined = join_condition(patchify(x, patch), patchify(cond, patch), 4)
    assert torch.equal(joined, patchify(torch.cat([x, cond]), patch))


def test_model_and_data_channels_decide_the_task():
    from dit.image_cond import ImageConditioning, conditioning_of

    assert conditioning_of({"in_channels": 16, "out_channels": 16}, 16, 4) is None
    wan_i2v = {"in_channels": 36, "out_channels": 16, "image_dim": 1280}
    assert conditioning_of(wan_i2v, 16, 4) == ImageConditioning(
        last_frame=False, clip_tokens=True, temporal=4
    )
    flf2v = conditioning_of({**wan_i2v, "pos_embed_seq_len": 514}, 16, 4)
    assert flf2v.last_frame and flf2v.clip_tokens
    assert not conditioning_of({"in_channels": 36, "out_channels": 16}, 16, 4).clip_tokens  # Wan2.2 I2V
    with pytest.raises(ValueError, match=r"data gives 3: .* image-to-video one 7 in"):
        conditioning_of(wan_i2v, 3, 1)


def test_cache_without_conditioning_is_refused():
    from dit.clips import ClipEncoder
    from dit.image_cond import ImageConditioning

    encoder = ClipEncoder(None, None, torch.device("cpu"), conditioning=ImageConditioning(False, True, 4))
    sample = {"latent": torch.zeros(16, 1, 2, 2), "text_emb": torch.zeros(1, 4)}
    with pytest.raises(ValueError, match="cache has no image conditioning.*train from the videos"):
        encoder.encode_condition(sample)
