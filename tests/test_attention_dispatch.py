"""Which attention kernel runs where: flash-attn, else torch's own varlen_attn, else SDPA per clip.

No GPU here, and no mock of a torch kernel: the CUDA path is traced under ``FakeTensorMode``, where
tensors on a (fake) CUDA device carry shapes, dtypes and devices but no data. Calls then go through
torch's real ``torch_attn::_varlen_attn`` / ``_varlen_attn_backward`` custom ops, whose schemas check
every argument we pass (order, types, int32 offsets on the device) and whose fake implementations
give the output and LSE layouts the real kernels give. What is set by hand is only the availability
flag ``torch_varlen_available`` (this CPU build of torch has no CUDA flash kernels).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dit import attention
from dit.attention import PackedAttention, cu_seqlens_from_lengths, pick_backend, varlen_attention
from dynamic_cp.attention import kernels

CLIPS = [7, 1, 12]
H, D = 2, 16


@pytest.mark.parametrize(
    "device, dtype, flash, varlen, expected",
    [
        ("cuda", torch.bfloat16, True, True, "flash_attn"),  # flash-attn first when installed
        ("cuda", torch.float16, False, True, "torch_varlen"),  # then torch's own
        ("cuda", torch.bfloat16, False, False, "sdpa"),  # a torch without flash kernels
        ("cuda", torch.float32, True, True, "sdpa"),  # flash kernels are half precision only
        ("cpu", torch.bfloat16, True, True, "sdpa"),
        ("cpu", torch.float32, False, False, "sdpa"),
    ],
)
def test_preference_order(device, dtype, flash, varlen, expected):
    assert pick_backend(device, dtype, flash_attn_installed=flash, torch_varlen=varlen) == expected


def test_cpu_picks_sdpa_and_logs_the_choice_once(monkeypatch, caplog):
    monkeypatch.setattr(attention, "_chosen", set())
    q = torch.randn(5, H, D, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="dit.attention"):
        for _ in range(3):
            assert attention.attention_backend(q) == "sdpa"
            assert kernels.use_flash(q) is False
    assert [r.getMessage() for r in caplog.records] == ["attention backend for cpu torch.bfloat16: sdpa"]


@pytest.fixture
def fake_cuda(monkeypatch):
    """FakeTensorMode with torch's varlen flash kernels declared available, as on a CUDA build."""
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: True)
    monkeypatch.setattr(attention, "_chosen", set())
    # entered by each test after it built its host-side offsets: those are real tensors, read on
    # the host as on a GPU run (a fake one has no values to read)
    return FakeTensorMode(allow_non_fake_inputs=True)


def _qkv(n: int, dtype=torch.bfloat16):
    return (torch.empty(n, H, D, dtype=dtype, device="cuda") for _ in range(3))


def test_cuda_bf16_runs_torch_varlen_through_its_op_schema(fake_cuda):
    packed = PackedAttention(CLIPS)
    cu, cu_text = cu_seqlens_from_lengths(CLIPS), cu_seqlens_from_lengths([3, 3, 3])
    with fake_cuda:
        _check_packed(packed, cu, cu_text)


def _check_packed(packed, cu, cu_text):
    q, k, v = _qkv(sum(CLIPS))
    assert q.is_cuda and attention.attention_backend(q) == "torch_varlen"
    out = packed(q, k, v)
    assert (out.shape, out.dtype, out.device.type) == ((sum(CLIPS), H, D), torch.bfloat16, "cuda")
    assert packed._device_cu is not None and packed._device_cu.is_cuda  # offsets copied to the device
    # cross-attention shape: queries and keys of different lengths per clip
    kt, vt = (torch.empty(9, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out = varlen_attention(q, kt, vt, cu, cu_text, max(CLIPS), 3)  # a fake tensor has no max to read
    assert out.shape == q.shape
    # fp32 on CUDA falls back to SDPA per clip (flash kernels are half precision only)
    assert attention.attention_backend(torch.empty(3, H, D, device="cuda")) == "sdpa"


def test_ring_lse_kernels_trace_torch_varlen(fake_cuda):
    cu = cu_seqlens_from_lengths(CLIPS)
    with fake_cuda:
        _check_lse_kernels(cu)


def _check_lse_kernels(cu):
    n = sum(CLIPS)
    q, k, v = _qkv(n)
    assert kernels.use_flash(q)  # the ring keeps its offsets on the device for this backend
    m = max(CLIPS)  # the ring passes its maxima, read on the host (a fake tensor has none)
    out, lse = kernels.attention_fwd_lse(q, k, v, cu, cu, m, m)
    assert (out.shape, out.dtype) == ((n, H, D), torch.bfloat16)
    assert (lse.shape, lse.dtype, lse.device.type) == ((H, n), torch.float32, "cuda")  # flash-attn's layout
    dq, dk, dv = kernels.attention_bwd_lse(out, q, k, v, out, lse, cu, cu, m, m)
    assert all((g.shape, g.dtype) == ((n, H, D), torch.bfloat16) for g in (dq, dk, dv))


def test_wrong_lse_layout_is_named():
    q = torch.empty(5, H, D)
    with pytest.raises(RuntimeError, match=r"expected \(heads, total_q\)"):
        kernels._check_lse(torch.empty(5, H + 1), q, "torch varlen_attn")
