"""Generate clips with a trained VideoDiT: flow-matching Euler steps with classifier-free guidance.

All prompts of a call share one packed sequence, conditional and unconditional copies included, so a
guided step is one forward pass. Noise comes from one generator seeded by ``seed``: the same seed and
arguments give the same clip.

Legend: n = tokens of one clip, b = prompts, p = patch values.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from data.tokens import latent_shape
from dit.attention import PackedAttention
from dit.flow import shift_for_tokens
from dit.image_cond import conditioning_of, image_condition, join_condition
from dit.packing import check_divisible, grid_positions, patchify, unpatchify


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
) -> list[torch.Tensor]:
    """-> one (3, f, h, w) video in [-1, 1] per prompt. ``vae`` None means the model works in pixels.

    Image-to-video models (extra input channels; see ``dit/image_cond.py``) take ``image`` (3, H, W) in
    [-1, 1], the first frame of every clip (FLF2V: and ``last_image``), and ``image_encoder`` (a
    ``data.image_encoders.ClipImageEncoder``) when they have ``image_dim``. ``noise`` (b, c, f, h, w)
    replaces the seeded initial noise; ``return_latents`` returns the final (c, f, h, w) latents.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    device = next(model.parameters()).device
    patch = tuple(model.config.patch_size)
    stride = (1, 1, 1) if vae is None else vae.stride
    channels = getattr(model.config, "out_channels", None) or model.config.in_channels
    f, h, w = latent_shape(num_frames, height, width, stride)
    if stride[0] > 1 and (num_frames - 1) % stride[0]:
        raise ValueError(
            f"frames={num_frames}: a causal video VAE with temporal stride {stride[0]} needs 1 + "
            f"{stride[0]}k frames, e.g. {1 + (num_frames - 1) // stride[0] * stride[0]}"
        )
    if (h * stride[1], w * stride[2]) != (height, width):
        raise ValueError(
            f"height and width must be multiples of the VAE stride {stride[1:]}, got {height}x{width}"
        )
    check_divisible((f, h, w), patch, what="latent of the requested clip")
    grid = (f // patch[0], h // patch[1], w // patch[2])
    n = grid[0] * grid[1] * grid[2]
    b = len(prompts)

    guided = guidance != 1.0
    captions = prompts + [negative_prompt] * b if guided else prompts
    texts = [t.to(device, torch.float32) for t in text_encoder.encode(captions)]
    text = torch.cat(texts)  # (l, d)
    text_lens = torch.tensor([t.shape[0] for t in texts])
    clips = len(captions)
    seq_lens = torch.full((clips,), n)
    positions = grid_positions(grid, device).repeat(clips, 1)  # (clips*n, 3)
    attention = PackedAttention(seq_lens)

    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=float(shift if shift is not None else shift_for_tokens(n))
    )
    scheduler.set_timesteps(steps, device=device)
    g = torch.Generator().manual_seed(seed)
    p = channels * patch[0] * patch[1] * patch[2]
    if noise is None:
        x = torch.randn(b * n, p, generator=g).to(device)  # (b*n, p) noise of every prompt, packed
    else:
        x = torch.cat([patchify(z, patch) for z in noise.to(device, torch.float32)])
    for name, frame in (("--image", image), ("--last-image", last_image)):
        if frame is not None and tuple(frame.shape[1:]) != (height, width):
            raise ValueError(
                f"{name} is {frame.shape[2]}x{frame.shape[1]} but the clip is {width}x{height} (width x height); "
                f"resize the image or pass --width {frame.shape[2]} --height {frame.shape[1]}"
            )
    condition, extra = image_inputs(model, vae, image, last_image, image_encoder, num_frames, patch, device)
    if "image" in extra:
        extra["image"] = extra["image"].expand(clips, -1, -1)  # (clips, m, image_dim)
    for t in scheduler.timesteps:
        x_in = torch.cat([x, x]) if guided else x
        if condition is not None:  # the same image condition for every clip (and both CFG halves)
            x_in = join_condition(x_in, condition.repeat(clips, 1), math.prod(patch))
        v = model(x_in, positions, seq_lens, t.expand(clips).float(), text, text_lens, attention, **extra)
        v = v.float()
        if guided:
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + guidance * (v_cond - v_uncond)
        x = scheduler.step(v, t, x).prev_sample

    videos = []
    for tokens in x.split(n):
        latent = unpatchify(tokens, grid, patch)  # (c, f, h, w)
        if return_latents:
            videos.append(latent.cpu())
            continue
        video = latent if vae is None else vae.decode(latent[None])[0]
        videos.append(video.clamp(-1, 1).cpu())
    return videos


