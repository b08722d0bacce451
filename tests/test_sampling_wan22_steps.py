"""dit/sampling.py's Wan2.2 paths worked by hand, in one process and seconds (in the fast subset of
``tools/mutation.py dit/sampling.py``; the parity with diffusers' pipelines is in
``test_ti2v_sampling.py`` and ``test_wan22_a14b.py``, which take minutes):

- TI2V-5B image-to-video: the given frame's tokens run at timestep 0 in every branch, stand in for
  latent frame 0 at every step and in the result;
- A14B: ``guidance`` where the high-noise expert runs, ``guidance_2`` where the low one does;
- the shape checks at their edges, and the one-process queue's defaults.

The stand-in models are ``test_sampling_steps.ConstantVelocity`` (a velocity that does not depend on
x makes the Euler steps exact), with per-token timesteps recorded.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dit import sample_conditioning, sample_output, sampling
from dit.packing import grid_positions, patchify
from tests.test_sampling_steps import C, ConstantVelocity, Encoder, _read, request


class PerTokenTime(ConstantVelocity):
    """A TI2V-like stand-in: ``expand_timesteps`` set, takes and records ``token_timesteps``."""

    def __init__(self, patch=(1, 1, 1)):
        super().__init__(patch=patch)
        self.config.expand_timesteps = True
        self.token_times = []

    def forward(self, x, positions, seq_lens, timesteps, text, text_lens, attention, image=None, token_timesteps=None):  # fmt: skip
        self.token_times.append(None if token_timesteps is None else token_timesteps.clone())
        return super().forward(x, positions, seq_lens, timesteps, text, text_lens, attention, image)


def _image(h: int, w: int) -> torch.Tensor:
    """(3, h, w) in [-1, 1], every value different (so a frame read off by a channel shows)."""
    return torch.linspace(-0.9, 0.9, 3 * h * w).view(3, h, w)


# --- TI2V ------------------------------------------------------------------------------------------


def test_clean_tokens_run_at_timestep_zero_in_every_branch_and_shard():
    """Planted: the clean mask ignored (``torch.where`` dropped), the per-token times not repeated
    for the second branch -> fails."""
    model = PerTokenTime()
    x, pos = torch.randn(4, C), torch.zeros(4, 3)
    clean = torch.tensor([True, True, False, False])
    texts = [torch.zeros(1, 8), torch.ones(1, 8)]
    sampling.branch_velocity(model, x, torch.tensor(700), pos, texts, None, clean=clean)
    assert model.token_times[-1].tolist() == [0.0, 0.0, 700.0, 700.0] * 2
    sampling.branch_velocity(model, x, torch.tensor(700), pos, texts, None, (3, 6), clean=clean)
    assert model.token_times[-1].tolist() == [700.0, 0.0, 0.0]  # rows 3..5 of the 8 packed
    sampling.branch_velocity(model, x, torch.tensor(700), pos, texts, None)
    assert model.token_times[-1] is None  # text-to-video: one timestep a clip


def test_ti2v_first_frame_is_the_image_on_latent_frame_zero():
    """Pixel space (no VAE): the image's tokens broadcast over the grid's frames, clean exactly on
    frame 0. Text-to-video (no image): None. Planted: frames counted from 1, the image's height used
    as its channels, the clean mask on frame 1 -> fails."""
    model = PerTokenTime(patch=(1, 2, 1))
    r = request(frames=3, height=4, width=3)
    positions = grid_positions((3, 2, 3))
    image = _image(4, 3)
    tokens, clean = sample_conditioning.ti2v_first_frame(model, None, r, image, None, positions)
    want = patchify(image[:, None].expand(-1, 3, -1, -1), (1, 2, 1))  # (18, 3 * 2)
    torch.testing.assert_close(tokens, want, rtol=0, atol=0)
    assert clean.tolist() == [True] * 6 + [False] * 12
    assert sample_conditioning.ti2v_first_frame(model, None, r, None, None, positions) is None


def test_ti2v_refuses_a_last_frame_naming_the_fix():
    model = PerTokenTime()
    r = request(frames=2, height=2, width=2, where="queue.jsonl line 2")
    with pytest.raises(
        ValueError, match="queue.jsonl line 2: Wan2.2 TI2V takes a first frame only; drop --last-image"
    ):
        sample_conditioning.checked_conditioning(model, None, r, _image(2, 2), _image(2, 2))
    assert sample_conditioning.checked_conditioning(model, None, r, _image(2, 2), None) is None


def test_a_ti2v_clip_starts_from_the_image_and_keeps_it():
    """One request end to end: the model sees the image on frame 0 at every step, at timestep 0
    there, and the clip's frame 0 is the image; the other frames end at noise - v. Planted: the
    result not given the image back, the request's image not prepared -> fails."""
    model = PerTokenTime()
    r = request(frames=2, height=1, width=2, steps=2, guidance=1.0)
    image = _image(1, 2)
    prep = sampling.prepare(model, Encoder(), None, r, images=(image, None))
    assert prep.clean.tolist() == [True, True, False, False]
    video = sampling.sample_request(model, Encoder(), None, r, 1.0, images=(image, None))
    torch.testing.assert_close(video[:, 0], image, rtol=0, atol=0)
    first = patchify(image[:, None], (1, 1, 1))  # (2, 3)
    for call in model.calls:
        torch.testing.assert_close(call["x"][:2], first, rtol=0, atol=0)
    assert all(t[:2].tolist() == [0.0, 0.0] and (t[2:] > 0).all() for t in model.token_times)
    noise = sampling.request_noise(r, 4, C)
    bias = len(r.prompt) / 2  # the stand-in's velocity: the caption's mean
    torch.testing.assert_close(video[:, 1].permute(1, 2, 0).reshape(2, C), (noise[2:] - bias).clamp(-1, 1))


