"""Frozen base weights stored in float8 (e4m3), computed in bf16 or fp32: ``model.base_dtype``.

LoRA on Wan 14B holds a frozen 14B-parameter base: 28 GB in bf16, 14 GB in fp8. As musubi-tuner's
``--fp8_base`` / ``--fp8_scaled`` do, each linear layer of the transformer blocks keeps its weight
as float8_e4m3fn values and a float32 scale, and dequantises it for its own matmul only:

- ``fp8_e4m3``: one scale per weight matrix (amax / 448, e4m3's largest value);
- ``fp8_scaled``: one scale per output row, so a row's outlier costs only that row its precision.

Only the blocks' linear layers are stored so (attention q/k/v/out, the image keys and values, the
FFN); norms, the modulation table, the embedders and the head keep their dtype. LoRA adapters stay
fp32 and are the only trainable parameters.

Why not diffusers' ``apply_layerwise_casting(storage_dtype=float8_e4m3fn)``: it casts the stored
weight to fp8 with no scale. Wan's weights are mostly 1e-3 to 5e-2, where e4m3 without a scale is in
its subnormal range (below 2^-6) and keeps one to three significant bits; with the scale every weight
but the row's or tensor's smallest keeps e4m3's full 4. Its docs also warn that it may not compose
with PEFT layers, which wrap exactly these linears. So this small module does the cast, with scales.

Memory in backward: ``F.linear`` on a dequantised weight would save that bf16 copy for the input's
gradient, a full bf16 base across the step. ``_FP8Matmul`` saves the fp8 weight and its scale and
dequantises again in backward, so only one layer's bf16 weight exists at a time.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BASE_DTYPES = ("auto", "fp8_e4m3", "fp8_scaled", "bf16", "fp32")


def quantize(weight: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight -> (fp8 values (out, in), fp32 scale (out, 1) per row or (1, 1) per tensor),
    with weight ~= values * scale. A row (or tensor) of zeros gets scale 1 and values 0."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax().reshape(1, 1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # clamped: amax / scale can round a hair above 448, and e4m3fn has no infinity (it would be NaN)
    values = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return values, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values * scale in fp32 (exact: a 4-bit significand times a float32), rounded once to ``dtype``."""
    return (values.float() * scale).to(dtype)


class _FP8Matmul(torch.autograd.Function):
    """x @ dequantize(w).T + bias in ``dtype``; saves the fp8 weight, not its dequantised copy."""

    @staticmethod
    def forward(ctx, x, values, scale, bias, dtype):
        ctx.save_for_backward(values, scale)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        with torch.autocast(x.device.type, enabled=False):  # the dtype is ours, not autocast's
            w = dequantize(values, scale, dtype)
            return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_out):
        values, scale = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            w = dequantize(values, scale, ctx.dtype)
            grad_x = grad_out.to(ctx.dtype) @ w
        return grad_x.to(ctx.x_dtype), None, None, None, None


class FP8Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored as fp8 values and a scale (see ``quantize``)."""

    def __init__(self, linear: nn.Linear, per_row: bool, compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.per_row, self.compute_dtype = per_row, compute_dtype
        values, scale = quantize(linear.weight, per_row)
        self.register_buffer("weight_fp8", values)
        self.register_buffer("weight_scale", scale)
        bias = None if linear.bias is None else linear.bias.detach().to(compute_dtype)
        self.register_buffer("bias", bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, for code that reads ``.weight`` (peft reads its dtype and device)."""
        return dequantize(self.weight_fp8, self.weight_scale, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8Matmul.apply(x, self.weight_fp8, self.weight_scale, self.bias, self.compute_dtype)

    def extra_repr(self) -> str:
        kind = "per-row" if self.per_row else "per-tensor"
        return (
            f"in={self.in_features}, out={self.out_features}, fp8 e4m3 {kind}, compute {self.compute_dtype}"
        )


def store_base_in_fp8(model: nn.Module, per_row: bool, compute_dtype: torch.dtype) -> int:
    """Replace the frozen linear layers of every transformer block (``...blocks.N...``) by
    ``FP8Linear``, in place; under LoRA the adapted layer's ``base_layer``. -> layers converted.
    Call after the adapters are added, so that peft wraps plain linears."""
    converted = 0
    for name, module in list(model.named_modules()):
        if "blocks" not in name.split(".")[:-1]:  # inside a block (ExpertPair: high.blocks.N too)
            continue
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and not child.weight.requires_grad:
                setattr(module, child_name, FP8Linear(child, per_row, compute_dtype))
                converted += 1
    return converted


def check_base_dtype(base_dtype: str, lora: bool) -> None:
    """ValueError naming the fix for a ``model.base_dtype`` that cannot apply."""
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"model.base_dtype={base_dtype!r}; choose one of {', '.join(BASE_DTYPES)}")
    if base_dtype != "auto" and not lora:
        raise ValueError(
            f"model.base_dtype={base_dtype} sets the frozen base of a LoRA run; set model.lora "
            "(e.g. model.lora={}) or drop model.base_dtype (full training keeps fp32 master weights)"
        )


def base_storage_dtype(base_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a LoRA base is frozen in before any fp8 storage: bf16/fp32 as named, else compute's."""
    if base_dtype == "bf16" and compute_dtype != torch.bfloat16:
        # fp32 activations meet the bf16 weights in F.linear, which takes one dtype
        raise ValueError(
            "model.base_dtype=bf16 with fp32 compute: set train.mixed_precision=bf16 (auto is bf16 on "
            "CUDA), or model.base_dtype=fp8_scaled or auto"
        )
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(base_dtype, compute_dtype)
