"""Move prepared clips from the rank that loaded them to every rank that runs them.

What travels: each clip's *prepared* tensors (latent tokens x0, noise, positions, text embedding)
and its sigma, not pixels and not raw samples. Reasons:
- the VAE and the text encoder run exactly once per clip, on the rank that read it, so that
  expensive work is spread over all ranks by the loader's round-robin share, whatever the plan;
- latents are ~48x smaller than pixels (stride 4x8x8, 16 channels), so the all-to-all is cheap next
  to the micro-batch it feeds;
- all randomness of a clip (noise, sigma, caption dropout) is drawn by ``prepare_clip`` from
  (seed, step, dataset index), so where it is prepared does not change a single number.

A clip that runs on a CP group of c ranks is sent whole to each of them (c copies): every member
needs the clip's token count and text for its shard's loss weights and cross-attention, and the
token slice is cut locally by ``micro_batch_loss(token_range=...)``. Sending only each member's
token slice would save (c-1)/c of x0/noise traffic for long clips; left out for simplicity.

Protocol (two world collectives, both in plan-independent order, so no rank can skip one):
1. ``all_gather_object`` of small per-clip headers (sample id, dataset index, sigma, shapes), so
   every rank knows how many floats it will receive from each source;
2. one ``all_to_all_single`` of a flat float32 buffer with per-destination split sizes (works on
   gloo and on NCCL, where the buffer lives on the GPU).

Legend: n = clip tokens, p = patch values, l = text tokens, d = text width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dit.clips import TrainClip


def owner_of(sample_id: int, world_size: int) -> int:
    """Rank that loads global-batch position ``sample_id``: rank r reads positions r, r+W, r+2W, ..."""
    return sample_id % world_size


def share_of(rank: int, world_size: int, batch_size: int) -> list[int]:
    """Global-batch positions rank ``rank`` loads (empty when the batch has fewer clips than ranks)."""
    return list(range(rank, batch_size, world_size))


def destinations(micro_batches, num_samples: int) -> list[tuple[int, ...]]:
    """sample id -> ranks that run it (the ranks of its micro-batch)."""
    out: list[tuple[int, ...] | None] = [None] * num_samples
    for ranks, ids in micro_batches:
        for s in ids:
            out[s] = tuple(ranks)
    missing = [s for s, d in enumerate(out) if d is None]
    assert not missing, f"plan leaves samples {missing[:5]} unassigned"
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class ClipHeader:
    """What a receiver needs to cut a clip out of the flat buffer and rebuild its TrainClip."""

    sample_id: int
    index: int  # dataset index
    sigma: float
    num_tokens: int  # n
    patch_values: int  # p
    text_tokens: int  # l
    text_dim: int  # d
    condition_values: int = 0  # image-to-video: mask + image latent values per token (P*cc), else 0
    image_tokens: int = 0  # Wan I2V CLIP tokens m, else 0
    image_dim: int = 0
    clean_first: bool = False  # Wan2.2 TI2V image-to-video clip (latent frame 0 clean)

    @property
    def numel(self) -> int:
        # x0 (n, p) + noise (n, p) + positions (n, 3) + text (l, d) + condition (n, P*cc) + image (m, e)
        return (
            self.num_tokens * (2 * self.patch_values + 3 + self.condition_values)
            + self.text_tokens * self.text_dim
            + self.image_tokens * self.image_dim
        )


def _header(sample_id: int, clip: TrainClip) -> ClipHeader:
    return ClipHeader(
        sample_id,
        clip.index,
        float(clip.sigma),
        clip.x0.shape[0],
        clip.x0.shape[1],
        clip.text.shape[0],
        clip.text.shape[1],
        0 if clip.condition is None else clip.condition.shape[1],
        *((0, 0) if clip.image is None else clip.image.shape),
        clip.clean_first,
    )


def _flatten(clip: TrainClip) -> torch.Tensor:
    # positions are small non-negative integers (< 2^24), exact in float32
    parts = (clip.x0, clip.noise, clip.positions, clip.text)
    parts += tuple(t for t in (clip.condition, clip.image) if t is not None)
    return torch.cat([t.reshape(-1).to(torch.float32) for t in parts])


def _unflatten(h: ClipHeader, flat: torch.Tensor) -> TrainClip:
    n, p, nt, d = h.num_tokens, h.patch_values, h.text_tokens, h.text_dim
    pc, m, e = h.condition_values, h.image_tokens, h.image_dim
    x0, noise, positions, text, condition, image = torch.split(
        flat, [n * p, n * p, n * 3, nt * d, n * pc, m * e]
    )
    return TrainClip(
        h.index,
        x0.view(n, p).clone(),
        noise.view(n, p).clone(),
        h.sigma,
        positions.view(n, 3).long(),
        text.view(nt, d).clone(),
        condition.view(n, pc).clone() if pc else None,
        image.view(m, e).clone() if m else None,
        h.clean_first,
    )


def route_clips(
    mine: dict[int, TrainClip],
    dests: list[tuple[int, ...]],
    world: dist.ProcessGroup,
    device: torch.device,
) -> dict[int, TrainClip]:
    """Exchange clips so that every rank holds exactly the clips its micro-batches need.

    mine: sample id -> clip, the clips this rank loaded and prepared (its share of the global batch).
    dests: sample id -> ranks that run it, for the whole global batch (same list on every rank).
    Returns sample id -> clip for every sample whose micro-batch includes this rank.
    """
    rank, world_size = dist.get_rank(world), dist.get_world_size(world)
    headers = [_header(s, mine[s]) for s in sorted(mine)]
    all_headers: list[list[ClipHeader]] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(all_headers, headers, group=world)

    # Send buffer: for each destination rank in order, my clips it needs, in sample-id order.
    send_parts: list[torch.Tensor] = []
    send_sizes = [0] * world_size
    for dst in range(world_size):
        for h in headers:
            if dst in dests[h.sample_id]:
                send_parts.append(_flatten(mine[h.sample_id]).to(device))
                send_sizes[dst] += h.numel
    # Receive layout: for each source rank in order, its clips that I run, in sample-id order.
    incoming: list[ClipHeader] = []
    recv_sizes = [0] * world_size
    for src in range(world_size):
        for h in all_headers[src]:
            if rank in dests[h.sample_id]:
                incoming.append(h)
                recv_sizes[src] += h.numel

    send = torch.cat(send_parts) if send_parts else torch.zeros(0, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=torch.float32, device=device)
    # (sum_dst send_sizes,) -all_to_all-> (sum_src recv_sizes,)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=world)

    out: dict[int, TrainClip] = {}
    offset = 0
    for h in incoming:
        out[h.sample_id] = _unflatten(h, recv[offset : offset + h.numel])
        offset += h.numel
    return out