# --- A14B guidance ----------------------------------------------------------------------------------


def test_guidance_2_runs_where_the_low_noise_expert_does():
    """WanPipeline's guidance_scale_2: t >= boundary * 1000 -> guidance, else guidance_2; one scale
    when the model has no boundary or the request no guidance_2. Planted: ``is`` flipped, ``or`` ->
    ``and``, the callable dropped -> fails."""
    two = ConstantVelocity()
    two.boundary_ratio = 0.875
    g = sampling.guidance_at(two, request(guidance=4.0, guidance_2=3.0))
    assert callable(g) and (g(torch.tensor(875.0)), g(torch.tensor(874.0)), g(torch.tensor(999.0))) == (
        4.0,
        3.0,
        4.0,
    )
    assert sampling.guidance_at(two, request(guidance=4.0)) == 4.0
    assert sampling.guidance_at(ConstantVelocity(), request(guidance=4.0, guidance_2=3.0)) == 4.0


def test_generate_hands_guidance_2_to_every_request():
    """Planted: generate() drops its guidance_2 (the low-noise expert keeps guidance) -> fails."""
    two = ConstantVelocity()  # velocity u + g (c - u) does not depend on x: the result shows g
    two.boundary_ratio = 0.5

    def run(**kw):
        return sampling.generate(two, Encoder(), None, ["ab"], 1, 1, 2, steps=2, shift=1.0, return_latents=True, **kw)[0]  # fmt: skip

    assert not torch.equal(run(guidance=4.0, guidance_2=2.0), run(guidance=4.0))
    with pytest.raises(ValueError, match="guidance_2 is the low-noise expert's guidance"):
        sampling.generate(ConstantVelocity(), Encoder(), None, ["ab"], 1, 1, 2, steps=1, guidance_2=2.0)


# --- shapes at their edges ---------------------------------------------------------------------------


