"""From a dataset sample to the tensors one training clip needs, and the loss of a packed micro-batch.

Everything random about a clip at a step (caption dropout, sigma, noise) comes from a generator seeded
by (seed, step, dataset index). It therefore does not depend on which micro-batch, rank or CP group
runs the clip: single-process, static-CP and Dynamic-CP training see the same numbers, and a resumed
run sees the same numbers as an uninterrupted one.

Legend: n = tokens, p = patch values, l = text tokens, d = text width.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from dit.attention import AttentionFn
from dit.config import FlowConfig
from dit.flow import (
    add_noise,
    clip_token_weights,
    flow_loss,
    model_timesteps,
    sample_expert_sigma,
    sample_sigmas,
    shift_for_tokens,
    shift_sigmas,
)
from dit.image_cond import ImageConditioning, image_condition, join_condition
from dit.packing import grid_positions, local_seq_lens, patchify


def clip_generator(seed: int, step: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_000_033 + index) % (2**63 - 1))


@dataclass
class TrainClip:
    """One clip ready for the DiT: clean tokens, noise, sigma, positions and text."""

    index: int
    x0: torch.Tensor  # (n, p)
    noise: torch.Tensor  # (n, p)
    sigma: float
    positions: torch.Tensor  # (n, 3)
    text: torch.Tensor  # (l, d)
    condition: torch.Tensor | None = None  # (n, P*cc) mask + image latent tokens (image-to-video)
    image: torch.Tensor | None = None  # (m, image_dim) CLIP tokens (Wan2.1 I2V / FLF2V)

    @property
    def num_tokens(self) -> int:
        return self.x0.shape[0]


class ClipEncoder:
    """Turns pixel samples (video + caption) or cached samples (latent + text_emb) into latents and text.

    The VAE and text encoder are built on first use: a run on a latent cache never loads them.
    """

    def __init__(
        self,
        build_vae,
        build_text_encoder,
        device: torch.device,
        empty_text: torch.Tensor | None = None,
        conditioning: ImageConditioning | None = None,
        build_image_encoder=None,
    ):
        self._build_vae, self._build_text_encoder = build_vae, build_text_encoder
        self._build_image_encoder = build_image_encoder
        self.conditioning = conditioning  # None: a text-to-video model
        self.device = device
        # what the text encoder gives for "" (cached samples use it when their caption is dropped,
        # so training's unconditional input is sampling's); None = no text rows
        self.empty_text = empty_text

    @functools.cached_property
    def vae(self):
        return self._build_vae()  # None = pixel space

    @functools.cached_property
    def text_encoder(self):
        return self._build_text_encoder()

    @functools.cached_property
    def image_encoder(self):
        return self._build_image_encoder()

    @torch.no_grad()
    def encode_condition(self, sample: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> condition (t + c, f, h, w) and CLIP tokens (m, image_dim) or None, from the clip itself: its
        first frame (FLF2V: and last), through the VAE and the image encoder, or from the cache."""
        cond = self.conditioning
        if "latent" in sample:
            if "condition" not in sample or (cond.clip_tokens and "image_emb" not in sample):
                raise ValueError(
                    "this latent cache has no image conditioning (condition latents / CLIP image embeddings), "
                    "which an image-to-video model needs and data/cache.py does not store yet; train from the "
                    "videos instead (data.source = a folder or manifest)"
                )
            condition = sample["condition"].to(self.device, torch.float32)
            image = sample["image_emb"].to(self.device, torch.float32) if cond.clip_tokens else None
            return condition, image
        video = sample["video"].to(self.device, torch.float32)  # (3, F, H, W) in [-1, 1]
        first, last = video[:, 0], (video[:, -1] if cond.last_frame else None)
        vae = self.vae
        if vae is None:  # pixel space: the condition is the pixels themselves
            from data.vaes import IdentityVAE

            vae = IdentityVAE(video.shape[0])
        image = None
        if cond.clip_tokens:
            frames = torch.stack([first] if last is None else [first, last])
            image = self.image_encoder.encode(frames).flatten(0, 1).to(self.device, torch.float32)
        return image_condition(vae, first, video.shape[1], last), image

    @torch.no_grad()
    def encode(self, sample: dict, drop_caption: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """-> latent (c, f, h, w), text (l, d) on self.device."""
        if "latent" in sample:
            latent = sample["latent"].to(self.device, torch.float32)
            text = sample["text_emb"].to(self.device, torch.float32)
            if drop_caption:
                text = text[:0] if self.empty_text is None else self.empty_text.to(self.device, torch.float32)
            return latent, text
        video = sample["video"].to(self.device, torch.float32)
        latent = video if self.vae is None else self.vae.encode(video[None])[0].float()
        caption = "" if drop_caption else sample["caption"]
        text = self.text_encoder.encode([caption])[0].to(self.device, torch.float32)
        return latent, text


def prepare_clip(
    sample: dict,
    encoder: ClipEncoder,
    patch: tuple[int, int, int],
    flow: FlowConfig,
    caption_dropout: float,
    seed: int,
    step: int,
    expert: tuple[str, float] | None = None,
) -> TrainClip:
    """``expert``: (name, boundary_ratio) of a Wan2.2 A14B expert, whose sigma stays on its side of
    the pipeline's switch (``dit.flow.sample_expert_sigma``); None draws from the whole range."""
    g = clip_generator(seed, step, sample["index"])
    drop = bool(torch.rand((), generator=g) < caption_dropout)
    latent, text = encoder.encode(sample, drop)
    x0 = patchify(latent, patch)
    grid = tuple(s // p for s, p in zip(latent.shape[1:], patch))
    shift = flow.shift if flow.shift is not None else shift_for_tokens(x0.shape[0])
    if expert is None:
        sigma = sample_sigmas(1, g, flow.timestep_sampling, flow.logit_mean, flow.logit_std)
        sigma = float(shift_sigmas(sigma, shift))
    else:
        mode, mean, std = flow.timestep_sampling, flow.logit_mean, flow.logit_std
        sigma = sample_expert_sigma(g, mode, mean, std, float(shift), *expert)
    noise = torch.randn(x0.shape, generator=g).to(x0.device)
    clip = TrainClip(sample["index"], x0, noise, sigma, grid_positions(grid, x0.device), text)
    if encoder.conditioning is not None:
        condition, clip.image = encoder.encode_condition(sample)
        clip.condition = patchify(condition, patch)
    return clip


def micro_batch_loss(
    model,
    clips: list[TrainClip],
    attention: AttentionFn,
    num_clips_global: int,
    token_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Loss contribution of ``clips`` packed into one sequence (see dit/flow.py for the weighting).

    ``token_range`` (start, end) restricts the computation to that slice of the packed sequence, which
    is what one rank of a CP group holds; ``attention`` must then be that group's CP attention.
    """
    seq_lens = torch.tensor([c.num_tokens for c in clips])
    sigmas = torch.tensor([c.sigma for c in clips])
    x0 = torch.cat([c.x0 for c in clips])  # (n, p)
    noise = torch.cat([c.noise for c in clips])
    positions = torch.cat([c.positions for c in clips])  # (n, 3)
    local_lens = seq_lens
    if token_range is not None:
        start, end = token_range
        local_lens = local_seq_lens(seq_lens, start, end)
        x0, noise, positions = x0[start:end], noise[start:end], positions[start:end]
    x_t = add_noise(x0, noise, sigmas.repeat_interleave(local_lens).to(x0.device))
    extra = {}
    if clips[0].condition is not None:  # image-to-video: noisy latent, mask, image latent (in channels)
        condition = torch.cat([c.condition for c in clips])
        if token_range is not None:
            condition = condition[token_range[0] : token_range[1]]
        x_t = join_condition(x_t, condition, math.prod(model.patch_size))
    if clips[0].image is not None:
        extra["image"] = torch.stack([c.image for c in clips])  # (b, m, image_dim)
    text = torch.cat([c.text for c in clips])
    text_lens = torch.tensor([c.text.shape[0] for c in clips])
    pred = model(
        x_t, positions, local_lens, model_timesteps(sigmas).to(x0.device), text, text_lens, attention, **extra
    )
    weights = clip_token_weights(local_lens, seq_lens, num_clips_global).to(x0.device)
    return flow_loss(pred, noise - x0, weights)
