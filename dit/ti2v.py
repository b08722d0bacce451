"""Wan2.2 TI2V-5B's image-to-video mode: a clean first latent frame at timestep 0.

TI2V-5B is one model for text-to-video and image-to-video, with no extra input channels. For
image-to-video, diffusers' ``WanImageToVideoPipeline`` (``expand_timesteps=True``) puts the image's
normalized VAE latent in latent frame 0 of the model input at every step and gives that frame's
tokens t = 0, the other tokens the step's t (a (batch, seq_len) timestep). Training does the same to
each clip's own first frame (frame 0 stays clean, t = 0, and is left out of the loss), sampling to
``--image``. Text-to-video is the plain model: every token has its clip's t.

Everything here is per token and reads only the token's position, so a CP shard computes its own
part from its own positions.

Legend: n = tokens, b = clips, p = patch values (pt*ph*pw*c).
"""

from __future__ import annotations

import torch

from dit.blocks import per_token


def check_first_frame_patch(patch_size) -> None:
    """ValueError unless one temporal patch holds one latent frame (TI2V's patch (1, 2, 2))."""
    if tuple(patch_size)[0] != 1:
        raise ValueError(
            f"a clean first latent frame needs a temporal patch of 1 (TI2V: (1, 2, 2)), got patch_size="
            f"{tuple(patch_size)}; use patch_size (1, 2, 2) or train text-to-video"
        )


def first_frame_tokens(
    positions: torch.Tensor, seq_lens: torch.Tensor, clean_first: torch.Tensor
) -> torch.Tensor:
    """(n,) bool: the token lies in latent frame 0 of a clip whose first frame is clean.

    positions (n, 3) (t, h, w) patch indices; seq_lens (b,) tokens of each clip held here;
    clean_first (b,) bool, one per clip."""
    return (positions[:, 0] == 0) & per_token(clean_first.to(positions.device), seq_lens, positions.shape[0])


def token_timesteps(timesteps: torch.Tensor, seq_lens: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """(b,) clip timesteps -> (n,) token timesteps: the clip's t, 0 on ``clean`` tokens (as the
    pipeline's ``first_frame_mask * t``)."""
    t = per_token(timesteps.float(), seq_lens, clean.shape[0]).expand(clean.shape[0])
    return torch.where(clean, torch.zeros_like(t), t)


def replace_first_frame(x: torch.Tensor, image_tokens: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """x (n, p) with the ``clean`` tokens' values taken from ``image_tokens`` (n, p) (the image latent
    broadcast over frames, as the pipeline's ``(1 - mask) * condition + mask * latents``)."""
    return torch.where(clean[:, None], image_tokens.to(x), x)


def check_ti2v_data(config, data_channels: int, clean_first_frame: float, cached: bool) -> None:
    """ValueError naming the fix when the data or the training mode do not fit a TI2V model (or a
    clean first frame is asked of a model without per-token timesteps)."""
    get = config.get if hasattr(config, "get") else lambda key: getattr(config, key, None)
    if clean_first_frame > 0 and not get("expand_timesteps"):
        raise ValueError(
            f"flow.clean_first_frame={clean_first_frame} needs a model with per-token timesteps (Wan2.2 TI2V: "
            "model.size=wan2.2-ti2v-5b, or a TI2V pipeline as model.pretrained); set flow.clean_first_frame=0"
        )
    if not get("expand_timesteps"):
        return
    if clean_first_frame > 0:
        check_first_frame_patch(get("patch_size"))
    in_channels = get("in_channels")
    if data_channels != in_channels:
        source = "the latent cache holds" if cached else "data.vae makes"
        old = " (the Wan2.1 VAE's)" if data_channels == 16 else ""
        raise ValueError(
            f"{source} {data_channels}-channel latents{old} but this TI2V model takes {in_channels} (the Wan2.2 "
            "VAE's); rebuild the cache with python -m data.cache --vae wan2.2 --vae-path /ckpt/Wan2.2-TI2V-5B-Diffusers "
            "(or set data.vae=wan2.2 and data.vae_path to that folder)"
        )
