"""Generate clips with a trained VideoDiT: flow-matching Euler steps with classifier-free guidance.

All prompts of a call share one packed sequence, conditional and unconditional copies included, so a
guided step is one forward pass. Noise comes from one generator seeded by ``seed``: the same seed and
arguments give the same clip.

Legend: n = tokens of one clip, b = prompts, p = patch values.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from data.tokens import latent_shape
from dit.attention import PackedAttention
from dit.flow import shift_for_tokens
from dit.packing import check_divisible, grid_positions, unpatchify


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
) -> list[torch.Tensor]:
    """-> one (3, f, h, w) video in [-1, 1] per prompt. ``vae`` None means the model works in pixels."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    device = next(model.parameters()).device
    patch = tuple(model.config.patch_size)
    stride = (1, 1, 1) if vae is None else vae.stride
    channels = model.config.in_channels
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
    x = torch.randn(b * n, p, generator=g).to(device)  # (b*n, p) noise of every prompt, packed
    for t in scheduler.timesteps:
        x_in = torch.cat([x, x]) if guided else x
        v = model(x_in, positions, seq_lens, t.expand(clips).float(), text, text_lens, attention).float()
        if guided:
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + guidance * (v_cond - v_uncond)
        x = scheduler.step(v, t, x).prev_sample

    videos = []
    for tokens in x.split(n):
        latent = unpatchify(tokens, grid, patch)  # (c, f, h, w)
        video = latent if vae is None else vae.decode(latent[None])[0]
        videos.append(video.clamp(-1, 1).cpu())
    return videos


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
