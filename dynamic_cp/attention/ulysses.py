"""Ulysses (DeepSpeed sequence parallel) attention over a group of ranks holding contiguous shards.

Each rank holds a contiguous token shard of q, k, v with all heads. One all-to-all per tensor trades
that for *all* tokens of the group's shards and h/c of the heads; an inner attention runs over those
tokens; a last all-to-all returns the output to token shards. Heads must divide by the group size c.
Shard sizes may differ (by one token, or be empty), so the all-to-alls use unequal split sizes.

Plain Ulysses: the group is the whole CP group, its shards cover the micro-batch, and the inner
attention is block-diagonal varlen attention with the global clip lengths (``PackedAttention``).
2-D (Ulysses x ring, ``dynamic_cp/attention/cp_attention.py``): the group is one Ulysses block of a CP group,
its shards cover the block's token range, and the inner attention is ring attention over the blocks.

Legend: n = tokens of the group's shards together, n_r = tokens of shard r, c = group size,
h = heads, d = head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dit.attention import AttentionFn
from dynamic_cp.attention.comm_clock import timed


def _tokens_to_heads(x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    # (n_r, h, d) -> (c, n_r, h/c, d): head block j is the contiguous part bound for rank j
    c, (n_r, h, d) = len(sizes), x.shape
    send = x.reshape(n_r, c, h // c, d).transpose(0, 1).contiguous().reshape(c * n_r, h // c, d)
    # (c * n_r, h/c, d) -all_to_all-> (n, h/c, d): rank i's tokens land in rank order, which is global
    # token order because shards are contiguous. Split sizes differ when shards do (all_to_all_single,
    # since gloo's list all_to_all needs equal sizes).
    recv = x.new_empty(sum(sizes), h // c, d)
    with timed():
        dist.all_to_all_single(recv, send, output_split_sizes=sizes, input_split_sizes=[n_r] * c, group=group)
    return recv


def _heads_to_tokens(y: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    # the inverse of _tokens_to_heads
    c, n_r = len(sizes), sizes[dist.get_rank(group)]
    _, h_c, d = y.shape
    # (n, h/c, d) -all_to_all-> (c * n_r, h/c, d): rank j sends back its head block of our tokens
    recv = y.new_empty(c * n_r, h_c, d)
    with timed():
        dist.all_to_all_single(
            recv, y.contiguous(), output_split_sizes=[n_r] * c, input_split_sizes=sizes, group=group
        )
    # (c, n_r, h/c, d) -> (n_r, h, d)
    return recv.reshape(c, n_r, h_c, d).transpose(0, 1).reshape(n_r, c * h_c, d)


class _TokensToHeads(torch.autograd.Function):
    """Token-sharded -> head-sharded; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _tokens_to_heads(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_tokens(grad, ctx.group, ctx.sizes), None, None


class _HeadsToTokens(torch.autograd.Function):
    """Head-sharded -> token-sharded; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, y, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _heads_to_tokens(y, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _tokens_to_heads(grad, ctx.group, ctx.sizes), None, None


def check_heads(num_heads: int, group_size: int) -> None:
    if num_heads % group_size != 0:
        raise ValueError(
            f"Ulysses attention needs heads divisible by the CP group size, but heads={num_heads} and "
            f"group size={group_size}; use method='ring' (any group size) or 'auto', or a group size "
            f"that divides {num_heads}"
        )


class UlyssesAttention:
    """``AttentionFn`` for one rank of ``group``: (n_r, h, d) q, k, v -> (n_r, h, d).

    sizes: tokens of each member's shard, in group rank order; together one contiguous token range.
    inner: attention over that range with h/c heads, (n, h/c, d) -> (n, h/c, d).
    """

    def __init__(self, group: dist.ProcessGroup, sizes: list[int], inner: AttentionFn):
        if dist.get_world_size(group) != len(sizes):
            raise ValueError(
                f"{len(sizes)} shard sizes for a group of {dist.get_world_size(group)} ranks; "
                "pass one size per member of this group"
            )
        self.group, self.sizes, self.inner = group, list(sizes), inner
        self.num_local = self.sizes[dist.get_rank(group)]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        check_heads(q.shape[1], len(self.sizes))
        if q.shape[0] != self.num_local:
            raise ValueError(f"q has {q.shape[0]} tokens but this rank's shard holds {self.num_local}")
        # (n_r, h, d) -all_to_all-> (n, h/c, d), for each of q, k, v
        q, k, v = (_TokensToHeads.apply(x, self.group, self.sizes) for x in (q, k, v))
        out = self.inner(q, k, v)  # (n, h/c, d)
        # (n, h/c, d) -all_to_all-> (n_r, h, d)
        return _HeadsToTokens.apply(out, self.group, self.sizes)
