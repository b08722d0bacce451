"""dit/sampling.py's steps worked by hand, in one process and in seconds (the fast subset of
``tools/mutation.py`` for this module; ``test_sample_cli.py`` drives the same code end to end).

A stand-in model whose velocity does not depend on x makes the Euler steps exact: the sigmas run
from 1 to 0, so the clip ends at noise - v, where v is the guided mix u + g (c - u). A second one
that moves with x shows the shift. Image-to-video inputs are built by hand from the first (and
last) frame in pixel space (no VAE: stride 1, 3 channels, mask channel 1, in_channels 2 * 3 + 1).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import av
import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from dit import sample_conditioning, sample_output, sampling
from dit.flow import shift_for_tokens
from dit.packing import patchify, unpatchify
from dit.sample_requests import SampleRequest

C = 3  # data channels (pixel space)


class ConstantVelocity(torch.nn.Module):
    """Velocity of a token = scale * x (data channels) + the mean of its clip's caption's first p
    values; records every call's arguments."""

    def __init__(self, patch=(1, 1, 1), scale=0.0, in_channels=C, image_dim=None, last_frame=False):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(float(scale)))
        self.config = SimpleNamespace(
            patch_size=patch, in_channels=in_channels, out_channels=C, image_dim=image_dim,
            pos_embed_seq_len=8 if last_frame else None,
        )  # fmt: skip
        self.p = C * math.prod(patch)
        self.calls = []

    def forward(self, x, positions, seq_lens, timesteps, text, text_lens, attention, image=None):
        self.calls.append(dict(x=x.clone(), pos=positions, lens=seq_lens, t=timesteps, text=text,
                               text_lens=text_lens, attention=attention, image=image))  # fmt: skip
        per_clip = torch.stack([t.mean(0)[: self.p] for t in text.split(text_lens.tolist())])  # (clips, p)
        bias = per_clip.repeat_interleave(seq_lens, dim=0)  # (rows, p)
        data = x.view(x.shape[0], math.prod(self.config.patch_size), -1)[..., :C].flatten(1)
        return self.scale * data + bias


class Encoder:
    """Caption -> (2, 16) embedding: the caption's length in every value of row 0, 0 in row 1 (so a
    caption's mean is len / 2); bfloat16, which the sampler must turn into float32."""

    def __init__(self):
        self.asked = []

    def encode(self, captions):
        self.asked.append(list(captions))
        return [torch.tensor([[float(len(c))] * 16, [0.0] * 16], dtype=torch.bfloat16) for c in captions]


def request(**kw) -> SampleRequest:
    fields = dict(index=0, prompt="abcd", frames=2, height=2, width=4, steps=3, guidance=3.0, seed=5)
    return SampleRequest(**{**fields, **kw})


# --- shapes ---------------------------------------------------------------------------------------


def test_request_grid_is_the_latent_grid_over_the_patch():
    # causal VAE (4, 8, 8): 9 frames -> 3 latent frames; 32 x 48 -> 4 x 6; patch (1, 2, 2)
    assert sampling.request_grid(request(frames=9, height=32, width=48), (1, 2, 2), (4, 8, 8)) == (3, 2, 3)
    assert sampling.request_grid(request(frames=1, height=8, width=8), (1, 1, 1), (4, 8, 8)) == (1, 1, 1)
    assert sampling.request_grid(request(frames=6, height=1, width=1), (2, 1, 1), (1, 1, 1)) == (3, 1, 1)


