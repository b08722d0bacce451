"""Token count of a clip from its metadata alone: the planner needs lengths before pixels load."""

from __future__ import annotations


def latent_shape(
    num_frames: int, height: int, width: int, vae_stride: tuple[int, int, int]
) -> tuple[int, int, int]:
    """Pixel (f, h, w) -> latent (f', h', w'). A causal video VAE keeps the first frame on its own:
    f' = 1 + (f - 1) // st. A stride of 1 (pixel space) keeps f."""
    st, sh, sw = vae_stride
    frames = num_frames if st == 1 else 1 + (num_frames - 1) // st
    return frames, height // sh, width // sw


def num_tokens(
    num_frames: int,
    height: int,
    width: int,
    vae_stride: tuple[int, int, int] = (4, 8, 8),
    patch: tuple[int, int, int] = (1, 2, 2),
) -> int:
    """tokens = (1 + (F-1)//4) * (H/16) * (W/16) for Wan/HunyuanVideo/Open-Sora 2.0 defaults."""
    f, h, w = latent_shape(num_frames, height, width, vae_stride)
    pt, ph, pw = patch
    return (f // pt) * (h // ph) * (w // pw)
