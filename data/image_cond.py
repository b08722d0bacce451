"""The image condition of Wan2.1 I2V / FLF2V (and Wan2.2 I2V), built from pixels and the VAE.

The transformer's input is 16 noisy latent channels, then 4 mask channels, then the 16-channel VAE
latent of a video that holds the given first frame (FLF2V: also the last frame) and zeros elsewhere:
in_channels 36. The mask is 1 on latent positions whose pixels are given. These functions build the
mask and the latent exactly as diffusers' ``WanImageToVideoPipeline.prepare_latents`` does, for the
latent cache and training (from the clip itself) and for sampling (from ``--image``), so the two
never differ. How the model takes them (its channel layout, its config) is ``dit/image_cond.py``.

Legend: c = channels, F = pixel frames, f = latent frames = 1 + (F-1)//t, t = the VAE's temporal
stride, h/w = latent height/width.
"""

from __future__ import annotations

import torch


def condition_video(first: torch.Tensor, num_frames: int, last: torch.Tensor | None = None) -> torch.Tensor:
    """first/last (c, H, W) -> (c, F, H, W): the given frame(s), zeros in between (what the VAE encodes)."""
    frames = [first[:, None]]
    gap = num_frames - 1 - (last is not None)
    if gap < 0:
        raise ValueError(f"num_frames={num_frames} cannot hold a first and a last frame; use at least 2")
    frames.append(first.new_zeros(first.shape[0], gap, *first.shape[1:]))
    if last is not None:
        if last.shape != first.shape:
            raise ValueError(
                f"the last image is {tuple(last.shape)} but the first is {tuple(first.shape)}; give both the same size"
            )
        frames.append(last[:, None])
    return torch.cat(frames, dim=1)


def condition_mask(
    num_frames: int, height: int, width: int, last_frame: bool = False, temporal: int = 4
) -> torch.Tensor:
    """(t, f, h, w) mask: 1 where the pixel frame is given, as Wan's pipeline builds it.

    Start from ones over the F pixel frames, zero frames 1..F-1 (FLF2V: 1..F-2), repeat frame 0 t
    times (the causal VAE's first latent frame stands for one pixel frame, the others for t each) and
    fold the t pixel frames of each latent frame into channels.
    """
    if (num_frames - 1) % temporal:
        raise ValueError(
            f"num_frames={num_frames} is not 1 + a multiple of the VAE's temporal stride {temporal}; use e.g. "
            f"{1 + (num_frames - 1) // temporal * temporal}"
        )
    mask = torch.ones(1, num_frames, height, width)
    mask[:, 1 : num_frames - 1 if last_frame else num_frames] = 0
    mask = torch.cat([mask[:, :1].repeat_interleave(temporal, dim=1), mask[:, 1:]], dim=1)  # (1, F+t-1, h, w)
    return mask.view(-1, temporal, height, width).transpose(0, 1)  # (t, f, h, w)


@torch.no_grad()
def image_condition(
    vae, first: torch.Tensor, num_frames: int, last: torch.Tensor | None = None
) -> torch.Tensor:
    """first/last (3, H, W) in [-1, 1] -> (t + c, f, h, w) condition: mask, then the normalized VAE
    latent of ``condition_video``. ``vae`` is a ``data.vaes.VideoVAE`` (its ``encode`` normalizes)."""
    video = condition_video(first, num_frames, last)
    latent = vae.encode(video[None])[0].float()  # (c, f, h, w)
    mask = condition_mask(num_frames, *latent.shape[2:], last is not None, vae.stride[0])
    return torch.cat([mask.to(latent), latent])
