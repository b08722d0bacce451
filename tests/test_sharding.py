"""Token sharding of packed micro-batches: balance, coverage, local clip lengths, ring blocks. No processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamic_cp.attention.ring import block_between
from dynamic_cp.attention.sharding import local_seq_lens, make_shard_info, shard_all, shard_bounds

seq_lens_st = st.lists(st.integers(0, 40), min_size=1, max_size=8)
shards_st = st.integers(1, 9)


@settings(max_examples=200, deadline=None)
@given(seq_lens_st, shards_st)
def test_shards_balanced_within_one_token_and_cover_everything(seq_lens, c):
    n = sum(seq_lens)
    infos = [make_shard_info(seq_lens, c, r) for r in range(c)]
    sizes = [info.num_local for info in infos]
    assert sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert [info.start for info in infos] == shard_bounds(n, c)[:-1]
    # per-clip local lengths add up to the global ones, and to the shard size
    local = torch.stack([info.local_seq_lens for info in infos])  # (c, b)
    assert local.sum(0).tolist() == list(seq_lens)
    assert local.sum(1).tolist() == sizes


@settings(max_examples=100, deadline=None)
@given(seq_lens_st, shards_st)
def test_shard_round_trip(seq_lens, c):
    x = torch.arange(sum(seq_lens) * 2).reshape(-1, 2)
    assert torch.equal(torch.cat(shard_all(x, seq_lens, c)), x)


def test_local_seq_lens_cut_through_clips():
    # clips [0,5) [5,8) [8,15); shard [4, 9) holds 1, 3 and 1 of their tokens
    assert local_seq_lens([5, 3, 7], 4, 9).tolist() == [1, 3, 1]
    assert local_seq_lens([5, 3, 7], 0, 0).tolist() == [0, 0, 0]


def test_uneven_bounds():
    assert shard_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert shard_bounds(2, 3) == [0, 1, 2, 2]


@settings(max_examples=200, deadline=None)
@given(seq_lens_st, shards_st, st.data())
def test_ring_block_is_the_block_diagonal_mask(seq_lens, c, data):
    """The varlen block between two shards reproduces the dense same-clip mask between them."""
    seq_lens_t = torch.tensor(seq_lens)
    bounds = shard_bounds(sum(seq_lens), c)
    i, j = data.draw(st.integers(0, c - 1)), data.draw(st.integers(0, c - 1))
    clip_of = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens_t)
    q_clips, k_clips = clip_of[bounds[i] : bounds[i + 1]], clip_of[bounds[j] : bounds[j + 1]]
    want = q_clips[:, None] == k_clips[None, :]
    got = torch.zeros_like(want)
    blk = block_between(seq_lens_t, (bounds[i], bounds[i + 1]), (bounds[j], bounds[j + 1]))
    if blk is not None:
        assert blk.cu_q[-1] == blk.q_end - blk.q_start and blk.cu_k[-1] == blk.k_end - blk.k_start
        for s in range(len(blk.cu_q) - 1):
            qs, qe = blk.q_start + int(blk.cu_q[s]), blk.q_start + int(blk.cu_q[s + 1])
            ks, ke = blk.k_start + int(blk.cu_k[s]), blk.k_start + int(blk.cu_k[s + 1])
            assert qe > qs and ke > ks  # callers rely on no empty segments
            got[qs:qe, ks:ke] = True
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "args, match",
    [(([3], 0, 0), "num_shards=0"), (([3], 2, 2), "rank=2"), (([-1, 3], 2, 0), "non-negative")],
)
def test_errors(args, match):
    with pytest.raises(ValueError, match=match):
        make_shard_info(*args)


def test_shard_rejects_wrong_length():
    with pytest.raises(ValueError, match="same micro-batch"):
        make_shard_info([3, 4], 2, 0).shard(torch.zeros(6, 2))


def test_shard_info_sizes_and_count_on_an_uneven_split():
    # 7 tokens over 3 shards: bounds [0, 3, 5, 7], so shards hold 3, 2, 2 tokens
    info = make_shard_info([3, 4], 3, 1)
    assert info.num_shards == 3
    assert info.shard_sizes == [3, 2, 2]
    assert (info.start, info.end, info.num_local) == (3, 5, 2)
    assert make_shard_info([5], 1, 0).shard_sizes == [5]
    assert make_shard_info([1], 4, 3).shard_sizes == [1, 0, 0, 0]  # n < c: empty shards


def test_shard_info_is_immutable():
    """Every rank derives the same ShardInfo from the same lengths; nothing may edit one in place."""
    import dataclasses

    info = make_shard_info([3, 4], 2, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 1


class _FakeGroup:
    """A CP group of ``c`` ranks simulated in one process: this process plays ``rank``, and the
    all-gather returns every rank's shard of ``full``, zero-padded to the largest shard as the real
    ranks would send it. It records what this rank sent."""

    def __init__(self, full, bounds, rank):
        self.full, self.bounds, self.rank, self.sent = full, bounds, rank, None

    def install(self, monkeypatch):
        import torch.distributed as dist

        monkeypatch.setattr(dist, "get_rank", lambda group=None: self.rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(self.bounds) - 1)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)

    def all_gather(self, parts, tensor, group=None):
        self.sent = tensor.clone()
        assert len(parts) == len(self.bounds) - 1
        for r, part in enumerate(parts):
            shard = self.full[self.bounds[r] : self.bounds[r + 1]]
            assert part.shape == tensor.shape
            part.zero_()
            part[: shard.shape[0]] = shard


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_gather_shards_pads_gathers_trims_and_keeps_its_own_gradient(monkeypatch, rank):
    """Uneven shards (3, 2, 2 tokens of 7) of a (7, 5) tensor: each rank sends its shard zero-padded
    to 3 rows, gets back the full tensor, and the backward hands it its own rows of the gradient."""
    from dynamic_cp.attention.sharding import gather_shards

    full = torch.arange(35, dtype=torch.float32).reshape(7, 5) + 1  # no zero rows: padding shows
    info = make_shard_info([3, 4], 3, rank)
    group = _FakeGroup(full, info.bounds, rank)
    group.install(monkeypatch)
    local = info.shard(full).clone().requires_grad_(True)
    out = gather_shards(local, group, info)
    assert torch.equal(out, full)
    want_sent = torch.zeros(3, 5)
    want_sent[: info.num_local] = full[info.start : info.end]
    assert torch.equal(group.sent, want_sent)
    weight = torch.arange(35, dtype=torch.float32).reshape(7, 5) * 0.5
    (out * weight).sum().backward()
    assert torch.equal(local.grad, weight[info.start : info.end])


def test_gather_shards_rejects_a_mismatched_group_or_shard(monkeypatch):
    from dynamic_cp.attention.sharding import gather_shards

    full = torch.ones(7, 2)
    info = make_shard_info([3, 4], 3, 0)
    _FakeGroup(full, (0, 4, 7), 0).install(monkeypatch)  # a 2-rank group
    with pytest.raises(ValueError, match="group has 2 ranks"):
        gather_shards(full[:3], None, info)
    _FakeGroup(full, info.bounds, 0).install(monkeypatch)
    with pytest.raises(ValueError, match="x has 2 tokens"):
        gather_shards(full[:2], None, info)
