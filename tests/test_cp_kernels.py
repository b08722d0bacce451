"""The LSE kernels ring attention is built from, checked by a single-process ring.

The ring's arithmetic without its messages: every query shard meets every key shard through
``block_between``, partial outputs merge on the LSE, and per-block backwards with the final output and
LSE add up to the gradient. On CPU this checks the SDPA kernels in fp32; on CUDA with flash-attn it
checks the flash-attn path in bf16 against an fp32 reference (skipped elsewhere, never faked). Only
the offsets' bookkeeping (one device copy per attention object, maxima read on the host) is checked
with a recorder in flash-attn's place, on the meta device.
"""

from __future__ import annotations

import pytest
import torch

from dit import attention
from dit.attention import PackedAttention, max_segment
from dynamic_cp.attention import kernels
from dynamic_cp.attention.ring import block_between
from dynamic_cp.attention.sharding import shard_bounds

PACKINGS = [[37], [5, 3, 7, 4, 6, 2, 5, 3], [1, 2, 17, 0, 1, 9, 3]]
HAS_FLASH = torch.cuda.is_available() and kernels.flash_attn_varlen_func is not None


def _ring_in_one_process(q, k, v, dout, seq_lens, c):
    seq_lens = torch.tensor(seq_lens)
    bounds = shard_bounds(int(seq_lens.sum()), c)
    ranges = [(bounds[r], bounds[r + 1]) for r in range(c)]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    pairs = [(i, j, block_between(seq_lens, ranges[i], ranges[j])) for i in range(c) for j in range(c)]
    pairs = [(i, j, blk) for i, j, blk in pairs if blk is not None]
    for i, j, blk in pairs:
        (qs, _), (ks, _) = ranges[i], ranges[j]
        rows, cols = slice(qs + blk.q_start, qs + blk.q_end), slice(ks + blk.k_start, ks + blk.k_end)
        o_b, l_b = kernels.attention_fwd_lse(q[rows], k[cols], v[cols], blk.cu_q, blk.cu_k)
        l_new = torch.logaddexp(lse[:, rows], l_b)
        out[rows] = (
            out[rows] * (lse[:, rows] - l_new).exp().T[..., None]
            + o_b.float() * (l_b - l_new).exp().T[..., None]
        )
        lse[:, rows] = l_new
    out = out.to(q.dtype)
    grads = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v)]
    for i, j, blk in pairs:
        (qs, _), (ks, _) = ranges[i], ranges[j]
        rows, cols = slice(qs + blk.q_start, qs + blk.q_end), slice(ks + blk.k_start, ks + blk.k_end)
        dq, dk, dv = kernels.attention_bwd_lse(
            dout[rows], q[rows], k[cols], v[cols], out[rows], lse[:, rows], blk.cu_q, blk.cu_k
        )
        grads[0][rows] += dq.float()
        grads[1][cols] += dk.float()
        grads[2][cols] += dv.float()
    return [out.float(), *grads]


def _reference(q, k, v, dout, seq_lens):
    q, k, v = (x.detach().float().clone().requires_grad_() for x in (q, k, v))
    out = PackedAttention(seq_lens)(q, k, v)
    out.backward(dout.float())
    return [out.detach(), q.grad, k.grad, v.grad]


def _check(device, dtype, tol, seq_lens, c, heads=3, head_dim=8, relative=False):
    gen = torch.Generator().manual_seed(c * 100 + len(seq_lens))
    n = sum(seq_lens)
    q, k, v, dout = (torch.randn(n, heads, head_dim, generator=gen).to(device, dtype) for _ in range(4))
    got = _ring_in_one_process(q, k, v, dout, seq_lens, c)
    want = _reference(q, k, v, dout, seq_lens)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = float((a - b).abs().max())
        if relative:  # bf16: errors scale with the magnitudes
            err /= max(1.0, float(b.abs().max()))
        assert err <= tol, f"{name}: max error {err:.2e} > {tol}"


@pytest.mark.parametrize("seq_lens", PACKINGS)
@pytest.mark.parametrize("c", [1, 2, 3, 5])
def test_cpu_lse_kernels_merge_exactly(seq_lens, c):
    _check("cpu", torch.float32, 1e-5, seq_lens, c)


def test_cpu_matmul_fallback_merges_exactly(monkeypatch):
    monkeypatch.setattr(kernels, "_CPU_FLASH", False)
    _check("cpu", torch.float32, 1e-5, PACKINGS[2], 3)


@pytest.mark.skipif(not HAS_FLASH, reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("seq_lens", PACKINGS + [[300, 1000, 7, 2000]])
@pytest.mark.parametrize("c", [2, 3, 4])
def test_flash_lse_kernels_merge_at_bf16_tolerance(seq_lens, c):
    _check("cuda", torch.bfloat16, 2e-2, seq_lens, c, heads=4, head_dim=64, relative=True)


def test_flash_offsets_are_copied_once_per_attention_object(monkeypatch):
    calls = []

    def recorder(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        calls.append((cu_q, cu_k, max_q, max_k))
        return torch.empty_like(q)

    monkeypatch.setattr(attention, "attention_backend", lambda q: "flash_attn")
    monkeypatch.setattr(attention, "flash_attn_varlen_func", recorder)
    packed = PackedAttention([5, 9, 0, 2])
    x = torch.empty(16, 2, 4, device="meta")  # stands in for a CUDA tensor: .to() makes a new one
    for _ in range(3):  # three layers
        packed(x, x, x)
    cu = calls[0][0]
    assert cu.device.type == "meta" and all(c[0] is cu and c[1] is cu for c in calls)
    assert all(c[2:] == (9, 9) for c in calls)
    blk = block_between(torch.tensor([5, 9, 0, 2]), (3, 12), (0, 16))
    assert (blk.max_q, blk.max_k) == (max_segment(blk.cu_q), max_segment(blk.cu_k)) == (7, 9)
