"""Measure this device and write a hardware profile for the cost model.

    python -m dynamic_cp.calibrate --out profile.yaml              # CUDA if present, else CPU
    python -m dynamic_cp.calibrate --out cpu.yaml --quick --d 256 --heads 4

The cost model needs throughput curves, not a model: GEMM FLOP/s against tokens per rank and
attention FLOP/s against sequence length. So we time plain torch matmuls at the model's width and
SDPA at its head count, forward and backward, and fit

    rate(n) = best * n / (n + half)      (linear in 1/rate vs 1/n: least squares)

which gives ``gemm_efficiency``/``gemm_half_tokens`` and ``attention_efficiency``/
``attention_half_tokens`` against the peak (the base profile's datasheet peak on GPU, the best
measured rate on CPU). The per-micro-batch overhead is timed as a chain of tiny fwd+bwd kernels, one
per op a DiT step launches; the per-clip overhead as what each extra clip adds to the project's own
varlen attention (one kernel for all clips with flash-attn on CUDA, so about zero there; one SDPA
call per clip on CPU). One device cannot measure links between devices, so bandwidths and
latencies come from the base profile (``--base``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from data.cli import add_debug_flag, run_cli
from dynamic_cp.planning.cost_model import ATTN_TRAIN
from dynamic_cp.planning.hardware import Hardware

OPS_PER_LAYER = 40  # kernels a DiT block launches per fwd+bwd, order of magnitude


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeats: int) -> float:
    fn()  # warm-up (allocations, kernel selection)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def fit_saturating(sizes, rates) -> tuple[float, float]:
    """Least-squares fit of rate = best * n / (n + half); returns (best, half)."""
    x = 1.0 / np.asarray(sizes, dtype=np.float64)
    y = 1.0 / np.asarray(rates, dtype=np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    if intercept <= 0:  # no saturation seen in range: take the best rate, no fall-off
        return float(np.max(rates)), 0.0
    best = 1.0 / intercept
    return best, max(float(slope * best), 0.0)


def gemm_rates(d, ffn, sizes, device, dtype, repeats):
    """FLOP/s of a training-step linear layer (fwd + both bwd GEMMs) for n tokens."""
    w = torch.randn(d, ffn, device=device, dtype=dtype, requires_grad=True)
    out = []
    for n in sizes:
        x = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)

        def step(x=x):
            y = x @ w
            y.backward(torch.ones_like(y))

        out.append(3 * 2 * n * d * ffn / _time(step, device, repeats))
    return out


def attention_rates(d, heads, lengths, device, dtype, repeats):
    """FLOP/s of bidirectional SDPA fwd + bwd for one sequence of each length."""
    hd = d // heads
    out = []
    for n in lengths:
        q, k, v = (
            torch.randn(1, heads, n, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
        )

        def step(q=q, k=k, v=v):
            o = F.scaled_dot_product_attention(q, k, v)
            o.backward(torch.ones_like(o))

        out.append(ATTN_TRAIN * 4 * n * n * d / _time(step, device, repeats))
    return out


def launch_overhead(layers, device, dtype, repeats) -> float:
    """Seconds for OPS_PER_LAYER * layers tiny fwd+bwd ops: the fixed cost of a micro-batch."""
    x = torch.randn(8, 8, device=device, dtype=dtype, requires_grad=True)

    def step():
        y = x
        for _ in range(OPS_PER_LAYER * layers // 2):
            y = y * 1.0001
        y.sum().backward()

    return _time(step, device, repeats)


def clip_overhead(d, heads, layers, device, dtype, repeats, clips: int = 33) -> float:
    """Seconds each extra clip of a packed micro-batch costs beyond its FLOPs (fwd+bwd, all layers):
    ``varlen_attention`` over ``clips`` four-token clips against one four-token clip. (One clip of
    the same total would do ``clips`` times the attention work and hide the per-call cost.)"""
    from dit.attention import cu_seqlens_from_lengths, varlen_attention

    n = 4 * clips
    q, k, v = (
        torch.randn(n, heads, d // heads, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )

    def step(tokens: int):
        cu = cu_seqlens_from_lengths([4] * (tokens // 4))

        def run():
            o = varlen_attention(q[:tokens], k[:tokens], v[:tokens], cu, cu)
            o.backward(torch.ones_like(o))

        return run

    many, one = _time(step(n), device, repeats), _time(step(4), device, repeats)
    return max(many - one, 0.0) / (clips - 1) * layers


def device_memory(device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(base: Hardware, d, ffn, heads, layers, device, quick: bool = False) -> tuple[Hardware, dict]:
    """Measure and fit; returns the new profile and the raw measurements."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    repeats = 2 if quick else 5
    top_tokens = 16384 if gpu else (2048 if quick else 8192)
    sizes = [s for s in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384) if s <= top_tokens]
    lengths = [s for s in (128, 256, 512, 1024, 2048, 4096, 8192, 16384) if s <= top_tokens // 2 or gpu]
    g = gemm_rates(d, ffn, sizes, device, dtype, repeats)
    a = attention_rates(d, heads, lengths, device, dtype, repeats)
    g_best, g_half = fit_saturating(sizes, g)
    a_best, a_half = fit_saturating(lengths, a)
    peak = max(base.peak_flops, g_best, a_best) if gpu else max(g_best, a_best, max(g), max(a))
    hw = replace(
        base,
        name=f"calibrated-{torch.cuda.get_device_name(device) if gpu else 'cpu'}".replace(" ", "-"),
        peak_flops=peak,
        gemm_efficiency=min(g_best / peak, 1.0),
        gemm_half_tokens=g_half,
        attention_efficiency=min(a_best / peak, 1.0),
        attention_half_tokens=a_half,
        micro_batch_overhead_s=launch_overhead(layers, device, dtype, repeats),
        clip_overhead_s=clip_overhead(d, heads, layers, device, dtype, repeats),
        memory_bytes=device_memory(device),
        gpus_per_node=torch.cuda.device_count() if gpu else base.gpus_per_node,
    )
    raw = {"gemm_tokens": sizes, "gemm_flops": g, "attn_lengths": lengths, "attn_flops": a}
    return hw, raw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dynamic_cp.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="profile YAML to write")
    ap.add_argument("--base", default="h100", help="profile for what one device cannot measure (links)")
    ap.add_argument("--d", type=int, default=1536, help="model width (Wan-1.3B: 1536)")
    ap.add_argument("--ffn", type=int, default=None, help="FFN width (default: about 5.8 d, as Wan)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats (CI, smoke tests)")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    return run_cli(lambda: run(args), args.debug)


def run(args) -> int:
    if args.d % args.heads:
        raise ValueError(f"--d {args.d} must be divisible by --heads {args.heads}")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as err:
        raise ValueError(
            f"--device {args.device!r} is not a device ({err}); use cuda, cuda:1 or cpu"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is available here; use --device cpu")
    base = Hardware.load(args.base)
    ffn = args.ffn or int(round(args.d * 8960 / 1536))
    hw, raw = calibrate(base, args.d, ffn, args.heads, args.layers, device, args.quick)
    for n, r in zip(raw["gemm_tokens"], raw["gemm_flops"]):
        print(f"gemm  n={n:>6}  {r / 1e12:8.3f} TFLOP/s")
    for n, r in zip(raw["attn_lengths"], raw["attn_flops"]):
        print(f"attn  L={n:>6}  {r / 1e12:8.3f} TFLOP/s")
    header = (
        f"# Calibrated on {device} with d={args.d}, ffn={ffn}, heads={args.heads}, layers={args.layers}.\n"
        f"# Bandwidths and latencies are copied from the base profile {base.name!r}.\n"
    )
    with open(args.out, "w") as f:
        f.write(header + hw.to_yaml())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
