"""Local varlen attention kernels that expose the log-sum-exp, for ring attention.

Ring attention computes a query shard against one K/V shard at a time and merges the partial
results, so it needs each block's log-sum-exp (LSE) in the forward, and in the backward a kernel that
takes the *final* output and LSE instead of recomputing its own softmax. ``dit/attention.py`` only
exposes the plain output, so these live here. No ``torch.distributed`` in this file.

Three implementations with one interface, chosen in the order of ``dit.attention.attention_backend``:
- ``flash_attn`` (CUDA, fp16/bf16, flash-attn installed): ``flash_attn_varlen_func(...,
  return_attn_probs=True)`` and flash-attn's varlen backward;
- ``torch_varlen`` (CUDA, fp16/bf16, torch built with flash): ``varlen_attn(..., return_aux=
  AuxRequest(lse=True))`` and the backward op behind it, ``torch.ops.torch_attn._varlen_attn_backward``
  (the public API has no standalone backward that takes a given output and LSE);
- ``sdpa``: torch's CPU flash-attention op per segment (the kernel SDPA itself uses on CPU), or plain
  matmul-softmax (fp32 on CUDA, or a torch without that op); both exact in fp32.

Segments: segment i of q attends segment i of k/v (``cu_seqlens_*`` (s+1,) offsets). Callers pass only
segments that are non-empty on both sides.

Legend: nq/nk = query/key tokens, h = heads, d = head dim. LSE layout is (h, nq) fp32, as flash-attn's.
"""

from __future__ import annotations

import inspect
import math

import torch

from dit.attention import AuxRequest, attention_backend, max_segment, uses_device_offsets, varlen_attn

try:  # flash-attn is an optional CUDA extra; the CPU path never needs it.
    from flash_attn import flash_attn_varlen_func
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None
    _flash_attn_varlen_backward = None


def use_flash(q: torch.Tensor) -> bool:
    """A fused CUDA kernel (flash-attn or torch's varlen) runs for q: it reads offsets on the device."""
    return uses_device_offsets(q)


def _check_lse(lse: torch.Tensor, q: torch.Tensor, who: str) -> torch.Tensor:
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"{who} returned an LSE of shape {tuple(lse.shape)}, expected (heads, total_q) = "
            f"{(q.shape[1], q.shape[0])}; install flash-attn >= 2.6 or a torch whose varlen_attn returns it"
        )
    return lse.float()


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        yield bq[i], bq[i + 1], bk[i], bk[i + 1]


def _cpu_flash_available() -> bool:
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # noqa: B018
        return True
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch
        return False


_CPU_FLASH = _cpu_flash_available()


def _bhld(x: torch.Tensor) -> torch.Tensor:
    # (l, h, d) -> (1, h, l, d): the batch-first layout of torch's SDPA ops
    return x.transpose(0, 1).unsqueeze(0)


def _lhd(x: torch.Tensor) -> torch.Tensor:
    # (1, h, l, d) -> (l, h, d)
    return x.squeeze(0).transpose(0, 1)


