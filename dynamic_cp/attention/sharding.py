"""Split a packed micro-batch into contiguous token shards for a CP group, and gather back.

A packed micro-batch (see ``dit/packing.py``) is n tokens of b clips concatenated without padding.
Shard r of c is the contiguous global token range ``[bounds[r], bounds[r+1])``; the first ``n % c``
shards hold one extra token, so shard sizes differ by at most one. Attention is bidirectional, so a
contiguous split balances attention work as well as token counts within a clip; a shard boundary may
cut through a clip, a clip may be shorter than c, and a shard may be empty when n < c.

Shard index r is the rank *inside the CP group* (``dist.get_rank(group)``), never the global rank.

Legend: n = packed tokens, c = CP group size, b = clips, h = heads, d = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dit.packing import local_seq_lens


def shard_bounds(num_tokens: int, num_shards: int) -> list[int]:
    """(c+1,) global token offsets of c contiguous shards whose sizes differ by at most one."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1 (the CP group size)")
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    base, extra = divmod(num_tokens, num_shards)
    bounds = [0]
    for r in range(num_shards):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


@dataclass(frozen=True)
class ShardInfo:
    """What one rank of a CP group holds of a packed micro-batch."""

    rank: int
    """This rank's index inside the CP group, which is also its shard index."""
    bounds: tuple[int, ...]
    """(c+1,) global token offsets of every shard of the group."""
    seq_lens: torch.Tensor
    """(b,) global tokens per clip of the whole micro-batch."""
    local_seq_lens: torch.Tensor
    """(b,) tokens per clip inside this rank's shard; what the model is given as ``seq_lens``."""

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def num_local(self) -> int:
        return self.end - self.start

    @property
    def shard_sizes(self) -> list[int]:
        return [self.bounds[r + 1] - self.bounds[r] for r in range(self.num_shards)]

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) packed tensor (tokens, positions, targets) -> (n_local, ...) this rank's slice."""
        if x.shape[0] != self.bounds[-1]:
            raise ValueError(
                f"tensor has {x.shape[0]} tokens but the micro-batch has {self.bounds[-1]}; "
                "shard the packed tensor of this same micro-batch"
            )
        return x[self.start : self.end]


def make_shard_info(seq_lens: torch.Tensor | list[int], num_shards: int, rank: int) -> ShardInfo:
    """The shard of group rank ``rank`` when the micro-batch with these clip lengths is split c ways."""
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.long)
    if seq_lens.dim() != 1 or bool((seq_lens < 0).any()):
        raise ValueError(f"seq_lens must be a 1-D list of non-negative clip token counts, got {seq_lens}")
    bounds = shard_bounds(int(seq_lens.sum()), num_shards)
    if not 0 <= rank < num_shards:
        raise ValueError(f"rank={rank} must be in [0, {num_shards}); pass dist.get_rank(group)")
    local = local_seq_lens(seq_lens, bounds[rank], bounds[rank + 1])
    return ShardInfo(rank, tuple(bounds), seq_lens, local)


def shard_all(x: torch.Tensor, seq_lens: torch.Tensor | list[int], num_shards: int) -> list[torch.Tensor]:
    """(n, ...) -> c slices (n_r, ...); a convenience for tests and single-process planning."""
    return [make_shard_info(seq_lens, num_shards, r).shard(x) for r in range(num_shards)]


class _GatherShards(torch.autograd.Function):
    """All-gather uneven token shards into the full packed tensor.

    The backward keeps this rank's slice of the incoming gradient. That is exact when what follows
    the gather is the same on every rank of the group (a replicated loss, a test comparison): each
    rank then holds the full gradient and its slice is the gradient of its shard.
    """

    @staticmethod
    def forward(ctx, x, group, bounds):
        ctx.bounds, ctx.rank = bounds, dist.get_rank(group)
        sizes = [bounds[r + 1] - bounds[r] for r in range(len(bounds) - 1)]
        max_size = max(sizes)
        # gloo's all_gather needs equal sizes: pad every shard to the largest, then trim.
        # (n_r, ...) -pad-> (max n_r, ...) -all_gather-> c x (max n_r, ...) -trim, cat-> (n, ...)
        padded = x.new_zeros(max_size, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)], dim=0)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.bounds[ctx.rank] : ctx.bounds[ctx.rank + 1]], None, None


def gather_shards(x: torch.Tensor, group: dist.ProcessGroup, info: ShardInfo) -> torch.Tensor:
    """(n_local, ...) on every rank of ``group`` -> (n, ...) the full packed tensor on every rank.

    Differentiable; see ``_GatherShards`` for when its backward is exact.
    """
    if dist.get_world_size(group) != info.num_shards:
        raise ValueError(
            f"group has {dist.get_world_size(group)} ranks but the shard info was made for "
            f"{info.num_shards}; build both from the same group"
        )
    if x.shape[0] != info.num_local:
        raise ValueError(f"x has {x.shape[0]} tokens but this rank's shard holds {info.num_local}")
    return _GatherShards.apply(x, group, info.bounds)
