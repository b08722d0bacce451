"""Ring attention over a CP group, for packed variable-length clips.

Each rank keeps its query shard. The K/V shards travel around the group: at step t rank r holds the
K/V of shard (r - t) mod c, computes its queries against it, and meanwhile sends it on to rank r+1
and receives the next from rank r-1 (batched isend/irecv, so the transfer overlaps the compute).
Partial results merge by online softmax on the log-sum-exp (LSE). Clips are block-diagonal: since
shards are contiguous ranges of the packed sequence, a (query shard, key shard) pair meets in a
contiguous run of clips, found from global token offsets, so each step is one varlen kernel call.

The backward recomputes every step from the saved final output and LSE, and passes dK/dV around the
ring together with K/V; after c steps each shard's dK/dV arrives back at its owner. Works for any
group size and head count, and uneven or empty shards.

Legend: n_r = tokens of this rank's shard, c = group size, h = heads, d = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dit.attention import cu_seqlens_from_lengths
from dynamic_cp.attention.comm_clock import timed
from dynamic_cp.attention.kernels import attention_bwd_lse, attention_fwd_lse, use_flash
from dynamic_cp.attention.sharding import ShardInfo

_KV_TAG, _DKV_TAG = 1, 2  # distinct tags keep K/V and dK/dV messages apart on gloo


@dataclass(frozen=True)
class Block:
    """Where this rank's queries meet one key shard: local row ranges and per-clip offsets."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    cu_q: torch.Tensor  # (s+1,) int32, offsets inside q[q_start:q_end]
    cu_k: torch.Tensor  # (s+1,) int32, offsets inside k[k_start:k_end]
    max_q: int  # longest segment of cu_q (read on the host, so the kernel need not read it back)
    max_k: int


def block_between(seq_lens: torch.Tensor, q_range: tuple[int, int], k_range: tuple[int, int]) -> Block | None:
    """The block-diagonal mask between two global token ranges, as one varlen block (None: no overlap).

    A clip contributes when it has tokens in both ranges. Those clips are consecutive, and every
    token of q_range between the first and last of them belongs to one of them, so the rows are one
    contiguous slice on each side.
    """
    clip_end = torch.cumsum(seq_lens, 0)
    clip_start = clip_end - seq_lens
    (qs, qe), (ks, ke) = q_range, k_range
    len_q = (clip_end.clamp(max=qe) - clip_start.clamp(min=qs)).clamp(min=0)  # (b,)
    len_k = (clip_end.clamp(max=ke) - clip_start.clamp(min=ks)).clamp(min=0)
    active = ((len_q > 0) & (len_k > 0)).nonzero().flatten()
    if active.numel() == 0:
        return None
    # clips strictly between the first and last active ones lie inside both ranges, so are active too
    first, last = int(active[0]), int(active[-1])
    q_start = max(int(clip_start[first]), qs) - qs
    k_start = max(int(clip_start[first]), ks) - ks
    return Block(
        q_start=q_start,
        q_end=min(int(clip_end[last]), qe) - qs,
        k_start=k_start,
        k_end=min(int(clip_end[last]), ke) - ks,
        cu_q=cu_seqlens_from_lengths(len_q[active]),
        cu_k=cu_seqlens_from_lengths(len_k[active]),
        max_q=int(len_q[active].max()),
        max_k=int(len_k[active].max()),
    )


