"""Two minimal plug-in datasets. Copy one into your own package and replace the body of __getitem__.

from data.build import build_dataset
ds = build_dataset("data.examples.plugin:ColourRamps", plugin_args={"num_clips": 4})
ds = build_dataset("data.examples.plugin:RandomLatents", plugin_args={"num_clips": 4})
"""

from __future__ import annotations

import numpy as np
import torch

from data.types import ClipMeta


class ColourRamps:
    """Clips as uint8 (f, h, w, 3) arrays with captions, the way a loader of your own files returns them."""

    def __init__(self, num_clips: int = 8, num_frames: int = 9, height: int = 32, width: int = 48):
        self.num_clips, self.shape = num_clips, (num_frames, height, width)

    def __len__(self) -> int:
        return self.num_clips

    def meta(self, i: int) -> ClipMeta:  # from your metadata, without decoding: the planner calls this first
        return ClipMeta(*self.shape)

    def __getitem__(self, i: int) -> dict:
        f, h, w = self.shape
        t = np.arange(f).reshape(f, 1, 1)
        x = np.arange(w).reshape(1, 1, w)
        red = (x * 255 // max(1, w - 1) + 16 * t + 40 * i) % 256  # a ramp that slides right over time
        frames = np.stack([red, np.full_like(red, 40 * i % 256), 255 - red], axis=-1)  # (f, 1, w, 3)
        frames = np.broadcast_to(frames, (f, h, w, 3)).astype(np.uint8)
        return {"video": frames, "caption": f"a colour ramp number {i} sliding right"}


class RandomLatents:
    """Precomputed latents and text embeddings, e.g. from your own encoder. ``vae_stride`` tells the
    wrapper how meta (pixel shape) maps to the latent shape."""

    vae_stride = (4, 8, 8)

    def __init__(self, num_clips: int = 8, channels: int = 16, text_dim: int = 32):
        self.num_clips, self.channels, self.text_dim = num_clips, channels, text_dim

    def __len__(self) -> int:
        return self.num_clips

    def meta(self, i: int) -> ClipMeta:
        return ClipMeta(num_frames=1 + 4 * (i % 3), height=32, width=32 + 16 * (i % 2))

    def __getitem__(self, i: int) -> dict:
        m = self.meta(i)
        g = torch.Generator().manual_seed(i)
        latent = torch.randn(
            self.channels, 1 + (m.num_frames - 1) // 4, m.height // 8, m.width // 8, generator=g
        )
        return {"latent": latent, "text_emb": torch.randn(3 + i % 5, self.text_dim, generator=g)}