@torch.no_grad()
def attention_fwd_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int | None = None,
    max_k: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (nq, h, d), k/v (nk, h, d) -> out (nq, h, d) in q's dtype, lse (h, nq) fp32. Scale 1/sqrt(d).

    max_q/max_k: longest segments, for offsets a caller already keeps on the device (see ``_maxima``).
    backend: one of ``dit.attention.BACKENDS`` to force (bench/gpu_check.py); default the dispatch's.
    """
    backend = backend or attention_backend(q)
    if backend != "sdpa":
        max_q, max_k = _maxima(cu_q, cu_k, max_q, max_k)
        cu_q = cu_q.to(device=q.device, dtype=torch.int32)
        cu_k = cu_k.to(device=q.device, dtype=torch.int32)
        if backend == "flash_attn":
            out, lse, _ = flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, max_q, max_k, causal=False, return_attn_probs=True
            )
            return out, _check_lse(lse, q, "flash-attn")
        out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True))
        return out, _check_lse(lse, q, "torch varlen_attn")
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        qi, ki, vi = q[qs:qe], k[ks:ke], v[ks:ke]
        if _CPU_FLASH and q.device.type == "cpu":
            o, l_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhld(qi), _bhld(ki), _bhld(vi)
            )
            out[qs:qe], lse[:, qs:qe] = _lhd(o), l_[0]
        else:  # fp32 on CUDA, or an older torch
            s = torch.einsum("qhd,khd->hqk", qi.float(), ki.float()) * scale  # (h, lq, lk)
            l_ = s.logsumexp(-1)  # (h, lq)
            out[qs:qe] = torch.einsum("hqk,khd->qhd", (s - l_[..., None]).exp(), vi.float()).to(q.dtype)
            lse[:, qs:qe] = l_
    return out, lse


def _maxima(cu_q, cu_k, max_q, max_k) -> tuple[int, int]:
    # read from the offsets as given, before any copy: host offsets need no device sync
    return (max_segment(cu_q) if max_q is None else max_q, max_segment(cu_k) if max_k is None else max_k)


def _flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k):
    """flash-attn's varlen backward; its keyword names moved between releases, so match them by name."""
    max_q, max_k = _maxima(cu_q, cu_k, max_q, max_k)
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = dict(
        dout=dout.contiguous(),
        q=q,
        k=k,
        v=v,
        out=out.contiguous(),
        softmax_lse=lse.contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        dropout_p=0.0,
        softmax_scale=1.0 / math.sqrt(q.shape[-1]),
        causal=False,
        window_size=(-1, -1),
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    params = inspect.signature(_flash_attn_varlen_backward).parameters
    _flash_attn_varlen_backward(**{name: value for name, value in args.items() if name in params})
    return dq, dk, dv


def _torch_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k):
    """torch's varlen backward op with the *given* output and LSE (its autograd saves its own)."""
    max_q, max_k = _maxima(cu_q, cu_k, max_q, max_k)
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused, as in torch
    dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
        dout.contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.contiguous(),
        lse.contiguous(),
        cu_q,
        cu_k,
        max_q,
        max_k,
        False,  # is_causal
        rng_state,
        1.0 / math.sqrt(q.shape[-1]),
        [-1, -1],  # window: full bidirectional attention
    )
    return dq, dk, dv


@torch.no_grad()
def attention_bwd_lse(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int | None = None,
    max_k: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient of one K/V block's share of an attention whose *final* output and LSE are given.

    dout/out (nq, h, d) and lse (h, nq) are the merged results over all blocks; the softmax of this
    block is then exp(s - lse), which is what makes the per-block gradients sum to the exact one.
    Returns dq (nq, h, d), dk/dv (nk, h, d) in q's dtype. backend: as in ``attention_fwd_lse``.
    """
    backend = backend or attention_backend(q)
    if backend == "flash_attn":
        return _flash_bwd(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, cu_q, cu_k, max_q, max_k)
    if backend == "torch_varlen":
        return _torch_varlen_bwd(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, cu_q, cu_k, max_q, max_k)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        qi, ki, vi, oi, doi = q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], dout[qs:qe]
        li = lse[:, qs:qe]
        if _CPU_FLASH and q.device.type == "cpu":
            g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhld(doi).contiguous(),
                _bhld(qi),
                _bhld(ki),
                _bhld(vi),
                _bhld(oi).contiguous(),
                li.unsqueeze(0).contiguous(),
                0.0,
                False,
            )
            dq[qs:qe], dk[ks:ke], dv[ks:ke] = (_lhd(x) for x in g)
        else:  # fp32 on CUDA, or an older torch
            qf, kf, vf, of, dof = (x.float() for x in (qi, ki, vi, oi, doi))
            p = (torch.einsum("qhd,khd->hqk", qf, kf) * scale - li[..., None]).exp()  # (h, lq, lk)
            dv[ks:ke] = torch.einsum("hqk,qhd->khd", p, dof).to(v.dtype)
            dp = torch.einsum("qhd,khd->hqk", dof, vf)
            delta = (dof * of).sum(-1).transpose(0, 1)  # (h, lq): rowsum(dO * O) of the final output
            ds = p * (dp - delta[..., None]) * scale
            dq[qs:qe] = torch.einsum("hqk,khd->qhd", ds, kf).to(q.dtype)
            dk[ks:ke] = torch.einsum("hqk,qhd->khd", ds, qf).to(k.dtype)
    return dq, dk, dv