class _Ring:
    """The fixed communication pattern of one group: who sends to whom, and each step's block."""

    def __init__(self, group: dist.ProcessGroup, info: ShardInfo):
        self.group, self.info = group, info
        c, r = info.num_shards, info.rank
        self.next = dist.get_global_rank(group, (r + 1) % c)
        self.prev = dist.get_global_rank(group, (r - 1) % c)
        self.sizes = info.shard_sizes
        q_range = (info.start, info.end)
        # step t: this rank holds the K/V of shard (r - t) mod c
        self.sources = [(r - t) % c for t in range(c)]
        self.blocks = [
            block_between(info.seq_lens, q_range, (info.bounds[j], info.bounds[j + 1])) for j in self.sources
        ]
        self._device_blocks: list[Block | None] | None = None  # self.blocks on flash-attn's device
        self._device_blocks_on: torch.device | None = None

    def blocks_for(self, q: torch.Tensor) -> list[Block | None]:
        """Each step's block, with its offsets on q's device when flash-attn runs: every layer's
        forward and backward reuse one copy instead of copying 2 offsets per step and layer."""
        if not use_flash(q):
            return self.blocks  # the CPU kernels walk host offsets
        if self._device_blocks_on != q.device:
            self._device_blocks_on = q.device
            self._device_blocks = [
                None if b is None else replace(b, cu_q=b.cu_q.to(q.device), cu_k=b.cu_k.to(q.device))
                for b in self.blocks
            ]
        return self._device_blocks

    def shift(self, x: torch.Tensor, shard: int, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending ``x`` (holding ``shard``) to next and receiving shard-1 from prev.

        Returns the receive buffer and the requests to wait on. An empty shard still travels, as a
        zero-size message: with NCCL, the first batched P2P call on a group must involve every rank
        of it, so no rank may skip one (NCCL >= 2.12.10 and gloo both accept zero-byte messages).
        """
        # K/V or dK/dV: (2, n_shard, h, d) -isend-> next;  prev -irecv-> (2, n_{shard-1}, h, d)
        incoming = (shard - 1) % self.info.num_shards
        recv = x.new_empty(x.shape[0], self.sizes[incoming], *x.shape[2:])
        ops = [
            dist.P2POp(dist.isend, x.contiguous(), self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        with timed():
            return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    with timed():  # what the ring did not hide behind attention
        for req in reqs:
            req.wait()


class _RingAttention(torch.autograd.Function):
    """(n_r, h, d) q, k, v -> (n_r, h, d); saves the final output and LSE, so backward only recomputes."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        c = ring.info.num_shards
        kv = torch.stack([k, v])  # (2, n_r, h, d): one message per step instead of two
        out = q.new_zeros(q.shape, dtype=torch.float32)  # (n_r, h, d) running output
        lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)  # (h, n_r)
        for t, (src, blk) in enumerate(zip(ring.sources, ring.blocks_for(q))):
            if t < c - 1:
                kv_next, reqs = ring.shift(kv, src, _KV_TAG)
            if blk is not None:
                rows = slice(blk.q_start, blk.q_end)
                o_b, l_b = attention_fwd_lse(
                    q[rows],
                    kv[0, blk.k_start : blk.k_end],
                    kv[1, blk.k_start : blk.k_end],
                    blk.cu_q,
                    blk.cu_k,
                    blk.max_q,
                    blk.max_k,
                )
                # online softmax: rescale both partial results to the merged normalizer
                l_old = lse[:, rows]
                l_new = torch.logaddexp(l_old, l_b)
                w_old = (l_old - l_new).exp().transpose(0, 1).unsqueeze(-1)  # (rows, h, 1)
                w_b = (l_b - l_new).exp().transpose(0, 1).unsqueeze(-1)
                out[rows] = out[rows] * w_old + o_b.float() * w_b
                lse[:, rows] = l_new
            if t < c - 1:
                _wait(reqs)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        c = ring.info.num_shards
        dout = dout.contiguous()
        kv = torch.stack([k, v])  # (2, n_r, h, d)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # dK/dV of the shard held now, summed so far
        for t, (src, blk) in enumerate(zip(ring.sources, ring.blocks_for(q))):
            if t < c - 1:
                kv_next, kv_reqs = ring.shift(kv, src, _KV_TAG)
            if blk is not None:
                rows, cols = slice(blk.q_start, blk.q_end), slice(blk.k_start, blk.k_end)
                dq_b, dk_b, dv_b = attention_bwd_lse(
                    dout[rows], q[rows], kv[0, cols], kv[1, cols], out[rows], lse[:, rows],
                    blk.cu_q, blk.cu_k, blk.max_q, blk.max_k,
                )  # fmt: skip
                dq[rows] += dq_b.float()
                dkv[0, cols] += dk_b.float()
                dkv[1, cols] += dv_b.float()
            # dK/dV follow their K/V one hop behind; the last hop (t = c-1) brings them home.
            if c > 1:
                dkv_next, dkv_reqs = ring.shift(dkv, src, _DKV_TAG)
            if t < c - 1:
                _wait(kv_reqs)
                kv = kv_next
            if c > 1:
                _wait(dkv_reqs)
                dkv = dkv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class RingAttention:
    """``AttentionFn`` for one rank of a CP group: (n_r, h, d) q, k, v -> (n_r, h, d)."""

    def __init__(self, group: dist.ProcessGroup, info: ShardInfo):
        if dist.get_world_size(group) != info.num_shards or dist.get_rank(group) != info.rank:
            raise ValueError("the shard info was made for another group or rank; build it from this group")
        self.info = info
        self.ring = _Ring(group, info)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.info.num_local:
            raise ValueError(f"q has {q.shape[0]} tokens but this rank's shard holds {self.info.num_local}")
        return _RingAttention.apply(q, k, v, self.ring)
