"""Patchify clips into tokens and pack clips of different shapes into one sequence.

A *packed* micro-batch is every clip's tokens concatenated along the token axis, with no padding:

    tokens     (n, p)  n = sum of clip token counts, p = pt*ph*pw*c (patch values, channels last)
    positions  (n, 3)  global (t, h, w) grid index of each token inside its own clip
    seq_lens   (b,)    tokens per clip

Token order inside a clip is (t, h, w) row-major, as diffusers' Wan flattens it, so a contiguous
range of tokens is a contiguous run of frames: that is what context parallelism shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange


def check_divisible(shape: tuple[int, int, int], patch: tuple[int, int, int], what: str = "clip") -> None:
    """Raise a ValueError naming the axis when a (frames, height, width) shape does not tile into patches."""
    for axis, size, p in zip(("frames", "height", "width"), shape, patch):
        if size % p != 0:
            raise ValueError(
                f"{what} {axis}={size} is not divisible by the patch size {p} on that axis; "
                f"crop or resize it to a multiple of {p}"
            )


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """(c, f, h, w) -> (f/pt * h/ph * w/pw, pt*ph*pw*c)."""
    check_divisible(tuple(x.shape[1:]), patch)
    pt, ph, pw = patch
    return rearrange(x, "c (f pt) (h ph) (w pw) -> (f h w) (pt ph pw c)", pt=pt, ph=ph, pw=pw)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """(gf*gh*gw, pt*ph*pw*c) -> (c, gf*pt, gh*ph, gw*pw); the inverse of ``patchify``."""
    pt, ph, pw = patch
    gf, gh, gw = grid
    return rearrange(
        tokens, "(f h w) (pt ph pw c) -> c (f pt) (h ph) (w pw)", f=gf, h=gh, w=gw, pt=pt, ph=ph, pw=pw
    )


def grid_positions(grid: tuple[int, int, int], device=None) -> torch.Tensor:
    """(gf*gh*gw, 3) long (t, h, w) indices in token order."""
    gf, gh, gw = grid
    t, h, w = torch.meshgrid(
        torch.arange(gf, device=device),
        torch.arange(gh, device=device),
        torch.arange(gw, device=device),
        indexing="ij",
    )
    return torch.stack([t, h, w], dim=-1).reshape(-1, 3)


@dataclass
class PackedClips:
    """Clips packed along the token axis. See the module docstring for the layout."""

    tokens: torch.Tensor  # (n, p)
    positions: torch.Tensor  # (n, 3) long
    seq_lens: torch.Tensor  # (b,) long
    grids: list[tuple[int, int, int]]  # (gf, gh, gw) per clip

    def split(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """(n, ...) -> per-clip list of (n_i, ...)."""
        return list(torch.split(tokens, self.seq_lens.tolist(), dim=0))


def pack(clips: list[torch.Tensor], patch: tuple[int, int, int]) -> PackedClips:
    """Patchify each (c, f_i, h_i, w_i) clip and concatenate the tokens."""
    if not clips:
        raise ValueError("cannot pack an empty list of clips")
    tokens, positions, grids = [], [], []
    for clip in clips:
        grid = tuple(s // p for s, p in zip(clip.shape[1:], patch))
        tokens.append(patchify(clip, patch))
        positions.append(grid_positions(grid, device=clip.device))
        grids.append(grid)
    seq_lens = torch.tensor([t.shape[0] for t in tokens], dtype=torch.long)
    return PackedClips(torch.cat(tokens), torch.cat(positions), seq_lens, grids)


def unpack(packed: PackedClips, tokens: torch.Tensor, patch: tuple[int, int, int]) -> list[torch.Tensor]:
    """(n, p) tokens laid out like ``packed`` -> list of (c, f_i, h_i, w_i) clips."""
    return [unpatchify(t, g, patch) for t, g in zip(packed.split(tokens), packed.grids)]


def local_seq_lens(seq_lens: torch.Tensor | list[int], start: int, end: int) -> torch.Tensor:
    """(b,) tokens of each clip that fall inside the global token range [start, end); zeros allowed.

    A context-parallel shard, or any slice of a packed sequence, holds this much of each clip.
    """
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.long)
    clip_end = torch.cumsum(seq_lens, 0)
    clip_start = clip_end - seq_lens
    return (
        torch.minimum(clip_end, torch.tensor(end)) - torch.maximum(clip_start, torch.tensor(start))
    ).clamp(min=0)


def interleave_index(lens: torch.Tensor) -> torch.Tensor:
    """(k, b) lengths of k packed parts -> (total,) rows of ``torch.cat(parts)`` in clip-major order.

    Part j is itself packed clip by clip (clip i holds ``lens[j, i]`` rows of it). Concatenated, the
    parts are part-major: all of part 0, then all of part 1. Indexed by this, the rows become clip
    i's rows of part 0, then of part 1, ..., then clip i + 1's: each clip's rows of every part form
    one contiguous segment (HunyuanVideo-1.5's joint video + context sequence). The inverse
    permutation (``inverse_index``) takes them back.
    """
    lens = torch.as_tensor(lens, dtype=torch.long)
    k, b = lens.shape
    starts = (torch.cumsum(lens.flatten(), 0) - lens.flatten()).view(k, b)  # each run's first row
    run_lens, run_starts = lens.t().flatten(), starts.t().flatten()  # runs in clip-major order (b*k,)
    total = int(run_lens.sum())
    run = torch.repeat_interleave(torch.arange(b * k), run_lens, output_size=total)  # (total,)
    within = torch.arange(total) - (torch.cumsum(run_lens, 0) - run_lens)[run]
    return run_starts[run] + within


def inverse_index(index: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``index``: ``x[index][inverse_index(index)] == x``."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return inverse
