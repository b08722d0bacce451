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

from data.image_cond import condition_mask, image_condition
from dit.attention import AttentionFn
from dit.config import FlowConfig
from dit.flow import (
    add_noise,
    clip_token_weights,
    draw_expert,
    flow_loss,
    model_timesteps,
    sample_expert_sigma,
    sample_sigmas,
    shift_for_tokens,
    shift_sigmas,
)
from dit.image_cond import ImageConditioning, join_condition
from dit.packing import grid_positions, local_seq_lens, patchify
from dit.ti2v import check_first_frame_patch, first_frame_tokens, replace_first_frame, token_timesteps


def clip_generator(seed: int, step: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_000_033 + index) % (2**63 - 1))


def clip_expert(flow: FlowConfig, seed: int, step: int, index: int, num_tokens: int, boundary: float) -> str:
    """The expert (model.expert=both) that clip ``index`` trains at ``step``: from metadata alone (its
    token count sets the shift when flow.shift is None), so the planner knows it before any load."""
    shift = flow.shift if flow.shift is not None else float(shift_for_tokens(num_tokens))
    return draw_expert(
        seed, step, index, flow.timestep_sampling, flow.logit_mean, flow.logit_std, shift, boundary
    )


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
    clean_first: bool = False  # Wan2.2 TI2V image-to-video: latent frame 0 clean, t = 0, out of the loss

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
        if "latent" in sample:  # a latent cache made with --image-condition (data/cache.py)
            if "image_latent" not in sample or (cond.clip_tokens and "image_emb" not in sample):
                raise ValueError(
                    "this latent cache has no image conditioning (image latents / CLIP image embeddings), which "
                    "an image-to-video model needs: re-run python -m data.cache with --image-condition "
                    f"{'first-last' if cond.last_frame else 'first'}"
                    + (" --image-encoder CLIP_FOLDER" if cond.clip_tokens else "")
                    + ", or train from the videos"
                )
            latent = sample["image_latent"].to(self.device, torch.float32)  # (c, f, h, w)
            f, h, w = latent.shape[1:]
            # the pixel frames the latent stands for (the policy gives F = 1 + k t): the mask's input
            mask = condition_mask(1 + (f - 1) * cond.temporal, h, w, cond.last_frame, cond.temporal)
            image = sample["image_emb"].to(self.device, torch.float32) if cond.clip_tokens else None
            return torch.cat([mask.to(latent), latent]), image
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
    the pipeline's switch (``dit.flow.sample_expert_sigma``); None draws from the whole range. Name
    'both' draws the clip's expert first (``clip_expert``), then its sigma on that side."""
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
        name, boundary = expert
        if name == "both":
            name = clip_expert(flow, seed, step, sample["index"], x0.shape[0], boundary)
        sigma = sample_expert_sigma(g, mode, mean, std, float(shift), name, boundary)
    noise = torch.randn(x0.shape, generator=g).to(x0.device)
    clip = TrainClip(sample["index"], x0, noise, sigma, grid_positions(grid, x0.device), text)
    # drawn last and only when asked for, so text-to-video runs keep their random stream; a one-frame
    # clip (an image) has nothing left to denoise once its frame is given
    if flow.clean_first_frame > 0 and grid[0] > 1:
        check_first_frame_patch(patch)
        clip.clean_first = bool(torch.rand((), generator=g) < flow.clean_first_frame)
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
    args, extra, target, weights = micro_batch_inputs(model, clips, num_clips_global, token_range)
    return flow_loss(model(*args, attention, **extra), target, weights)


def micro_batch_inputs(
    model, clips: list[TrainClip], num_clips_global: int, token_range: tuple[int, int] | None = None
) -> tuple[tuple, dict, torch.Tensor, torch.Tensor]:
    """(the model's positional inputs before ``attention``, its keyword inputs, the target velocity,
    the loss weights) of ``clips`` packed (and cut to ``token_range``): ``micro_batch_loss`` without
    the model call, for callers that run the model in pieces (pipeline stages, ``dit/stages.py``)."""
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
    loss_lens = seq_lens  # tokens each clip's loss averages over
    clean = None
    if any(c.clean_first for c in clips):  # TI2V image-to-video: frame 0 clean, t = 0, out of the loss
        clean_first = torch.tensor([c.clean_first for c in clips])
        clean = first_frame_tokens(positions, local_lens, clean_first)  # (n,) this shard's frame-0 tokens
        x_t = replace_first_frame(x_t, x0, clean)
        extra["token_timesteps"] = token_timesteps(model_timesteps(sigmas).to(x0.device), local_lens, clean)
        loss_lens = torch.tensor(
            [c.num_tokens - int((c.positions[:, 0] == 0).sum()) * c.clean_first for c in clips]
        )
    if clips[0].condition is not None:  # image-to-video: noisy latent, mask, image latent (in channels)
        condition = torch.cat([c.condition for c in clips])
        if token_range is not None:
            condition = condition[token_range[0] : token_range[1]]
        x_t = join_condition(x_t, condition, math.prod(model.patch_size))
    if clips[0].image is not None:
        extra["image"] = torch.stack([c.image for c in clips])  # (b, m, image_dim)
    text = torch.cat([c.text for c in clips])
    text_lens = torch.tensor([c.text.shape[0] for c in clips])
    timesteps = model_timesteps(sigmas).to(x0.device)  # (b,)
    weights = clip_token_weights(local_lens, loss_lens, num_clips_global).to(x0.device)
    if clean is not None:
        weights = weights.masked_fill(clean, 0.0)
    return (x_t, positions, local_lens, timesteps, text, text_lens), extra, noise - x0, weights


def validation_clips(samples: list[dict], encoder, patch, flow, sigmas) -> list[list[TrainClip]]:
    """The held-out clips once per validation sigma, at fixed noise seeds and the fixed, unshifted
    sigma itself: the same question at every evaluation, so losses compare across steps."""
    out = []
    for k, sigma in enumerate(sigmas):
        clips = [prepare_clip(s, encoder, patch, flow, 0.0, seed=10_000 + k, step=0) for s in samples]
        for clip in clips:
            clip.sigma = float(sigma)
        out.append(clips)
    return out
