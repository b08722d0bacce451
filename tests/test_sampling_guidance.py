"""Classifier-free guidance in dit/sampling.py: the velocity handed to the scheduler is
v_uncond + guidance * (v_cond - v_uncond), the unconditional half uses the negative prompt, and
guidance 1 runs one conditional copy only. Each prompt is its own request: one forward pass per
step packs its two branches.

A stand-in model whose velocity depends on the caption makes the two halves differ, and every call is
recorded, so the mix is checked on the exact numbers the sampler combined.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dit import sampling

CHANNELS = 3


class CaptionVelocity(torch.nn.Module):
    """Velocity of every token = x * 0.1 + the mean of its clip's text embedding (per channel)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.1))
        self.config = SimpleNamespace(patch_size=(1, 1, 1), in_channels=CHANNELS)
        self.calls = []

    def forward(self, x, positions, seq_lens, timesteps, text, text_lens, attention):
        per_clip = torch.stack([t.mean(0)[:CHANNELS] for t in text.split(text_lens.tolist())])  # (clips, p)
        v = self.scale * x + per_clip.repeat_interleave(seq_lens, dim=0)  # (clips*n, p)
        self.calls.append((x.shape[0], len(seq_lens), v.clone()))
        return v


class Encoder:
    """Deterministic caption embeddings that differ per caption; records what it was asked."""

    def __init__(self):
        self.asked = []

    def encode(self, captions):
        self.asked.append(list(captions))
        out = []
        for c in captions:
            g = torch.Generator().manual_seed(sum(map(ord, c)) + 1)
            out.append(torch.randn(2, 8, generator=g))
        return out


def _run(monkeypatch, guidance: float, negative: str = ""):
    model, enc = CaptionVelocity(), Encoder()
    handed = []
    step = sampling.FlowMatchEulerDiscreteScheduler.step

    def recording(self, v, t, x, *args, **kwargs):
        handed.append(v.clone())
        return step(self, v, t, x, *args, **kwargs)

    monkeypatch.setattr(sampling.FlowMatchEulerDiscreteScheduler, "step", recording)
    videos = sampling.generate(
        model, enc, None, ["a red ball", "two cats"], 1, 2, 3, steps=3, guidance=guidance,
        negative_prompt=negative,
    )  # fmt: skip
    return model, enc, handed, videos


@pytest.mark.parametrize("guidance", [4.0, 0.0, -1.5])
def test_guided_velocity_is_the_cfg_mix(monkeypatch, guidance):
    model, enc, handed, videos = _run(monkeypatch, guidance, negative="blurry")
    assert enc.asked == [["a red ball", "blurry"], ["two cats", "blurry"]]
    assert len(model.calls) == len(handed) == 2 * 3 and len(videos) == 2
    for (rows, clips, v), mixed in zip(model.calls, handed):
        assert clips == 2 and rows == 2 * mixed.shape[0]  # both halves in one forward pass
        v_cond, v_uncond = v.chunk(2)
        assert not torch.allclose(v_cond, v_uncond)  # so the mix is visible
        torch.testing.assert_close(mixed, v_uncond + guidance * (v_cond - v_uncond), rtol=0, atol=1e-6)


def test_guidance_one_runs_the_conditional_copy_alone(monkeypatch):
    model, enc, handed, _ = _run(monkeypatch, 1.0, negative="blurry")
    assert enc.asked == [["a red ball"], ["two cats"]]
    for (_rows, clips, v), mixed in zip(model.calls, handed):
        assert clips == 1 and torch.equal(mixed, v)