def image_inputs(model, vae, image, last_image, image_encoder, num_frames, patch, device):
    """-> condition tokens (n, P*cc) or None, and the model's extra keyword arguments (CLIP tokens)."""
    cfg = model.config
    data_channels = getattr(cfg, "out_channels", None) or cfg.in_channels
    stride = (1, 1, 1) if vae is None else vae.stride
    conditioning = conditioning_of(cfg, data_channels, stride[0])
    if conditioning is None:
        if image is not None or last_image is not None:
            raise ValueError("--image was given but this is a text-to-video model; drop --image")
        return None, {}
    if image is None:
        raise ValueError(
            "this is an image-to-video model: pass the first frame with --image PATH"
            + (" and the last with --last-image PATH" if conditioning.last_frame else "")
        )
    if conditioning.last_frame != (last_image is not None):
        need = (
            "needs --last-image PATH (FLF2V: first and last frame)"
            if conditioning.last_frame
            else ("takes no --last-image (only FLF2V models do)")
        )
        raise ValueError(f"this model {need}")
    image = image.to(device, torch.float32)
    last = None if last_image is None else last_image.to(device, torch.float32)
    if vae is None:
        from data.vaes import IdentityVAE

        vae = IdentityVAE(image.shape[0])
    condition = patchify(image_condition(vae, image, num_frames, last), patch)  # (n, P*cc)
    extra = {}
    if conditioning.clip_tokens:
        if image_encoder is None:
            raise ValueError("this model has image_dim: pass an image encoder (data.image_encoder_path)")
        frames = torch.stack([image] if last is None else [image, last])
        tokens = image_encoder.encode(frames).flatten(0, 1).to(device, torch.float32)  # (m, image_dim)
        extra["image"] = tokens
    return condition, extra


def to_uint8_frames(video: torch.Tensor, upscale: int = 1) -> torch.Tensor:
    """(3, f, h, w) in [-1, 1] -> (f, h*upscale, w*upscale, 3) uint8, nearest-neighbour enlarged."""
    frames = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)
    if upscale > 1:
        frames = frames.repeat_interleave(upscale, dim=1).repeat_interleave(upscale, dim=2)
    return frames


def frame_grid(videos: list[torch.Tensor], upscale: int = 1) -> torch.Tensor:
    """Rows = prompts, columns = frames -> one (H, W, 3) uint8 image. Clips must share a shape."""
    rows = [torch.cat(list(to_uint8_frames(v, upscale)), dim=1) for v in videos]
    return torch.cat(rows, dim=0)


def slug(text: str, limit: int = 60) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:limit] or "unconditional"


def write_clips(
    videos: list[torch.Tensor],
    prompts: list[str],
    out_dir: str | Path,
    seed: int,
    fps: int = 8,
    upscale: int = 4,
    grid: bool = True,
    tag: str = "",
) -> list[Path]:
    """One .mp4 per prompt and (``grid``) one PNG of all frames, rows = prompts; -> the paths written.

    ``tag`` prefixes the names (the training step, for validation clips)."""
    import imageio.v2 as imageio

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (prompt, video) in enumerate(zip(prompts, videos)):
        path = out / f"{tag}{i:02d}_{slug(prompt)}_seed{seed}.mp4"
        frames = to_uint8_frames(video, upscale).numpy()
        imageio.mimwrite(path, list(frames), fps=fps, codec="libx264", macro_block_size=1, quality=8)
        paths.append(path)
    if grid:
        path = out / f"{tag}grid_seed{seed}.png"
        imageio.imwrite(path, frame_grid(videos, upscale).numpy())
        paths.append(path)
    return paths
