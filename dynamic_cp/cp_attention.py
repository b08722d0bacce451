"""The seam between the Dynamic-CP runtime and the DiT: CP attention for one micro-batch and group.

The runtime calls ``make_cp_attention`` once per micro-batch with the CP group the plan gave it and
the micro-batch's global clip lengths. It gets back the ``AttentionFn`` to hand the model and this
rank's ``ShardInfo`` (token range, local clip lengths) to shard tokens and positions with:

    attention, info = make_cp_attention(group, seq_lens, method="auto", num_heads=cfg.heads)
    out = model(info.shard(tokens), info.shard(positions), info.local_seq_lens, ..., attention=attention)

Positions are sliced, not renumbered, so RoPE inside the model sees each token's global (t, h, w).

Selection: a group of one rank (or no group) needs no communication and gets ``PackedAttention``.
Otherwise "auto" picks Ulysses when the heads divide by the group size (fewer, larger messages and one
full-sequence kernel call), and ring attention when they do not (ring works for any group size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dit.attention import AttentionFn, PackedAttention
from dynamic_cp.ring import RingAttention
from dynamic_cp.sharding import ShardInfo, make_shard_info
from dynamic_cp.ulysses import UlyssesAttention, check_heads

METHODS = ("auto", "ulysses", "ring")


def choose_method(method: str, num_heads: int | None, group_size: int) -> str:
    """ "local" | "ulysses" | "ring": what ``make_cp_attention`` will build for this group size."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if group_size == 1:
        return "local"
    if method == "ring":
        return "ring"
    if num_heads is None:
        raise ValueError(
            f"method={method!r} needs num_heads (the model's attention heads) to check divisibility"
        )
    if method == "ulysses":
        check_heads(num_heads, group_size)
        return "ulysses"
    return "ulysses" if num_heads % group_size == 0 else "ring"


def make_cp_attention(
    group: dist.ProcessGroup | None,
    seq_lens: torch.Tensor | list[int],
    method: str = "auto",
    num_heads: int | None = None,
) -> tuple[AttentionFn, ShardInfo]:
    """(attention function for this rank, this rank's shard) for one micro-batch over ``group``.

    group: the CP group of this micro-batch (every rank of it calls this with the same arguments);
        None means no context parallelism.
    seq_lens: (b,) global tokens per clip of the whole micro-batch.
    method: "auto" | "ulysses" | "ring"; see ``choose_method``.
    num_heads: attention heads of the model; required unless method="ring" or the group has one rank.
    """
    group_size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "this process is not a member of the CP group it was handed; only its ranks may call"
        )
    info = make_shard_info(seq_lens, group_size, rank)
    chosen = choose_method(method, num_heads, group_size)
    if chosen == "local":
        return PackedAttention(info.seq_lens), info
    if chosen == "ulysses":
        return UlyssesAttention(group, info), info
    return RingAttention(group, info), info
