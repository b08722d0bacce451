"""The clips a training run samples from ``train.sample_prompts`` as it goes (``train.sample_every``)."""

from __future__ import annotations

from pathlib import Path

import torch

from dit.config import TrainConfig


@torch.no_grad()
def training_samples(model, encoder, t: TrainConfig, shift: float, out: Path, step: int):
    """-> (videos, mp4 paths): ``t.sample_prompts`` at ``t.sample_shape`` and a fixed seed, written
    under ``<out>/samples`` with the step in their names (and a PNG grid)."""
    from dit.sample_output import write_clips
    from dit.sampling import generate

    frames, height, width = t.sample_shape
    model.eval()
    videos = generate(
        model, encoder.text_encoder, encoder.vae, list(t.sample_prompts), frames, height, width,
        steps=t.sample_steps, guidance=t.sample_guidance, shift=shift, seed=t.seed,
    )  # fmt: skip
    paths = write_clips(videos, t.sample_prompts, out / "samples", t.seed, tag=f"step{step:06d}_")
    return videos, paths
