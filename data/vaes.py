"""Video VAEs behind one small interface: diffusers causal VAEs from a local folder, or identity.

    vae = load_vae("wan", "/ckpt/Wan2.1-T2V-1.3B-Diffusers/vae")
    z = vae.encode(video)   # (b, 3, f, h, w) in [-1, 1] -> (b, c', 1 + (f-1)//4, h/8, w/8), normalized
    x = vae.decode(z)       # -> (b, 3, f, h, w) in [-1, 1]

"wan" covers both Wan VAEs, told apart by their config: Wan2.1's (16 channels, 8x spatial) and
Wan2.2's (TI2V-5B: 48 channels, 16x spatial through a 2x2 pixel patch, residual blocks), each with its
own per-channel latents_mean/latents_std.

Latents are normalized the way each model family's transformer expects them, so a DiT trained on
them matches the family's convention (Wan: per-channel mean/std; HunyuanVideo and CogVideoX: a
single scaling factor).
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch

VAE_KINDS = ("wan", "wan2.2", "hunyuan", "cogvideox", "identity")
# (t, h, w) stride of each kind: what token counts are computed with before any VAE is loaded
VAE_STRIDES = {
    "wan": (4, 8, 8),
    "wan2.2": (4, 16, 16),  # Wan2.2 TI2V-5B's VAE: 2x2 pixel patch, then 8x
    "hunyuan": (4, 8, 8),
    "cogvideox": (4, 8, 8),
    "identity": (1, 1, 1),
}
WAN22_HINT = "the Wan2.2 VAE is in Wan-AI/Wan2.2-TI2V-5B-Diffusers (its vae/)"


@runtime_checkable
class VideoVAE(Protocol):
    latent_channels: int
    stride: tuple[int, int, int]  # (t, h, w)

    def encode(self, video: torch.Tensor) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


class IdentityVAE:
    """Pixel-space training: latents are the pixels, stride (1, 1, 1)."""

    kind = "identity"

    def __init__(self, channels: int = 3):
        self.latent_channels = channels
        self.stride = (1, 1, 1)

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return video

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.clamp(-1, 1)


class DiffusersVAE:
    """A diffusers AutoencoderKL{Wan,HunyuanVideo,CogVideoX}; encodes with the posterior mode so a
    cache is deterministic."""

    def __init__(
        self, kind: str, model, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        # load_vae reads the weights in ``dtype`` already: a second cast would only make diffusers warn
        # on stderr (its to(dtype) warning for models with fp32 modules)
        same = next(model.parameters()).dtype == dtype
        model = model.to(device=device) if same else model.to(device=device, dtype=dtype)
        self.kind, self.model = kind, model.eval().requires_grad_(False)
        self.device, self.dtype = torch.device(device), dtype
        cfg = model.config
        if kind in ("wan", "wan2.2"):
            self.latent_channels = cfg.z_dim
            t = cfg.get("scale_factor_temporal") or 2 ** sum(cfg.temperal_downsample)
            # Wan2.2's VAE folds 2x2 pixels into channels first (patch_size 2): 16x spatial in all
            s = cfg.get("scale_factor_spatial") or 2 ** len(cfg.temperal_downsample) * (
                cfg.get("patch_size") or 1
            )
            self.stride = (int(t), int(s), int(s))
            c = self.latent_channels
            self._mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, c, 1, 1, 1)
            self._std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, c, 1, 1, 1)
        elif kind == "hunyuan":
            self.latent_channels = cfg.latent_channels
            self.stride = (
                cfg.temporal_compression_ratio,
                cfg.spatial_compression_ratio,
                cfg.spatial_compression_ratio,
            )
            self._scale = cfg.scaling_factor
        else:  # cogvideox
            self.latent_channels = cfg.latent_channels
            s = 2 ** (len(cfg.block_out_channels) - 1)
            self.stride = (int(cfg.temporal_compression_ratio), s, s)
            self._scale = cfg.scaling_factor

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        z = self.model.encode(video.to(self.device, self.dtype)).latent_dist.mode().float()
        if self.kind in ("wan", "wan2.2"):
            return (z - self._mean.to(z.device)) / self._std.to(z.device)
        return z * self._scale

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.float()
        wan = self.kind in ("wan", "wan2.2")
        z = z * self._std.to(z.device) + self._mean.to(z.device) if wan else z / self._scale
        return self.model.decode(z.to(self.device, self.dtype)).sample.float().clamp(-1, 1)


def load_vae(
    kind: str, path: str | os.PathLike | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> VideoVAE:
    """A VAE of ``kind`` from a local diffusers folder (the ``vae/`` subfolder of a pipeline works too)."""
    if kind == "identity":
        return IdentityVAE()
    if kind not in VAE_KINDS:
        raise ValueError(f"vae kind {kind!r} is unknown; use one of {VAE_KINDS}")
    if path is None or not os.path.isdir(path):
        raise ValueError(f"vae {kind!r} needs a local folder with config.json and weights; got {path!r}")
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isdir(os.path.join(path, "vae")):
        path = os.path.join(path, "vae")  # a whole pipeline folder was given
    import diffusers  # heavy import, only for a real VAE; data/__init__ hid bitsandbytes from it

    cls = {
        "wan": diffusers.AutoencoderKLWan,
        "wan2.2": diffusers.AutoencoderKLWan,
        "hunyuan": diffusers.AutoencoderKLHunyuanVideo,
        "cogvideox": diffusers.AutoencoderKLCogVideoX,
    }[kind]
    vae = DiffusersVAE(kind, cls.from_pretrained(path, torch_dtype=dtype), device, dtype)
    if kind in ("wan", "wan2.2") and vae.stride != VAE_STRIDES[kind]:
        other = "wan2.2" if kind == "wan" else "wan"
        raise ValueError(
            f"vae {kind!r}: {path} is the Wan{'2.2' if kind == 'wan' else '2.1'} VAE ({vae.latent_channels} "
            f"channels, stride {vae.stride}); set data.vae={other} (--vae {other}) or point at the other VAE"
            + (f" ({WAN22_HINT})" if kind == "wan2.2" else "")
        )
    return vae


def wan_vae_kind(path: str | os.PathLike) -> str:
    """'wan2.2' or 'wan' for a diffusers AutoencoderKLWan folder, read off its config.json."""
    import json

    config = json.loads(open(os.path.join(path, "config.json")).read())
    spatial = config.get("scale_factor_spatial") or 8 * (config.get("patch_size") or 1)
    return "wan2.2" if spatial == 16 else "wan"