@pytest.mark.parametrize(
    "frames, height, width, patch, stride, words",
    [
        (0, 8, 8, (1, 1, 1), (1, 1, 1), "frames, height and width must be positive, got 0x8x8"),
        (1, 0, 8, (1, 1, 1), (1, 1, 1), "must be positive, got 1x0x8"),
        (1, 8, 0, (1, 1, 1), (1, 1, 1), "must be positive, got 1x8x0"),
        (8, 8, 8, (1, 1, 1), (4, 8, 8), "frames=8: a causal video VAE with temporal stride 4 needs 1 + 4k frames, e.g. 5"),
        (12, 8, 8, (1, 1, 1), (4, 8, 8), "e.g. 9"),
        (6, 8, 8, (1, 1, 1), (4, 1, 1), "temporal stride 4 needs 1 + 4k frames, e.g. 5"),
        (5, 12, 8, (1, 1, 1), (4, 8, 8), "multiples of the VAE stride (8, 8), got 12x8"),
        (5, 8, 4, (1, 1, 1), (4, 8, 8), "got 8x4"),
        (5, 24, 8, (1, 2, 1), (4, 8, 8), "latent of the requested clip height=3"),
        (3, 4, 4, (2, 1, 1), (1, 1, 1), "frames=3 is not divisible by the patch size 2"),
    ],
)  # fmt: skip
def test_a_shape_the_vae_or_patch_cannot_make_names_the_request(frames, height, width, patch, stride, words):
    r = request(frames=frames, height=height, width=width, where="queue.jsonl line 4")
    with pytest.raises(ValueError, match="queue.jsonl line 4") as err:
        sampling.request_grid(r, patch, stride)
    assert words in str(err.value)


def test_a_temporal_stride_of_one_takes_any_frame_count():
    assert sampling.request_grid(request(frames=8, height=8, width=8), (1, 1, 1), (1, 8, 8)) == (8, 1, 1)


# --- noise, captions, scheduler ---------------------------------------------------------------------


def test_noise_comes_from_the_requests_seed():
    noise = sampling.request_noise(request(seed=11, index=3), 6, 4)
    torch.testing.assert_close(noise, torch.randn(6, 4, generator=torch.Generator().manual_seed(11)))


def test_captions_cond_then_uncond_in_float32_and_guidance_one_has_no_uncond():
    enc = Encoder()
    texts = sampling.encode_request(enc, request(prompt="ab", negative_prompt="xyz"), "cpu")
    assert enc.asked == [["ab", "xyz"]] and [t.dtype for t in texts] == [torch.float32] * 2
    assert [t[0, 0].item() for t in texts] == [2.0, 3.0]
    texts = sampling.encode_request(enc, request(guidance=1.0, negative_prompt="xyz"), "cpu")
    assert enc.asked[-1] == ["abcd"] and len(texts) == 1


def _sigmas(shift: float, steps: int = 4) -> torch.Tensor:
    scheduler = sampling.FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas


def test_scheduler_takes_the_shift_else_the_token_counts_and_the_steps():
    plain = sampling.request_scheduler(request(steps=4), 10, 1.0)
    assert len(plain.timesteps) == 4 and plain.sigmas[0] == 1 and plain.sigmas[-1] == 0
    three = sampling.request_scheduler(request(steps=4), 10, 3.0)
    torch.testing.assert_close(three.sigmas, _sigmas(3.0))
    assert (three.sigmas[1:-1] > plain.sigmas[1:-1]).all()  # a bigger shift: more steps at high noise
    by_tokens = sampling.request_scheduler(request(steps=4), 3000, None)
    torch.testing.assert_close(by_tokens.sigmas, _sigmas(float(shift_for_tokens(3000))))


# --- one step's velocity ------------------------------------------------------------------------


def test_branch_velocity_packs_one_copy_per_caption_and_slices_a_token_range():
    model = ConstantVelocity(scale=1.0)
    x = torch.arange(12.0).view(4, 3)  # 4 tokens
    pos = torch.arange(12).view(4, 3)
    texts = [torch.full((2, 8), 2.0), torch.full((3, 8), 4.0)]
    v = sampling.branch_velocity(model, x, torch.tensor(700), pos, texts, "attn")
    call = model.calls[-1]
    torch.testing.assert_close(call["x"], torch.cat([x, x]))
    torch.testing.assert_close(call["pos"], torch.cat([pos, pos]))
    assert call["lens"].tolist() == [4, 4] and call["text_lens"].tolist() == [2, 3]
    assert call["t"].dtype == torch.float32 and call["t"].tolist() == [700.0, 700.0]
    assert call["text"].shape == (5, 8) and call["attention"] == "attn" and call["image"] is None
    torch.testing.assert_close(v, torch.cat([x + 2, x + 4]))
    # rows 3..6 of the 8 packed rows: 1 token of the first branch, 2 of the second
    part = sampling.branch_velocity(model, x, torch.tensor(700), pos, texts, "attn", token_range=(3, 6))
    call = model.calls[-1]
    assert call["lens"].tolist() == [1, 2]
    torch.testing.assert_close(call["pos"], torch.cat([pos, pos])[3:6])
    torch.testing.assert_close(part, torch.cat([x + 2, x + 4])[3:6])


