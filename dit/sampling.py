"""Generate clips with a trained VideoDiT: flow-matching Euler steps with classifier-free guidance.

A request (``dit/sample_requests.py``) is sampled on its own: its noise comes from a generator seeded
by the request's seed, so the same request gives the same clip whatever else is in the queue and
wherever it runs. One guided step packs the conditional and unconditional branches into one forward
pass (two clips of one packed sequence). The pieces (``branch_velocity``, ``denoise``, ``decode``)
are what ``dynamic_cp/runtime/sampling.py`` runs on a CP group: it hands ``branch_velocity`` a CP
attention function and a token range instead of ``PackedAttention`` and the whole sequence. A
request's image inputs are built in ``dit/sample_conditioning.py``, its files written by
``dit/sample_output.py``.

Legend: n = tokens of one clip, p = patch values, k = branches in one forward (1 or 2).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from data.tokens import latent_shape
from dit.attention import AttentionFn, PackedAttention
from dit.flow import shift_for_tokens
from dit.image_cond import join_condition
from dit.packing import check_divisible, grid_positions, local_seq_lens, patchify, unpatchify
from dit.sample_conditioning import (
    checked_conditioning,
    data_channels,
    image_inputs,
    model_stride,
    request_images,
    ti2v_first_frame,
)
from dit.sample_output import write_video
from dit.sample_requests import SampleRequest
from dit.ti2v import replace_first_frame

# (x (n, p), timestep) -> (v_cond (n, p), v_uncond (n, p) or None): one guided step's velocities
Velocities = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def request_grid(
    request: SampleRequest, patch: tuple[int, int, int], stride: tuple[int, int, int]
) -> tuple[int, int, int]:
    """The request's token grid (f, h, w) after the VAE and patching; a ValueError naming the request
    when the VAE stride or the patch cannot make its frames, height or width."""
    frames, height, width = request.frames, request.height, request.width
    where = request.label()
    if min(frames, height, width) < 1:
        raise ValueError(f"{where}: frames, height and width must be positive, got {frames}x{height}x{width}")
    if stride[0] > 1 and (frames - 1) % stride[0]:
        raise ValueError(
            f"{where}: frames={frames}: a causal video VAE with temporal stride {stride[0]} needs 1 + "
            f"{stride[0]}k frames, e.g. {1 + (frames - 1) // stride[0] * stride[0]} or "
            f"{1 + ((frames - 1) // stride[0] + 1) * stride[0]}"
        )
    f, h, w = latent_shape(frames, height, width, stride)
    if (h * stride[1], w * stride[2]) != (height, width) or min(h, w) < 1:
        raise ValueError(
            f"{where}: height and width must be multiples of the VAE stride {stride[1:]}, got {height}x{width}"
        )
    check_divisible((f, h, w), patch, what=f"{where}: latent of the requested clip")
    return (f // patch[0], h // patch[1], w // patch[2])


def request_noise(request: SampleRequest, num_tokens: int, patch_values: int) -> torch.Tensor:
    """(n, p) starting noise of the request: from its own seed, never from its place in a batch."""
    g = torch.Generator().manual_seed(request.seed)
    return torch.randn(num_tokens, patch_values, generator=g)


def encode_request(text_encoder, request: SampleRequest, device) -> list[torch.Tensor]:
    """[cond] or [cond, uncond] text embeddings, (l, d) each, from one encoder call (so every rank
    that encodes the request, whichever branch it runs, gets the same numbers)."""
    captions = [request.prompt, request.negative_prompt] if request.guided else [request.prompt]
    return [t.to(device, torch.float32) for t in text_encoder.encode(captions)]


def request_scheduler(request: SampleRequest, num_tokens: int, shift: float | None, device=None):
    """A fresh Euler scheduler for the request: ``shift`` (default: by token count), its steps."""
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=float(shift if shift is not None else shift_for_tokens(num_tokens))
    )
    scheduler.set_timesteps(request.steps, device=device)
    return scheduler


def branch_velocity(
    model,
    x: torch.Tensor,
    t: torch.Tensor,
    positions: torch.Tensor,
    texts: list[torch.Tensor],
    attention: AttentionFn,
    token_range: tuple[int, int] | None = None,
    condition: torch.Tensor | None = None,
    image_tokens: torch.Tensor | None = None,
    clean: torch.Tensor | None = None,
) -> torch.Tensor:
    """Velocity of ``len(texts)`` branches of one clip packed into one sequence (k copies of ``x``,
    one per text), or of its slice ``token_range`` (this rank's CP shard): (k*n or end-start, p).

    Image-to-video models also take ``condition`` (n, P*cc), the mask and image latent joined to every
    branch's tokens, and ``image_tokens`` (m, image_dim), the CLIP tokens of every branch. ``clean``
    (n,) marks Wan2.2 TI2V's given first frame: those tokens run at timestep 0 (``x`` holds the image
    latent there, see ``denoise``)."""
    k, n = len(texts), x.shape[0]
    seq_lens = torch.full((k,), n)
    x_in = x.repeat(k, 1)  # (k*n, p)
    if condition is not None:  # the same condition under both branches -> (k*n, p + P*cc)
        x_in = join_condition(x_in, condition.repeat(k, 1), math.prod(model.config.patch_size))
    pos = positions.repeat(k, 1)  # (k*n, 3)
    local = seq_lens
    extra = {}
    if clean is not None:  # TI2V: the given frame at t = 0, every other token at t, in every branch
        times = torch.where(clean, torch.zeros((), device=x.device), t.float().to(x.device))
        extra["token_timesteps"] = times.repeat(k)  # (k*n,)
    if token_range is not None:
        start, end = token_range
        x_in, pos, local = x_in[start:end], pos[start:end], local_seq_lens(seq_lens, start, end)
        if clean is not None:
            extra["token_timesteps"] = extra["token_timesteps"][start:end]
    text = torch.cat(texts)  # (l, d)
    text_lens = torch.tensor([tx.shape[0] for tx in texts])
    # (clips here, m, image_dim): the same tokens for every branch, so for each clip of the shard
    if image_tokens is not None:
        extra["image"] = image_tokens.expand(len(local), -1, -1)
    with compute_precision(model, x.device):
        v = model(x_in, pos, local, t.expand(k).float(), text, text_lens, attention, **extra)
    return v.float()


def compute_dtype(model) -> torch.dtype:
    """The dtype the DiT computes in: its linear layers' weights (bf16 under ``sample.py --precision
    bf16``), else its first parameter's (a model without linear layers), else fp32."""
    linear = next((m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    return linear if linear is not None else next((p.dtype for p in model.parameters()), torch.float32)


def compute_precision(model, device: torch.device):
    """Autocast to the weights' dtype when they are not fp32: the fp32 latents and text embeddings
    meet bf16 weights in bf16 matmuls, and the model's output is cast back for the fp32 Euler steps.
    fp32 weights leave the caller's setting alone (the trainer's previews run under its autocast)."""
    dtype = compute_dtype(model)
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


def cfg_mix(v_cond: torch.Tensor, v_uncond: torch.Tensor | None, guidance: float) -> torch.Tensor:
    return v_cond if v_uncond is None else v_uncond + guidance * (v_cond - v_uncond)


def denoise(
    x: torch.Tensor,
    scheduler,
    velocities: Velocities,
    guidance: float | Callable[[torch.Tensor], float],
    first_frame: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Euler steps from noise ``x`` (n, p); ``velocities`` runs the model wherever it runs.
    ``guidance``: a scale, or t -> the scale at timestep t (``guidance_at``).

    ``first_frame`` (Wan2.2 TI2V image-to-video): (image latent tokens (n, p), clean (n,)). As
    diffusers' pipeline does, the model sees the image latent on the clean tokens at every step while
    the scheduler steps the whole latent, and the result carries the image latent there."""
    given = (lambda v: v) if first_frame is None else (lambda v: replace_first_frame(v, *first_frame))
    for t in scheduler.timesteps:
        scale = guidance(t) if callable(guidance) else guidance
        x = scheduler.step(cfg_mix(*velocities(given(x), t), scale), t, x).prev_sample
    return given(x)


def guidance_at(model, request: SampleRequest) -> float | Callable[[torch.Tensor], float]:
    """The request's guidance: of a two-expert model (``dit.experts.ExpertPair``), ``guidance_2``
    where the low expert runs, as WanPipeline's guidance_scale_2 (None: ``guidance`` throughout)."""
    ratio = getattr(model, "boundary_ratio", None)
    if ratio is None or request.guidance_2 is None:
        return request.guidance
    from dit.flow import on_expert_side

    return lambda t: request.guidance if bool(on_expert_side(t, "high", ratio)) else request.guidance_2


def decode(x: torch.Tensor, grid, patch, vae) -> torch.Tensor:
    """(n, p) final tokens -> (3, f, h, w) video in [-1, 1] on the CPU (``vae`` None: pixel space)."""
    latent = unpatchify(x, grid, patch)  # (c, f, h, w)
    video = latent if vae is None else vae.decode(latent[None])[0]
    return video.clamp(-1, 1).cpu()


@dataclass(frozen=True)
class Prepared:
    """What every rank that runs a request needs before its first step."""

    grid: tuple[int, int, int]
    positions: torch.Tensor  # (n, 3)
    noise: torch.Tensor  # (n, p)
    texts: list[torch.Tensor]  # [cond] or [cond, uncond]
    condition: torch.Tensor | None = None  # (n, P*cc) mask and image latent: image-to-video models
    image_tokens: torch.Tensor | None = None  # (m, image_dim) CLIP tokens: models with image_dim
    # Wan2.2 TI2V image-to-video: (image latent tokens (n, p), clean (n,) first-frame tokens)
    first_frame: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def clean(self) -> torch.Tensor | None:
        return None if self.first_frame is None else self.first_frame[1]

    def velocity(self, model, x, t, attention, token_range=None, texts=None) -> torch.Tensor:
        """``branch_velocity`` of this request's branches (all of ``texts``, or those given)."""
        return branch_velocity(
            model, x, t, self.positions, self.texts if texts is None else texts, attention, token_range,
            self.condition, self.image_tokens, self.clean,
        )  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return self.noise.shape[0]


def prepare(
    model,
    text_encoder,
    vae,
    request: SampleRequest,
    image_encoder=None,
    images: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    noise: torch.Tensor | None = None,
) -> Prepared:
    """``images``: the (first, last) frames as (3, H, W) tensors in [-1, 1] instead of the files the
    request names; ``noise`` (c, f, h, w): a latent instead of the request's seeded noise."""
    device = next(model.parameters()).device
    patch = tuple(model.config.patch_size)
    grid = request_grid(request, patch, model_stride(model, vae))
    n = grid[0] * grid[1] * grid[2]
    p = data_channels(model) * math.prod(patch)
    if noise is None:
        noise = request_noise(request, n, p)
    else:
        noise = patchify(noise.float(), patch)  # (n, p)
    if images is None:
        images = request_images(request)
    positions = grid_positions(grid, device)
    if getattr(model.config, "expand_timesteps", False):  # Wan2.2 TI2V: the image is latent frame 0
        condition, image_tokens = None, None
        first_frame = ti2v_first_frame(model, vae, request, *images, positions)
    else:
        condition, image_tokens = image_inputs(model, vae, request, *images, image_encoder)
        first_frame = None
    return Prepared(
        grid,
        positions,
        noise.to(device),
        encode_request(text_encoder, request, device),
        condition,
        image_tokens,
        first_frame,
    )


@torch.no_grad()
def sample_request(
    model,
    text_encoder,
    vae,
    request: SampleRequest,
    shift: float | None = None,
    image_encoder=None,
    images=None,
    noise: torch.Tensor | None = None,
    return_latents: bool = False,
) -> torch.Tensor:
    """One process: -> the request's (3, f, h, w) video in [-1, 1] (``return_latents``: its final
    (c, f, h, w) latent). ``images`` and ``noise`` as ``prepare`` takes them."""
    prep = prepare(model, text_encoder, vae, request, image_encoder, images, noise)
    attention = PackedAttention([prep.num_tokens] * len(prep.texts))

    def velocities(x, t):
        v = prep.velocity(model, x, t, attention)  # (k*n, p)
        return (v[: x.shape[0]], v[x.shape[0] :]) if request.guided else (v, None)

    scheduler = request_scheduler(request, prep.num_tokens, shift, prep.noise.device)
    x = denoise(prep.noise, scheduler, velocities, guidance_at(model, request), prep.first_frame)
    patch = tuple(model.config.patch_size)
    if return_latents:
        return unpatchify(x, prep.grid, patch).cpu()  # (c, f, h, w)
    return decode(x, prep.grid, patch, vae)


@torch.no_grad()
def generate(
    model,
    text_encoder,
    vae,
    prompts: list[str],
    num_frames: int,
    height: int,
    width: int,
    steps: int = 30,
    guidance: float = 5.0,
    shift: float | None = None,
    seed: int = 0,
    negative_prompt: str = "",
    image: torch.Tensor | None = None,
    last_image: torch.Tensor | None = None,
    image_encoder=None,
    noise: torch.Tensor | None = None,
    return_latents: bool = False,
    guidance_2: float | None = None,
) -> list[torch.Tensor]:
    """-> one (3, f, h, w) video in [-1, 1] per prompt; prompt i uses seed ``seed + i``.
    ``vae`` None means the model works in pixels.

    Image-to-video models (extra input channels; see ``dit/image_cond.py``) take ``image`` (3, H, W) in
    [-1, 1], the first frame of every clip (FLF2V: and ``last_image``), and ``image_encoder`` (a
    ``data.image_encoders.ClipImageEncoder``) when they have ``image_dim``. ``noise`` (b, c, f, h, w)
    replaces the seeded initial noise; ``return_latents`` returns the final (c, f, h, w) latents.
    ``guidance_2``: the low-noise expert's guidance of a two-expert model (``dit/experts.py``).
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    requests = [
        SampleRequest(
            i, p, num_frames, height, width, steps, guidance, seed + i, negative_prompt, guidance_2=guidance_2
        )
        for i, p in enumerate(prompts)
    ]
    images = (image, last_image)
    check_requests(model, vae, requests, images)  # every request checked before the first is sampled
    return [
        sample_request(
            model,
            text_encoder,
            vae,
            r,
            shift,
            image_encoder,
            images,
            None if noise is None else noise[r.index],
            return_latents,
        )  # fmt: skip
        for r in requests
    ]


def check_requests(model, vae, requests: list[SampleRequest], images=None) -> None:
    """Every request's shape against the VAE stride and patch, and its frames against the model (an
    image-to-video model needs them, a text-to-video one refuses them): one ValueError naming the
    first bad request. ``images``: the (first, last) frames of every request instead of its files."""
    patch, stride = tuple(model.config.patch_size), model_stride(model, vae)
    for r in requests:
        request_grid(r, patch, stride)
        if r.guidance_2 is not None and getattr(model, "boundary_ratio", None) is None:
            raise ValueError(
                f"{r.label()}: guidance_2 is the low-noise expert's guidance of a two-expert (Wan2.2 A14B) "
                "model, and this model is one; drop --guidance-2 (or the queue's guidance_2)"
            )
        checked_conditioning(model, vae, r, *(images if images is not None else request_images(r)))


def sample_queue(
    model,
    text_encoder,
    vae,
    requests: list[SampleRequest],
    paths: dict,
    shift,
    fps: int = 8,
    upscale: int = 1,
    image_encoder=None,
) -> list[Path]:
    """One process: each request whose file is not there yet, in queue order, written as it finishes
    (a killed job keeps what it wrote); -> the paths written."""
    written = []
    todo = [r for r in requests if not paths[r.index].exists()]
    if len(todo) < len(requests):
        print(f"{len(requests) - len(todo)} of {len(requests)} clips already in place; sampling {len(todo)}")
    for i, r in enumerate(todo, start=1):
        video = sample_request(model, text_encoder, vae, r, shift, image_encoder)
        written.append(write_video(video, paths[r.index], fps, upscale))
        print(f"[{i}/{len(todo)}] {written[-1]}", flush=True)
    return written
