"""How an image-to-video model (Wan2.1 I2V / FLF2V, Wan2.2 I2V) takes its image condition.

The mask and the image latent are built from pixels in ``data/image_cond.py`` (the cache, training
and sampling share them); here they join the noisy latent as extra input channels, and the model's
config says which layout it expects. The CLIP image tokens are a separate, optional input
(``VideoDiT(image=...)``); models without ``image_dim`` (Wan2.2 I2V) use these channels alone.

Legend: c = channels, P = pt*ph*pw values per patch and channel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


def join_condition(x: torch.Tensor, condition: torch.Tensor, patch_values: int) -> torch.Tensor:
    """Channel-concat in token layout: x (n, P*c) and condition (n, P*cc) -> (n, P*(c+cc)).

    A token's values are laid out (pt, ph, pw, c) (``dit/packing.py``), so concatenating channels is
    per patch position, not a plain concat of the two rows: this equals patchify(cat([x, cond], c)).
    """
    n = x.shape[0]
    return torch.cat(
        [x.view(n, patch_values, -1), condition.view(n, patch_values, -1).to(x)], dim=-1
    ).flatten(1)


@dataclass(frozen=True)
class ImageConditioning:
    """What an image-to-video model needs of each clip, read off its config."""

    last_frame: bool  # FLF2V: the last frame is given too (``pos_embed_seq_len`` set)
    clip_tokens: bool  # CLIP image tokens (``image_dim`` set; Wan2.2 I2V has none)
    temporal: int  # the VAE's temporal stride: mask channels


def conditioning_of(config, data_channels: int, temporal: int) -> ImageConditioning | None:
    """None for a text-to-video model; ValueError when the model's channels fit neither layout.

    Image-to-video input = noisy latent (c) + mask (t) + image latent (c): in_channels = 2c + t (Wan:
    16 + 4 + 16 = 36), out_channels = c.
    """
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    in_c = get("in_channels")
    out_c = get("out_channels") or in_c
    if in_c == out_c == data_channels and get("image_dim") is None:
        return None
    if in_c == 2 * data_channels + temporal and out_c == data_channels:
        return ImageConditioning(get("pos_embed_seq_len") is not None, get("image_dim") is not None, temporal)
    raise ValueError(
        f"the model takes {in_c} input and {out_c} output channels but the data gives {data_channels}: a "
        f"text-to-video model needs {data_channels} in and out, an image-to-video one {2 * data_channels + temporal} "
        f"in ({data_channels} noisy + {temporal} mask + {data_channels} image latent) and {data_channels} out; "
        "change data.vae or the model (a T2V checkpoint cannot train under an I2V config, nor the reverse)"
    )