def test_branch_velocity_joins_the_condition_to_every_branch_and_hands_clip_tokens_to_every_clip():
    model = ConstantVelocity(patch=(1, 1, 2), in_channels=2 * C + 1, image_dim=5)
    x = torch.randn(2, 2 * C)  # 2 tokens, patch of 2 values per channel
    cond = torch.randn(2, 2 * (C + 1))
    clip = torch.randn(4, 5)
    texts = [torch.zeros(1, 8), torch.ones(1, 8)]
    sampling.branch_velocity(model, x, torch.tensor(1), torch.zeros(2, 3), texts, None, (1, 4), cond, clip)
    call = model.calls[-1]
    # per patch position: the 3 data channels, then the 4 condition channels
    joined = torch.cat([x.view(2, 2, C), cond.view(2, 2, C + 1)], dim=-1).flatten(1)
    torch.testing.assert_close(call["x"], torch.cat([joined, joined])[1:4])
    assert call["image"].shape == (2, 4, 5)  # both clips of the shard
    torch.testing.assert_close(call["image"][1], clip)


def test_prepared_velocity_passes_its_request_inputs():
    model = ConstantVelocity(scale=1.0)
    prep = sampling.Prepared((1, 1, 2), torch.zeros(2, 3), torch.ones(2, C), [torch.full((1, 8), 6.0)])
    assert prep.num_tokens == 2
    v = prep.velocity(model, torch.ones(2, C), torch.tensor(3), "attn", token_range=(1, 2))
    torch.testing.assert_close(v, torch.full((1, C), 7.0))
    with pytest.raises(AttributeError):
        prep.noise = None  # frozen: every rank shares it


@pytest.mark.parametrize("guidance", [1.0, 3.0, -0.5])
def test_euler_steps_end_at_noise_minus_the_guided_velocity(guidance):
    sched = sampling.request_scheduler(request(steps=5), 4, 2.0)
    cond, uncond = torch.full((4, C), 2.0), torch.full((4, C), -1.0)
    seen = []

    def velocities(x, t):
        seen.append(t)
        return cond, (None if guidance == 1.0 else uncond)

    x0 = torch.randn(4, C)
    x = sampling.denoise(x0, sched, velocities, guidance)
    mixed = cond if guidance == 1.0 else uncond + guidance * (cond - uncond)
    torch.testing.assert_close(x, x0 - mixed, rtol=0, atol=1e-5)
    assert len(seen) == 5


def test_decode_unpatchifies_then_clamps_on_the_cpu():
    tokens = torch.linspace(-3, 3, 2 * 12).view(2, 12)  # grid (1, 1, 2), patch (1, 2, 2), 3 channels
    video = sampling.decode(tokens, (1, 1, 2), (1, 2, 2), None)
    torch.testing.assert_close(video, unpatchify(tokens, (1, 1, 2), (1, 2, 2)).clamp(-1, 1))
    assert video.shape == (3, 1, 2, 4) and video.min() == -1 and video.max() == 1

    class HalvingVAE:
        def decode(self, latents):
            return latents / 2

    halved = sampling.decode(tokens, (1, 1, 2), (1, 2, 2), HalvingVAE())
    torch.testing.assert_close(halved, (unpatchify(tokens, (1, 1, 2), (1, 2, 2)) / 2).clamp(-1, 1))


# --- a whole request ------------------------------------------------------------------------------


