"""Local attention kernels and the attention seam the DiT calls.

The model never decides *how* attention is computed. Each self-attention call goes through an
``AttentionFn`` that it is handed for the current micro-batch:

    attention(q, k, v) -> out        q, k, v, out: (n_local, heads, head_dim)

``n_local`` is the number of tokens this process holds. In a single process that is the whole packed
micro-batch and ``PackedAttention`` below does block-diagonal (per-clip) attention. Under context
parallelism ``dynamic_cp`` hands the model a function that closes over the process group and the
global packing instead; the model code is the same.

Legend: n = packed tokens, h = heads, d = head dim, b = clips in the micro-batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

log = logging.getLogger(__name__)

try:  # flash-attn is an optional CUDA extra; the CPU path never needs it.
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

try:  # torch >= 2.10 ships its own varlen flash attention (CUDA only), no extra wheel to match
    from torch.nn.attention.varlen import AuxRequest, varlen_attn
except ImportError:  # pragma: no cover - older torch
    AuxRequest = varlen_attn = None

# Backends of the local varlen kernels, in the order they are preferred on CUDA:
#   flash_attn:   flash-attn's flash_attn_varlen_func (fp16/bf16), when the wheel is installed;
#   torch_varlen: torch.nn.attention.varlen.varlen_attn, torch's own FlashAttention-2 build (FA3 on
#                 Hopper when torch has it registered, see ``_activate_fa3``), when torch has flash;
#   sdpa:         torch SDPA one clip at a time: CPU, fp32, or no flash kernel at all.
BACKENDS = ("flash_attn", "torch_varlen", "sdpa")
HALF = (torch.float16, torch.bfloat16)


def cu_seqlens_from_lengths(lengths: torch.Tensor | list[int]) -> torch.Tensor:
    """(b,) lengths -> (b+1,) int32 cumulative offsets, the layout flash-attn's varlen API uses."""
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def torch_varlen_available() -> bool:
    """torch's varlen API is importable and this torch build has its CUDA flash kernels."""
    return varlen_attn is not None and torch.backends.cuda.is_flash_attention_available()


def pick_backend(
    device_type: str, dtype: torch.dtype, *, flash_attn_installed: bool, torch_varlen: bool
) -> str:
    """The backend for tensors of ``device_type``/``dtype`` given what is installed (pure: testable)."""
    if device_type == "cuda" and dtype in HALF:
        if flash_attn_installed:
            return "flash_attn"
        if torch_varlen:
            return "torch_varlen"
    return "sdpa"


_chosen: set[tuple] = set()  # (device type, dtype, backend) choices already logged


def _activate_fa3(device: torch.device) -> None:
    """Switch torch's flash kernels to FA3 on Hopper (sm90) when this torch has FA3 registered."""
    from torch.nn import attention as nn_attention

    try:
        impls = getattr(nn_attention, "list_flash_attention_impls", lambda: [])()
        if torch.cuda.get_device_capability(device)[0] != 9 or "FA3" not in impls:
            return
        if nn_attention.current_flash_attention_impl() is not None:
            return  # the user chose one already
        nn_attention.activate_flash_attention_impl("FA3")
        log.info("torch flash attention: FA3 activated on %s", torch.cuda.get_device_name(device))
    except Exception as exc:  # noqa: BLE001 - FA3 is an optimization; FA2 stays correct
        log.warning("torch flash attention: FA3 unavailable (%s); staying on FA2", exc)


def attention_backend(q: torch.Tensor) -> str:
    """The backend the local kernels use for ``q``; the first use of each choice is logged."""
    name = pick_backend(
        q.device.type,
        q.dtype,
        flash_attn_installed=flash_attn_varlen_func is not None,
        torch_varlen=q.is_cuda and torch_varlen_available(),
    )
    key = (q.device.type, q.dtype, name)
    if key not in _chosen:
        _chosen.add(key)
        if name == "torch_varlen":
            _activate_fa3(q.device)
        log.info("attention backend for %s %s: %s", q.device.type, q.dtype, name)
    return name


def uses_device_offsets(q: torch.Tensor) -> bool:
    """The fused kernels read the clip offsets on q's device; SDPA per clip walks host offsets."""
    return attention_backend(q) != "sdpa"


def max_segment(cu_seqlens: torch.Tensor) -> int:
    """Longest segment of (b+1,) offsets; read it from host offsets (on the device it is a sync)."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if len(cu_seqlens) > 1 else 0


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Bidirectional attention of segment i of q over segment i of k/v, for every segment.

    q: (nq, h, d), k/v: (nk, h, d), cu_seqlens_*: (b+1,) offsets. Segments may be empty (a clip with no
    tokens on this rank). Returns (nq, h, d). ``backend`` (default: ``attention_backend(q)``): on CUDA in
    half precision flash-attn's varlen kernel, else torch's own ``varlen_attn``; otherwise torch SDPA
    one segment at a time (exact, no padding). max_seqlen_*: the longest
    segments when the caller knows them (it must, to pass offsets already on the device without a sync).
    """
    backend = backend or attention_backend(q)
    if backend != "sdpa":
        # the maxima from the offsets as given (host ones: no device sync), then the copy (a no-op
        # for offsets a caller keeps on the device)
        max_q = max_segment(cu_seqlens_q) if max_seqlen_q is None else max_seqlen_q
        max_k = max_segment(cu_seqlens_k) if max_seqlen_k is None else max_seqlen_k
        cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
        cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
        if backend == "flash_attn":
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=False)
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k)  # bidirectional: window (-1, -1)
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    outs = []
    for i in range(len(bounds_q) - 1):
        qs, qe, ks, ke = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if qe == qs:
            continue
        if ke == ks:  # nothing to attend to: a zero output, as flash-attn gives
            outs.append(q.new_zeros(qe - qs, *q.shape[1:]))
            continue
        # (l, h, d) -> (1, h, l, d): 4-D inputs reach SDPA's fused CPU kernel; 3-D ones fall back to
        # the unfused math path, about twice as slow in forward + backward
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None], v[ks:ke].transpose(0, 1)[None]
        )
        outs.append(o[0].transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # one clip: skip the copy


class PackedAttention:
    """Single-process self-attention over a packed batch: each clip attends only to itself."""

    def __init__(self, seq_lens: torch.Tensor | list[int]):
        self.cu_seqlens = cu_seqlens_from_lengths(seq_lens)  # (b+1,) on the host: the CPU path walks it
        self.max_len = max_segment(self.cu_seqlens)
        self._device_cu: torch.Tensor | None = None  # the offsets on the fused kernel's device

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cu = self.cu_seqlens
        if uses_device_offsets(q):  # every layer calls this object: copy the offsets once, not once per layer
            if self._device_cu is None or self._device_cu.device != q.device:
                self._device_cu = cu.to(q.device)
            cu = self._device_cu
        return varlen_attention(q, k, v, cu, cu, self.max_len, self.max_len)