def test_a_temporal_stride_of_two_needs_odd_frame_counts():
    """The stride check applies from a temporal stride of 2 (Wan's is 4). Planted: ``stride > 2`` -> fails."""
    with pytest.raises(ValueError, match="temporal stride 2 needs 1 \\+ 2k frames, e.g. 3 or 5"):
        sampling.request_grid(request(frames=4, height=2, width=2), (1, 1, 1), (2, 1, 1))
    assert sampling.request_grid(request(frames=5, height=2, width=2), (1, 1, 1), (2, 1, 1)) == (3, 2, 2)


def test_a_side_of_exactly_one_stride_makes_one_latent_row():
    """Planted: ``min(h, w) < 2`` (a one-row latent refused) -> fails."""
    assert sampling.request_grid(request(frames=1, height=8, width=16), (1, 1, 1), (4, 8, 8)) == (1, 1, 2)


def test_height_and_width_each_take_their_own_stride():
    """A VAE whose spatial strides differ (2 down, 4 across). Planted: the height checked against
    the width's stride -> fails."""
    assert sampling.request_grid(request(frames=1, height=4, width=8), (1, 1, 1), (1, 2, 4)) == (1, 2, 2)
    with pytest.raises(ValueError, match="multiples of the VAE stride \\(2, 4\\), got 4x6"):
        sampling.request_grid(request(frames=1, height=4, width=6), (1, 1, 1), (1, 2, 4))


# --- the one-process queue ------------------------------------------------------------------------


def test_sample_queue_defaults_to_8_fps_no_enlarging_and_no_skip_message(tmp_path, capsys):
    """Planted: fps 9, upscale 2, the 'already in place' line printed when nothing is -> fails."""
    queue = [request(index=0, frames=1, height=2, width=4, steps=1, guidance=1.0)]
    paths = {0: sample_output.output_path(tmp_path, queue[0])}
    sampling.sample_queue(ConstantVelocity(), Encoder(), None, queue, paths, 1.0)
    assert "already in place" not in capsys.readouterr().out
    rate, frames = _read(paths[0])
    assert rate == 8 and frames[0].shape == (2, 4, 3)
    assert math.prod(frames[0].shape) == 24


def test_write_video_defaults_and_its_temporary_folder_beside_the_clip(tmp_path, monkeypatch):
    """``write_video(video, path)``: 8 fps, not enlarged, written under a hidden folder of the clip's
    own directory (a killed job's leftovers are where ``remove_partials`` looks, and the final rename
    never crosses file systems). ``frame_grid`` does not enlarge by default. Planted: fps 9, upscale
    2, the temporary folder made in the system's temp directory -> fails."""
    import imageio.v2 as imageio

    video = torch.zeros(3, 2, 2, 4)
    seen = []
    real = imageio.mimwrite

    def spy(tmp, frames, **kw):
        seen.append(Path(tmp))
        return real(tmp, frames, **kw)

    monkeypatch.setattr(imageio, "mimwrite", spy)
    out = tmp_path / "clips" / "a.mp4"
    assert sample_output.write_video(video, out) == out
    assert seen[0].parent.parent == out.parent and seen[0].parent.name.startswith(
        sample_output.PARTIAL_PREFIX
    )
    rate, frames = _read(out)
    assert rate == 8 and len(frames) == 2 and frames[0].shape == (2, 4, 3)
    assert sample_output.frame_grid([video]).shape == (2, 2 * 4, 3)


def test_the_i2v_mask_has_one_channel_per_frame_of_the_vaes_temporal_stride():
    """A VAE of temporal stride 2 and no spatial stride: in_channels 2 c + 2. Planted: the mask sized
    by the height's stride -> fails."""
    from types import SimpleNamespace

    model = ConstantVelocity(in_channels=2 * C + 2)
    vae = SimpleNamespace(stride=(2, 1, 1))
    cond = sample_conditioning.checked_conditioning(
        model, vae, request(frames=3, height=2, width=2), _image(2, 2), None
    )
    assert cond is not None and cond.temporal == 2 and not cond.last_frame
