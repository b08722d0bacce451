"""Clip policy: from a file's metadata to the exact clip shape the model sees, and how to cut it.

The shape (frames, height, width) is decided from metadata alone (``ClipPolicy.plan``), so the
planner knows every token count before any pixel is decoded. ``ClipPolicy.frame_indices`` and
``to_tensor`` then produce a clip of exactly that shape.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from data.readers import VideoInfo
from data.tokens import num_tokens
from data.types import ClipMeta

FRAME_RULES = ("auto", "4k+1", "any")
CROPS = ("centre", "random")


class ClipSkip(Exception):
    """A clip the policy rejects (too short, too few tokens). Counted and logged, never silent."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")


@dataclass
class ClipPolicy:
    fps: float | None = None
    """Target frame rate; frames are picked at this rate from the source. None keeps the source rate."""
    max_frames: int | None = None
    """Upper bound on frames per clip (after fps); None = as long as the file allows."""
    min_frames: int = 1
    """Clips with fewer frames available (after fps and snapping) are skipped as too short."""
    frame_rule: str = "auto"
    """'4k+1' snaps frames to 1 + 4k; 'any' keeps them; 'auto': 1 + k*stride_t if vae_stride[0] > 1, else any."""
    resolution: int | None = None
    """Target area as a side length: h*w ~= resolution**2 with the source aspect ratio. None = source size."""
    max_tokens: int | None = None
    """Token budget per clip: the resolution shrinks (aspect kept), then frames, until the clip fits."""
    min_tokens: int = 1
    """Clips below this many tokens are skipped."""
    crop: str = "centre"
    """'centre' or 'random' for the spatial crop and the temporal window; random is seeded per index."""
    vae_stride: tuple[int, int, int] = (4, 8, 8)
    """(t, h, w) VAE stride; (1, 1, 1) for pixel-space training."""
    patch: tuple[int, int, int] = (1, 2, 2)
    """(t, h, w) patch size of the DiT; height and width become multiples of vae_stride * patch."""
    seed: int = 0
    """Seed for random crops; the crop of index i depends only on (seed, i)."""

    def __post_init__(self):
        self.vae_stride, self.patch = tuple(self.vae_stride), tuple(self.patch)
        self.crop = "centre" if self.crop == "center" else self.crop
        if self.crop not in CROPS:
            raise ValueError(f"crop={self.crop!r}: use 'centre' or 'random'")
        if self.frame_rule not in FRAME_RULES:
            raise ValueError(f"frame_rule={self.frame_rule!r}: use one of {FRAME_RULES}")
        if len(self.vae_stride) != 3 or len(self.patch) != 3 or min(self.vae_stride + self.patch) < 1:
            raise ValueError("vae_stride and patch must be three positive ints (t, h, w), e.g. (4, 8, 8)")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps={self.fps}: use a positive rate or None for the source rate")
        if self.max_frames is not None and self.max_frames < max(1, self.min_frames):
            raise ValueError(f"max_frames={self.max_frames} is below min_frames={self.min_frames}")
        if self.resolution is not None and self.resolution < max(self.multiple):
            raise ValueError(f"resolution={self.resolution} is below one patch ({self.multiple} pixels)")
        if self.max_tokens is not None and self.max_tokens < max(1, self.min_tokens):
            raise ValueError(f"max_tokens={self.max_tokens} is below min_tokens={self.min_tokens}")

    # ------------------------------------------------------------ shape from metadata

    @property
    def multiple(self) -> tuple[int, int]:
        """Height and width must be multiples of these so latents split into whole patches."""
        return self.vae_stride[1] * self.patch[1], self.vae_stride[2] * self.patch[2]

    @property
    def frame_step(self) -> int:
        """Frames are 1 + k * frame_step; 1 means any count."""
        # A causal VAE keeps frame 0 alone and folds every stride_t frames after it into one latent.
        st = self.vae_stride[0]
        if self.frame_rule == "any" or (self.frame_rule == "auto" and st == 1):
            return 1
        return 4 if self.frame_rule == "4k+1" else st

    def tokens(self, meta: ClipMeta) -> int:
        return num_tokens(meta.num_frames, meta.height, meta.width, self.vae_stride, self.patch)

    def _snap_frames(self, n: int) -> int:
        k = self.frame_step
        return n if k == 1 else 1 + k * ((n - 1) // k)

    def available_frames(self, info: VideoInfo) -> int:
        """Frames the file can give at the target fps (the last index must stay inside the file)."""
        step = self.source_step(info)
        return int(math.floor((info.num_frames - 1) / step + 1e-6)) + 1

    def source_step(self, info: VideoInfo) -> float:
        return 1.0 if self.fps is None else info.fps / self.fps

    def plan(self, info: VideoInfo) -> ClipMeta:
        """The clip shape for a file, from metadata only. Raises ClipSkip if the policy rejects it."""
        frames = self.available_frames(info)
        if self.max_frames is not None:
            frames = min(frames, self.max_frames)
        frames = self._snap_frames(frames)
        if frames < self.min_frames:
            raise ClipSkip("too_short", f"{frames} frames at the target fps, min_frames={self.min_frames}")
        mh, mw = self.multiple
        if self.resolution is None:  # source size, snapped down: never upscale what was not asked for
            units_h, units_w = max(1, info.height // mh), max(1, info.width // mw)
        else:
            scale = self.resolution / math.sqrt(info.height * info.width)
            units_h = max(1, round(info.height * scale / mh))
            units_w = max(1, round(info.width * scale / mw))
        if self.max_tokens is not None:
            frames, units_h, units_w = self._fit_budget(frames, units_h, units_w)
        meta = ClipMeta(frames, units_h * mh, units_w * mw)
        tokens = self.tokens(meta)
        if tokens < self.min_tokens:
            raise ClipSkip("too_few_tokens", f"{tokens} tokens for {meta}, min_tokens={self.min_tokens}")
        return meta

    def _fit_budget(self, frames: int, units_h: int, units_w: int) -> tuple[int, int, int]:
        """Shrink the resolution keeping aspect (then frames) until tokens <= max_tokens."""
        mh, mw = self.multiple
        aspect = units_w / units_h
        while True:
            for uh in range(units_h, 0, -1):  # largest height first: the first fit is the best fit
                uw = min(units_w, max(1, round(uh * aspect)))
                if self.tokens(ClipMeta(frames, uh * mh, uw * mw)) <= self.max_tokens:
                    return frames, uh, uw
            if frames == 1:
                raise ClipSkip(
                    "over_token_budget", f"one frame at one patch exceeds max_tokens={self.max_tokens}"
                )
            frames = self._snap_frames(frames - 1)  # even the smallest size is too big: fewer frames

    # ------------------------------------------------------------ cutting the clip

    def _rng(self, index: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + index)

    def frame_indices(self, info: VideoInfo, meta: ClipMeta, index: int) -> list[int]:
        """Source frame indices of the clip: ``meta.num_frames`` frames at the target fps."""
        step = self.source_step(info)
        span = (meta.num_frames - 1) * step
        slack = max(0.0, info.num_frames - 1 - span)
        start = slack / 2 if self.crop == "centre" else self._rng(index).uniform(0, slack)
        # floor(x + 0.5), not round(): banker's rounding would make the spacing uneven
        return [min(info.num_frames - 1, math.floor(start + k * step + 0.5)) for k in range(meta.num_frames)]

    def to_tensor(self, frames: np.ndarray, meta: ClipMeta, index: int) -> torch.Tensor:
        """(f, h, w, 3) uint8 -> (3, f, H, W) float32 in [-1, 1]: resize to cover, then crop."""
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()  # (f, 3, h, w)
        h, w = x.shape[-2:]
        scale = max(meta.height / h, meta.width / w)
        size = (max(meta.height, round(h * scale)), max(meta.width, round(w * scale)))
        if size != (h, w):
            x = F.interpolate(x, size=size, mode="bilinear", antialias=scale < 1, align_corners=False)
        dh, dw = size[0] - meta.height, size[1] - meta.width
        if self.crop == "centre":
            top, left = dh // 2, dw // 2
        else:
            rng = self._rng(index + 7919)  # a different stream from the temporal window
            top, left = rng.randint(0, dh), rng.randint(0, dw)
        x = x[:, :, top : top + meta.height, left : left + meta.width]
        x = (x / 127.5 - 1.0).clamp(-1.0, 1.0)
        return x.permute(1, 0, 2, 3).contiguous()  # (3, f, H, W)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_options(pairs: list[str]) -> dict:
    """Command-line ``--option key=value`` items -> {key: value}, values parsed as YAML (fps=16 -> 16)."""
    import yaml

    options = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--option {pair!r}: write key=value, e.g. --option fps=16")
        key, value = pair.split("=", 1)
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(f"--option {pair!r}: the value is not valid YAML; quote it") from None
    return options
