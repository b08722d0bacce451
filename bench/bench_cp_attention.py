"""Time CP attention (forward + backward) at c = 1 and c = 2 over gloo, and the share spent communicating.

    python bench/bench_cp_attention.py                       # defaults: one clip of 1K..4K tokens
    python bench/bench_cp_attention.py --lengths 2048 8192 --heads 8 --head-dim 64 --repeats 5

Every process uses one CPU thread, so c = 2 is two "devices" against c = 1's one. For each length and
method it prints the median fwd+bwd time (slowest rank), then the same run's collectives timed alone
with the same message sizes: Ulysses' 8 all-to-alls (q, k, v, out forward; their gradients backward),
ring's K/V shifts (c-1 forward, c-1 backward) and dK/dV shifts (c backward). Ring overlaps its shifts
with compute, so its share is an upper bound on exposed communication. These figures calibrate the
planner's cost model: attention FLOP/s per device and the group's bandwidth.

A benchmark, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dit.attention import PackedAttention  # noqa: E402
from dynamic_cp.attention.cp_attention import make_cp_attention  # noqa: E402
from dynamic_cp.attention.ring import _DKV_TAG, _KV_TAG, RingAttention  # noqa: E402
from dynamic_cp.attention.ulysses import _heads_to_tokens, _tokens_to_heads  # noqa: E402
from dynamic_cp.runtime.testing import run_gloo  # noqa: E402


def _timed(fn, repeats: int, group) -> float:
    """Median seconds of fn() over ``repeats`` runs after one warm-up, slowest rank of ``group``."""
    times = []
    for i in range(repeats + 1):
        if group is not None:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor(time.perf_counter() - t0)
        if group is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if i > 0:
            times.append(float(elapsed))
    return statistics.median(times)


def _fwd_bwd(attention, q, k, v, dout):
    def run():
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        attention(qs, ks, vs).backward(dout)

    return run


def _ulysses_comm(attention, q, dout):
    group, sizes = attention.group, attention.sizes

    def run():
        for x in (q, q, q):  # q, k, v forward
            _tokens_to_heads(x, group, sizes)
        y = _tokens_to_heads(dout, group, sizes)
        _heads_to_tokens(y, group, sizes)  # out forward
        for _ in range(3):  # dq, dk, dv backward
            _heads_to_tokens(y, group, sizes)

    return run


def _ring_comm(attention: RingAttention, q):
    ring = attention.ring
    c = ring.info.num_shards
    kv = torch.stack([q, q])
    dkv = kv.float()

    def shifts(x, count, tag):
        for t in range(count):
            buf, reqs = ring.shift(x, ring.sources[t % c], tag)
            for req in reqs:
                req.wait()

    def run():
        shifts(kv, c - 1, _KV_TAG)  # forward
        shifts(kv, c - 1, _KV_TAG)  # backward: K/V again
        shifts(dkv, c, _DKV_TAG)  # backward: dK/dV, one extra hop home

    return run


def worker(rank: int, world_size: int, args) -> list[dict]:
    group = dist.new_group(list(range(world_size)))
    rows = []
    for n in args.lengths:
        seq_lens = [n // args.clips] * args.clips
        seq_lens[-1] += n - sum(seq_lens)
        gen = torch.Generator().manual_seed(n)
        q, k, v, dout = (torch.randn(n, args.heads, args.head_dim, generator=gen) for _ in range(4))
        row = {"tokens": n}
        if rank == 0:  # c = 1 on one thread, while the other rank waits
            row["c1_s"] = _timed(_fwd_bwd(PackedAttention(seq_lens), q, k, v, dout), args.repeats, None)
        dist.barrier(group=group)
        for method in ("ulysses", "ring"):
            attention, info = make_cp_attention(group, seq_lens, method=method, num_heads=args.heads)
            local = [info.shard(x) for x in (q, k, v, dout)]
            row[f"{method}_s"] = _timed(_fwd_bwd(attention, *local), args.repeats, group)
            comm = _ulysses_comm(attention, local[0], local[3]) if method == "ulysses" else None
            comm = comm or _ring_comm(attention, local[0])
            row[f"{method}_comm_s"] = _timed(comm, args.repeats, group)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="packed tokens")
    parser.add_argument("--clips", type=int, default=1, help="clips the tokens are split into")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = run_gloo(worker, 2, args, timeout_s=1800)[0]
    h, d = args.heads, args.head_dim
    print(
        f"CP attention fwd+bwd, gloo on CPU, 1 thread per rank, heads={h}, head_dim={d}, clips={args.clips}"
    )
    header = (
        f"{'tokens':>7} {'c=1 ms':>9} {'uly c=2':>9} {'comm':>8} {'share':>6} {'c1/uly':>7}"
        f" {'ring c=2':>9} {'comm':>8} {'share':>6} {'c1/ring':>7} {'GFLOP/s':>8} {'a2a GB/s':>9}"
    )
    print(header)
    for r in rows:
        n = r["tokens"]
        # attention FLOPs, forward 4 n^2 (h d) per clip, backward 2.5x forward (DESIGN.md)
        flops = 3.5 * 4 * sum(s * s for s in [n // args.clips] * args.clips) * h * d
        # Ulysses moves 8 tensors of (n/2, h, d) fp32, half of each crosses to the other rank
        a2a_bytes = 8 * (n / 2) * h * d * 4 / 2
        print(
            f"{n:>7} {r['c1_s'] * 1e3:>9.1f} {r['ulysses_s'] * 1e3:>9.1f} {r['ulysses_comm_s'] * 1e3:>8.1f}"
            f" {r['ulysses_comm_s'] / r['ulysses_s']:>6.0%} {r['c1_s'] / r['ulysses_s']:>7.2f}"
            f" {r['ring_s'] * 1e3:>9.1f} {r['ring_comm_s'] * 1e3:>8.1f} {r['ring_comm_s'] / r['ring_s']:>6.0%}"
            f" {r['c1_s'] / r['ring_s']:>7.2f} {flops / r['c1_s'] / 1e9:>8.1f}"
            f" {a2a_bytes / r['ulysses_comm_s'] / 1e9:>9.2f}"
        )


if __name__ == "__main__":
    main()
