"""The files a sampling run writes: clip names, uint8 frames, mp4 clips and PNG grids, each written
atomically (a killed job never leaves a truncated clip under its name)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from dit.sample_requests import SampleRequest


def check_writable(requests: list[SampleRequest], upscale: int) -> None:
    """H.264 (yuv420p) needs even frame sizes: a ValueError naming the first request whose written
    clip (its size times ``upscale``) has an odd height or width, before anything is sampled."""
    for r in requests:
        h, w = r.height * upscale, r.width * upscale
        if h % 2 or w % 2:
            raise ValueError(
                f"{r.label()}: a {w}x{h} clip (width x height, after --upscale {upscale}) cannot be written "
                "as H.264, which needs even sizes; ask for an even --height/--width or pass --upscale 2"
            )


def output_path(out_dir: str | Path, request: SampleRequest, settings: str = "") -> Path:
    """``<index>_<prompt>_seed<seed>_<key>.mp4``: the key changes with anything that changes the
    clip (the request and ``settings``: model, shift, output options), so a rerun skips exactly the
    clips it would write again."""
    return (
        Path(out_dir)
        / f"{request.index:02d}_{slug(request.prompt)}_seed{request.seed}_{request.key(settings)}.mp4"
    )


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

    out = Path(out_dir)
    paths = []
    for i, (prompt, video) in enumerate(zip(prompts, videos)):
        path = out / f"{tag}{i:02d}_{slug(prompt)}_seed{seed}.mp4"
        paths.append(write_video(video, path, fps, upscale))
    if grid:
        path = out / f"{tag}grid_seed{seed}.png"
        paths.append(write_grid_png(frame_grid(videos, upscale), path))
    return paths


PARTIAL_PREFIX = ".partial-"


def remove_partials(out_dir: str | Path) -> int:
    """Delete the temporary folders a killed job left in ``out_dir`` (never a finished clip); -> how
    many. Call it before this job writes anything there."""
    out = Path(out_dir)
    stale = list(out.glob(PARTIAL_PREFIX + "*")) if out.is_dir() else []
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return len(stale)


class _partial:
    """A temporary path beside ``path`` (same name, in a hidden folder of the same directory) that
    is renamed onto ``path`` on success: a killed job never leaves a truncated clip under its name."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=self.path.parent)
        return Path(self.dir) / self.path.name  # same suffix: ffmpeg picks the container by it

    def __exit__(self, kind, *_):
        try:
            if kind is None:
                os.replace(Path(self.dir) / self.path.name, self.path)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def write_video(video: torch.Tensor, path: Path, fps: int = 8, upscale: int = 1) -> Path:
    """(3, f, h, w) in [-1, 1] -> ``path`` (.mp4, H.264), written atomically."""
    import imageio.v2 as imageio

    frames = to_uint8_frames(video, upscale).numpy()
    with _partial(Path(path)) as tmp:
        imageio.mimwrite(tmp, list(frames), fps=fps, codec="libx264", macro_block_size=1, quality=8)
    return Path(path)


def write_grid_png(grid: torch.Tensor, path: Path) -> Path:
    """(H, W, 3) uint8 -> ``path`` (.png), written atomically."""
    import imageio.v2 as imageio

    with _partial(Path(path)) as tmp:
        imageio.imwrite(tmp, grid.numpy())
    return Path(path)