def test_a_request_ends_at_its_noise_minus_the_guided_velocity():
    model, enc = ConstantVelocity(patch=(1, 1, 2)), Encoder()
    r = request(prompt="abcdef", negative_prompt="ab", guidance=3.0, seed=7, frames=2, height=2, width=4)
    latent = sampling.sample_request(model, enc, None, r, shift=2.0, return_latents=True)
    noise = torch.randn(2 * 2 * 2, C * 2, generator=torch.Generator().manual_seed(7))  # 8 tokens
    cond, uncond = 6 / 2, 2 / 2  # the captions' means
    expected = unpatchify(noise - (uncond + 3.0 * (cond - uncond)), (2, 2, 2), (1, 1, 2))
    torch.testing.assert_close(latent, expected, rtol=0, atol=1e-5)
    assert len(model.calls) == 3 and all(c["lens"].tolist() == [8, 8] for c in model.calls)
    assert model.calls[0]["attention"].cu_seqlens.tolist() == [0, 8, 16]  # each branch attends to itself
    assert model.calls[0]["pos"][:8].tolist() == [
        [f, h, w] for f in range(2) for h in range(2) for w in range(2)
    ]
    video = sampling.sample_request(model, enc, None, r, shift=2.0)
    torch.testing.assert_close(video, expected.clamp(-1, 1))


