"""The seam between the Dynamic-CP runtime and the DiT: CP attention for one micro-batch and group.

The runtime calls ``make_cp_attention`` once per micro-batch with the CP group the plan gave it and
the micro-batch's global clip lengths. It gets back the ``AttentionFn`` to hand the model and this
rank's ``ShardInfo`` (token range, local clip lengths) to shard tokens and positions with:

    attention, info = make_cp_attention(group, seq_lens, method="auto", num_heads=cfg.heads)
    out = model(info.shard(tokens), info.shard(positions), info.local_seq_lens, ..., attention=attention)

Positions are sliced, not renumbered, so RoPE inside the model sees each token's global (t, h, w).

Layouts: a CP group of c ranks runs u x r = c, Ulysses degree u times ring degree r. (c, 1) is plain
Ulysses, (1, c) plain ring, and u, r > 1 the 2-D layout (``hybrid_attention``). The runtime passes
the layout its cost model prices (``CostModel.layout``). Without one, "auto" picks Ulysses when the
heads divide by the group size (fewer, larger messages and one full-sequence kernel call) and ring
when they do not (``choose_layout``). A group of one rank (or no group) gets ``PackedAttention``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dit.attention import AttentionFn, PackedAttention
from dit.packing import local_seq_lens
from dynamic_cp.attention.ring import RingAttention
from dynamic_cp.attention.sharding import ShardInfo, make_shard_info
from dynamic_cp.attention.ulysses import UlyssesAttention, check_heads
from dynamic_cp.planning.groups_layout import hybrid_sub_groups

METHODS = ("auto", "ulysses", "ring")


def choose_layout(method: str, num_heads: int | None, group_size: int) -> tuple[int, int]:
    """(ulysses, ring) degrees for ``method`` without a cost model: (1, 1), (c, 1) or (1, c)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    c = group_size
    if c == 1:
        return (1, 1)
    if method == "ring":
        return (1, c)
    if num_heads is None:
        raise ValueError(
            f"method={method!r} needs num_heads (the model's attention heads) to check divisibility"
        )
    if method == "ulysses":
        check_heads(num_heads, c)
        return (c, 1)
    return (c, 1) if num_heads % c == 0 else (1, c)


def check_layout(layout: tuple[int, int], num_heads: int | None, group_size: int) -> tuple[int, int]:
    """``layout`` as a pair of ints, or a ValueError that says what would be valid."""
    u, r = (int(x) for x in layout)
    if u < 1 or r < 1 or u * r != group_size:
        raise ValueError(
            f"layout (ulysses={u}, ring={r}) must multiply to the CP group size {group_size}, "
            f"e.g. ({group_size}, 1) or (1, {group_size})"
        )
    if u > 1 and (num_heads is None or num_heads % u):
        raise ValueError(
            f"layout (ulysses={u}, ring={r}) needs the attention heads ({num_heads}) divisible by {u}; "
            f"use a Ulysses degree that divides both {group_size} and the heads, or (1, {group_size})"
        )
    return u, r


def hybrid_attention(
    ulysses_group: dist.ProcessGroup, ring_group: dist.ProcessGroup, info: ShardInfo, ulysses: int
) -> UlyssesAttention:
    """2-D attention for one rank: Ulysses inside its block of ``ulysses`` ranks, ring over blocks.

    Block b holds group ranks [b u, (b+1) u); its token range is the union of their shards, so the
    block-level boundaries are every u-th shard boundary (uneven, possibly empty). This rank is
    member j = rank % u of block b = rank // u, and ring group j links the j-th members of all blocks
    (``groups_layout.hybrid_sub_groups``; ``make_cp_attention`` checks the groups handed in).
      (n_g, h, d) -all_to_all in block-> (n_b, h/u, d) -ring over blocks-> (n_b, h/u, d)
      -all_to_all in block-> (n_g, h, d)
    with n_g this rank's shard and n_b its block's tokens.
    """
    b = info.rank // ulysses
    bounds = info.bounds[::ulysses]  # (r+1,) global offsets of the blocks
    block = ShardInfo(b, bounds, info.seq_lens, local_seq_lens(info.seq_lens, bounds[b], bounds[b + 1]))
    sizes = info.shard_sizes[b * ulysses : (b + 1) * ulysses]  # the block members' shards
    return UlyssesAttention(ulysses_group, sizes, RingAttention(ring_group, block))


def make_cp_attention(
    group: dist.ProcessGroup | None,
    seq_lens: torch.Tensor | list[int],
    method: str = "auto",
    num_heads: int | None = None,
    layout: tuple[int, int] | None = None,
    sub_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
) -> tuple[AttentionFn, ShardInfo]:
    """(attention function for this rank, this rank's shard) for one micro-batch over ``group``.

    group: the CP group of this micro-batch (every rank of it calls this with the same arguments);
        None means no context parallelism.
    seq_lens: (b,) global tokens per clip of the whole micro-batch.
    method: "auto" | "ulysses" | "ring"; used only when ``layout`` is None (see ``choose_layout``).
    num_heads: attention heads of the model; required unless the layout is ring-only or one rank.
    layout: (ulysses, ring) degrees to run, e.g. ``CostModel.layout``'s; built exactly as given.
    sub_groups: (Ulysses block, ring group) of this rank, needed when both degrees are > 1
        (``CPGroups.sub_groups``).
    """
    group_size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "this process is not a member of the CP group it was handed; only its ranks may call"
        )
    info = make_shard_info(seq_lens, group_size, rank)
    if layout is None:
        u, r = choose_layout(method, num_heads, group_size)
    else:
        u, r = check_layout(layout, num_heads, group_size)
    if group_size == 1:
        return PackedAttention(info.seq_lens), info
    if r == 1:
        return UlyssesAttention(group, info.shard_sizes, PackedAttention(info.seq_lens)), info
    if u == 1:
        return RingAttention(group, info), info
    blocks, rings = hybrid_sub_groups(tuple(dist.get_process_group_ranks(group)), u)
    want = [list(blocks[rank // u]), list(rings[rank % u])]
    got = None if sub_groups is None else [dist.get_process_group_ranks(g) for g in sub_groups]
    if got != want:
        raise ValueError(
            f"the 2-D layout ({u}, {r}) needs this rank's (Ulysses block, ring group) with global ranks "
            f"{want}, got {got}; pass sub_groups=CPGroups.sub_groups(ranks, {u}) from "
            "build_cp_groups(..., splits=CostModel.cp_layout)"
        )
    return hybrid_attention(*sub_groups, info, u), info