def test_unguided_request_runs_one_branch():
    model = ConstantVelocity()
    r = request(guidance=1.0, prompt="ab", seed=3, frames=1, height=1, width=2)
    latent = sampling.sample_request(model, Encoder(), None, r, shift=1.0, return_latents=True)
    noise = torch.randn(2, C, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(latent, unpatchify(noise - 1.0, (1, 1, 2), (1, 1, 1)), rtol=0, atol=1e-5)
    assert model.calls[0]["attention"].cu_seqlens.tolist() == [0, 2]


def test_the_shift_reaches_the_steps_and_defaults_to_the_token_counts():
    model = ConstantVelocity(scale=-1.5)  # the velocity moves with x: the sigmas matter
    r = request(frames=1, height=2, width=2, guidance=1.0)

    def run(shift):
        return sampling.sample_request(model, Encoder(), None, r, shift=shift, return_latents=True)

    torch.testing.assert_close(run(None), run(float(shift_for_tokens(4))))
    assert not torch.allclose(run(1.0), run(3.0))


def test_given_noise_replaces_the_seeded_noise():
    model = ConstantVelocity(patch=(1, 2, 1))
    noise = torch.randn(C, 1, 2, 2)
    r = request(frames=1, height=2, width=2, guidance=1.0, prompt="ab")
    latent = sampling.sample_request(model, Encoder(), None, r, shift=1.0, noise=noise, return_latents=True)
    torch.testing.assert_close(latent, noise - 1.0, rtol=0, atol=1e-5)


def test_generate_gives_prompt_i_seed_plus_i_and_checks_every_request_first():
    model, enc = ConstantVelocity(), Encoder()
    videos = sampling.generate(model, enc, None, ["ab", "abcd"], 1, 1, 2, steps=2, guidance=1.0, seed=4)
    for i, (video, mean) in enumerate(zip(videos, [1.0, 2.0])):
        noise = torch.randn(2, C, generator=torch.Generator().manual_seed(4 + i))
        torch.testing.assert_close(video, unpatchify(noise - mean, (1, 1, 2), (1, 1, 1)).clamp(-1, 1))
    noise = torch.randn(2, C, 1, 1, 2)
    latents = sampling.generate(model, enc, None, ["ab", "ab"], 1, 1, 2, 2, 1.0, 1.0, noise=noise, return_latents=True)  # fmt: skip
    torch.testing.assert_close(torch.stack(latents), noise - 1.0, rtol=0, atol=1e-5)
    assert sampling.generate(model, enc, None, ["ab"], 1, 1, 2, steps=1, guidance=1.0)[0].shape == (
        C,
        1,
        1,
        2,
    )
    with pytest.raises(ValueError, match="steps=0 must be at least 1"):
        sampling.generate(model, enc, None, ["ab"], 1, 1, 2, steps=0)
    calls = len(model.calls)
    with pytest.raises(ValueError, match="drop --image"):  # the bad frame is found before any step
        sampling.generate(model, enc, None, ["ab"], 1, 1, 2, steps=1, image=torch.zeros(3, 1, 2))
    assert len(model.calls) == calls
    assert sampling.generate(model, enc, None, ["ab"], 1, 1, 2, steps=2, guidance=5.0)[0].shape == (
        C,
        1,
        1,
        2,
    )
    assert enc.asked[-1] == ["ab", ""]  # the default negative prompt


def test_generate_defaults_are_30_steps_and_guidance_5():
    moving = ConstantVelocity(scale=-0.5)  # moves with x: the number of steps shows

    def run(**kw):
        return sampling.generate(
            moving, Encoder(), None, ["ab"], 1, 1, 2, shift=1.0, return_latents=True, **kw
        )[0]

    torch.testing.assert_close(run(), run(steps=30))
    assert not torch.allclose(run(), run(steps=29))
    fixed = ConstantVelocity()  # ends at noise - (u + g (c - u)): u = 0 (empty negative prompt), c = 1
    latent = sampling.generate(
        fixed, Encoder(), None, ["ab"], 1, 1, 2, steps=1, shift=1.0, return_latents=True
    )[0]
    noise = torch.randn(2, C, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(latent, unpatchify(noise - 5.0, (1, 1, 2), (1, 1, 1)), rtol=0, atol=1e-5)


# --- image-to-video -------------------------------------------------------------------------------


def _png(path, pixels: np.ndarray):
    imageio.imwrite(path, pixels.astype(np.uint8))
    return str(path)


def test_i2v_condition_is_the_mask_and_the_first_frame_then_zeros():
    model = ConstantVelocity(in_channels=2 * C + 1)
    image = torch.rand(3, 2, 2) * 2 - 1
    r = request(frames=3, height=2, width=2, guidance=1.0)
    prep = sampling.prepare(model, Encoder(), None, r, images=(image, None))
    mask = torch.zeros(1, 3, 2, 2)
    mask[:, 0] = 1
    video = torch.cat([image[:, None], torch.zeros(3, 2, 2, 2)], dim=1)
    torch.testing.assert_close(prep.condition, patchify(torch.cat([mask, video]), (1, 1, 1)))
    assert prep.image_tokens is None and prep.grid == (3, 2, 2) and prep.positions.shape == (12, 3)


def test_flf2v_reads_both_frames_from_the_request_and_hands_their_clip_tokens():
    class FrameMeans:
        def encode(self, frames):  # (k, 3, H, W) -> (k, 2, 5): 2 tokens a frame
            return frames.double().mean((1, 2, 3))[:, None, None].expand(-1, 2, 5)

    model = ConstantVelocity(in_channels=2 * C + 1, image_dim=5, last_frame=True)
    tmp = pytest.importorskip("pathlib").Path(__import__("tempfile").mkdtemp())
    first = _png(tmp / "first.png", np.full((2, 4, 3), 255))  # white -> 1
    last = _png(tmp / "last.png", np.zeros((2, 4, 3)))  # black -> -1
    r = request(frames=3, height=2, width=4, image=first, last_image=last)
    images = sample_conditioning.request_images(r)
    assert [tuple(i.shape) for i in images] == [(3, 2, 4)] * 2
    prep = sampling.prepare(model, Encoder(), None, r, image_encoder=FrameMeans())
    assert prep.image_tokens.dtype == torch.float32
    torch.testing.assert_close(prep.image_tokens, torch.tensor([1.0, 1, -1, -1])[:, None].expand(4, 5))
    cond = unpatchify(prep.condition, prep.grid, (1, 1, 1))  # (1 + 3, f, h, w)
    assert cond[0, :, 0, 0].tolist() == [1.0, 0.0, 1.0]  # first and last frame given
    assert cond[1:, 0].unique().tolist() == [1.0] and cond[1:, 2].unique().tolist() == [-1.0]
    assert cond[1:, 1].abs().max() == 0
    assert sample_conditioning.request_images(request()) == (None, None)
    x = sampling.sample_request(model, Encoder(), None, r, image_encoder=FrameMeans(), return_latents=True)
    assert x.shape == (C, 3, 2, 4) and model.calls[-1]["image"].shape == (2, 4, 5)


def test_i2v_with_a_vae_encodes_the_condition_video_with_it():
    class DoublingVAE:
        stride = (1, 1, 1)

        def encode(self, video):
            return 2 * video

        def decode(self, latents):
            return latents

    model = ConstantVelocity(in_channels=2 * C + 1)
    image = torch.full((3, 1, 1), 0.25)
    prep = sampling.prepare(
        model, Encoder(), DoublingVAE(), request(frames=1, height=1, width=1), images=(image, None)
    )
    torch.testing.assert_close(prep.condition, torch.tensor([[1.0, 0.5, 0.5, 0.5]]))


@pytest.mark.parametrize(
    "config, image, last, words",
    [
        (dict(), (3, 2, 4), None, "request 0: an image was given but this is a text-to-video model; drop --image"),
        (dict(), None, (3, 2, 4), "drop --image"),
        (dict(in_channels=7), None, None, "pass the first frame with --image PATH (or"),
        (dict(in_channels=7, last_frame=True), None, None, "--image PATH and the last with --last-image PATH"),
        (dict(in_channels=7), (3, 2, 4), (3, 2, 4), "this model takes no --last-image (only FLF2V models do)"),
        (dict(in_channels=7, last_frame=True), (3, 2, 4), None, "needs --last-image PATH (FLF2V"),
        (dict(in_channels=7), (3, 4, 2), None, "--image is 2x4 but the clip is 4x2 (width x height); resize the image or pass --width 2 --height 4"),
        (dict(in_channels=7, last_frame=True), (3, 2, 4), (3, 2, 3), "--last-image is 3x2"),
        (dict(in_channels=7, image_dim=5), (3, 2, 4), None, "this model has image_dim: pass an image encoder"),
    ],
)  # fmt: skip
def test_frames_that_do_not_fit_the_model_name_the_request_and_the_fix(config, image, last, words):
    model = ConstantVelocity(**config)
    frames = tuple(None if s is None else torch.zeros(s) for s in (image, last))
    r = request(frames=3, height=2, width=4)
    with pytest.raises(ValueError) as err:
        sampling.prepare(model, Encoder(), None, r, images=frames)
    assert words in str(err.value)
    if "image_dim" not in words:  # check_requests refuses it before any clip
        with pytest.raises(ValueError, match="request 0"):
            sampling.check_requests(model, None, [r], frames)


def test_check_requests_reads_each_requests_own_files(tmp_path):
    model = ConstantVelocity(in_channels=2 * C + 1)
    good = request(frames=1, height=2, width=4, image=_png(tmp_path / "a.png", np.zeros((2, 4, 3))))
    bad = request(index=1, frames=1, height=2, width=4, image=_png(tmp_path / "b.png", np.zeros((4, 4, 3))))
    sampling.check_requests(model, None, [good])
    with pytest.raises(ValueError, match="request 1: --image is 4x4"):
        sampling.check_requests(model, None, [good, bad])
    with pytest.raises(ValueError, match="request 1: height and width must be multiples"):
        sampling.check_requests(model, SimpleNamespace(stride=(1, 4, 4)), [request(index=1, frames=1)])


# --- files ----------------------------------------------------------------------------------------


def test_frames_to_uint8_round_clamp_and_enlarge():
    video = torch.tensor([-3.0, -1.0, -0.5, 0.0, 1.0, 2.0]).view(1, 1, 1, 6).expand(3, 2, 1, 6)
    frames = sample_output.to_uint8_frames(video)
    assert frames.shape == (2, 1, 6, 3) and frames.dtype == torch.uint8
    assert frames[0, 0, :, 0].tolist() == [0, 0, 64, 128, 255, 255]
    big = sample_output.to_uint8_frames(torch.arange(4.0).view(1, 1, 2, 2).expand(3, 1, 2, 2) / 4, upscale=2)
    assert big.shape == (1, 4, 4, 3)
    assert big[0, :, :, 0].tolist() == [[128, 128, 159, 159], [128, 128, 159, 159],
                                         [191, 191, 223, 223], [191, 191, 223, 223]]  # fmt: skip


def test_frame_grid_rows_are_prompts_and_columns_frames():
    a = torch.full((3, 2, 1, 2), -1.0)  # 2 frames of 1 x 2
    b = torch.full((3, 2, 1, 2), 1.0)
    b[:, 1] = 0.0
    grid = sample_output.frame_grid([a, b], upscale=2)
    assert grid.shape == (4, 8, 3)
    assert grid[:, :, 0].tolist() == [[0] * 8] * 2 + [[255] * 4 + [128] * 4] * 2


def test_slug_output_path_and_written_file_names(tmp_path):
    assert sample_output.slug("  A Red-Ball, at 3 PM!  ") == "a_red_ball_at_3_pm"
    assert sample_output.slug("x" * 70) == "x" * 60 and sample_output.slug("x" * 9, limit=4) == "xxxx"
    assert sample_output.slug("!!") == "unconditional"
    r = request(index=3, prompt="Two Cats", seed=12)
    path = sample_output.output_path(tmp_path, r, "shift=2")
    assert path == tmp_path / f"03_two_cats_seed12_{r.key('shift=2')}.mp4"
    assert path != sample_output.output_path(tmp_path, r)


def _read(path):
    with av.open(str(path)) as f:
        stream = f.streams.video[0]
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(stream)]
        return stream.average_rate, frames


def test_write_clips_writes_one_mp4_per_prompt_and_a_grid(tmp_path):
    videos = [torch.full((3, 2, 3, 5), -1.0), torch.full((3, 2, 3, 5), 1.0)]
    out = tmp_path / "new" / "dir"  # created
    paths = sample_output.write_clips(videos, ["Red", "blue sky"], out, seed=9, fps=6, tag="step10_")
    names = [p.name for p in paths]
    assert names == ["step10_00_red_seed9.mp4", "step10_01_blue_sky_seed9.mp4", "step10_grid_seed9.png"]
    assert all(p.is_file() for p in paths)
    rate, frames = _read(paths[1])
    assert rate == 6 and len(frames) == 2 and frames[0].shape == (12, 20, 3)  # upscale 4 by default
    assert frames[0].min() > 240
    assert imageio.imread(paths[2]).shape == (2 * 12, 2 * 20, 3)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temporary folder left
    small = [torch.zeros(3, 1, 2, 6)]
    paths = sample_output.write_clips(small, ["x"], tmp_path / "b", seed=1, upscale=1, grid=False)
    rate, frames = _read(paths[0])
    assert len(paths) == 1 and rate == 8 and frames[0].shape == (2, 6, 3)  # kept (not padded to 16 px)


def test_remove_partials_deletes_only_what_a_killed_job_left(tmp_path):
    assert sample_output.remove_partials(tmp_path / "missing") == 0
    (tmp_path / ".partial-abc").mkdir()
    (tmp_path / ".partial-abc" / "00_x.mp4").write_bytes(b"half")
    (tmp_path / ".partial-def").mkdir()
    (tmp_path / "00_done.mp4").write_bytes(b"clip")
    assert sample_output.remove_partials(tmp_path) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["00_done.mp4"]
    (tmp_path / ".partial-stray").write_bytes(b"")  # a file of that name: left, the job goes on
    assert sample_output.remove_partials(tmp_path) == 1


def test_a_write_that_fails_leaves_neither_the_clip_nor_its_temporary_folder(tmp_path):
    target = tmp_path / "sub" / "00_x.mp4"
    with pytest.raises(RuntimeError):
        with sample_output._partial(target) as tmp:
            assert tmp.name == "00_x.mp4" and tmp.parent.name.startswith(".partial-")
            tmp.write_bytes(b"half")
            raise RuntimeError("killed")
    assert list((tmp_path / "sub").iterdir()) == []
    with sample_output._partial(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and [p.name for p in (tmp_path / "sub").iterdir()] == ["00_x.mp4"]
    with sample_output._partial(target) as tmp:
        tmp.write_bytes(b"again")  # replaces an older clip of the same name
    assert target.read_bytes() == b"again"


def test_sample_queue_writes_each_missing_clip_and_skips_the_rest(tmp_path, capsys):
    model = ConstantVelocity()
    queue = [request(index=i, prompt=p, frames=1, height=1, width=2, steps=1, guidance=1.0) for i, p in enumerate("ab")]  # fmt: skip
    paths = {r.index: sample_output.output_path(tmp_path, r) for r in queue}
    paths[0].write_bytes(b"done")
    written = sampling.sample_queue(model, Encoder(), None, queue, paths, 1.0, fps=4, upscale=2)
    assert written == [paths[1]] and paths[0].read_bytes() == b"done"
    out = capsys.readouterr().out
    assert "1 of 2 clips already in place; sampling 1" in out and f"[1/1] {paths[1]}" in out
    rate, frames = _read(paths[1])
    assert rate == 4 and frames[0].shape == (2, 4, 3)
    assert sampling.sample_queue(model, Encoder(), None, queue, paths, 1.0) == []
    assert len(model.calls) == 1
    paths[0].unlink()
    sampling.sample_queue(model, Encoder(), None, queue, paths, 1.0)
    assert "clips already in place" in capsys.readouterr().out and len(model.calls) == 2


def test_model_stride_and_data_channels():
    model = ConstantVelocity(in_channels=7)
    assert sample_conditioning.model_stride(model, None) == (1, 1, 1)
    assert sample_conditioning.model_stride(model, SimpleNamespace(stride=[4, 8, 8])) == (4, 8, 8)
    assert sample_conditioning.data_channels(model) == C
    model.config.out_channels = None
    assert sample_conditioning.data_channels(model) == 7


def test_a_clip_h264_cannot_hold_is_refused_naming_the_request_and_the_fix():
    from dit.sample_output import check_writable

    odd = SampleRequest(3, "p", 1, 7, 8, 1, 1.0, 0, where="queue.jsonl line 4")
    with pytest.raises(ValueError, match=r"queue.jsonl line 4: a 8x7 clip .*after --upscale 1.* --upscale 2"):
        check_writable([odd], 1)
    check_writable([odd], 2)  # 14 x 16 pixels once enlarged: even
    with pytest.raises(ValueError, match="a 24x21 clip"):
        check_writable([odd], 3)


def test_the_weights_dtype_sets_the_compute_precision():
    """bf16 weights (``sample.py --precision bf16``) run under bf16 autocast; fp32 weights leave the
    caller's autocast as it is (the trainer's previews run under its own); a model without linear
    layers takes its parameters' dtype. Planted: fp32 weights opening an autocast of their own (it
    turns the caller's off), the dtype ignored."""
    cpu = torch.device("cpu")
    fp32 = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    bf16 = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert sampling.compute_dtype(fp32) == torch.float32 and sampling.compute_dtype(bf16) == torch.bfloat16
    assert sampling.compute_dtype(ConstantVelocity().to(torch.bfloat16)) == torch.bfloat16
    assert sampling.compute_dtype(torch.nn.Identity()) == torch.float32
    with sampling.compute_precision(bf16, cpu):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with sampling.compute_precision(fp32, cpu):
        assert not torch.is_autocast_enabled("cpu")
    # the weights' dtype, not the device's default autocast dtype (fp16 on CUDA, bf16 on CPU)
    with sampling.compute_precision(fp32.to(torch.float16), cpu):
        assert torch.get_autocast_dtype("cpu") == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16), sampling.compute_precision(fp32, cpu):
        assert torch.is_autocast_enabled("cpu")
