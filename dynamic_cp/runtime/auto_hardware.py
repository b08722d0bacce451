"""``parallel.hardware: auto``: the starting profile the run then learns from.

- CUDA: the built-in profile whose name is in the device name (H100, H200, A100), else h100 with a
  note; ``gpus_per_node`` is this node's local world size.
- CPU: a quick in-process measurement (about a second) with ``dynamic_cp.calibrate``'s
  micro-benchmarks at the model's width: GEMM and attention rates, the per-micro-batch and per-clip
  overheads, and the all-to-all latency and bandwidth over the world (timed collectives at start-up,
  not per step). Every rank measures (side by side, as in a step) and the numbers are averaged with
  one all-reduce, so every rank starts from the same profile and plans stay identical.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from dynamic_cp import calibrate
from dynamic_cp.planning.hardware import Hardware, builtin_profiles
from dynamic_cp.planning.model_dims import ModelDims


def cuda_profile(device: torch.device) -> Hardware:
    name = torch.cuda.get_device_name(device).lower()
    match = next((p for p in builtin_profiles() if p in name), None)
    if match is None:
        print(f"parallel.hardware=auto: no built-in profile for {name!r}; starting from h100 and learning")
    hw = Hardware.load(match or "h100")
    return replace(hw, gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count())))


def _all_to_all_seconds(world: dist.ProcessGroup, numel: int, repeats: int = 3) -> float:
    size = dist.get_world_size(world)
    x = torch.zeros(max(numel // size, 1) * size)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, group=world)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dist.all_to_all_single(y, x, group=world)
        best = min(best, time.perf_counter() - t)
    return best


def cpu_profile(dims: ModelDims, world: dist.ProcessGroup | None) -> Hardware:
    """Quick CPU measurement (see the module docstring); identical on every rank of ``world``."""
    dev, dtype = torch.device("cpu"), torch.float32
    sizes, lengths = (64, 256, 1024), (128, 512, 1024)
    g = calibrate.gemm_rates(dims.d, dims.ffn, sizes, dev, dtype, repeats=2)
    a = calibrate.attention_rates(dims.d, dims.heads, lengths, dev, dtype, repeats=2)
    g_best, g_half = calibrate.fit_saturating(sizes, g)
    a_best, a_half = calibrate.fit_saturating(lengths, a)
    overhead = calibrate.launch_overhead(dims.layers, dev, dtype, repeats=2)
    per_clip = calibrate.clip_overhead(dims.d, dims.heads, dims.layers, dev, dtype, repeats=2)
    lat, inv_bw = 1e-4, 1e-9
    n = 1 if world is None else dist.get_world_size(world)
    if n > 1:
        small, big = 1024, 1 << 18  # float32 elements: 4 KB and 1 MB
        t_small, t_big = _all_to_all_seconds(world, small), _all_to_all_seconds(world, big)
        share = (n - 1) / n * 4  # bytes per element that leave the rank
        inv_bw = max(t_big - t_small, 1e-9) / ((big - small) * share)
        lat = max(t_small - small * share * inv_bw, 1e-6)
    v = torch.tensor([g_best, g_half, a_best, a_half, overhead, per_clip, lat, inv_bw], dtype=torch.float64)
    if n > 1:
        dist.all_reduce(v, group=world)
        v /= n
    g_best, g_half, a_best, a_half, overhead, per_clip, lat, inv_bw = v.tolist()
    peak = max(g_best, a_best)
    return Hardware(
        name="cpu-auto",
        peak_flops=peak,
        gemm_efficiency=g_best / peak,
        gemm_half_tokens=g_half,
        attention_efficiency=a_best / peak,
        attention_half_tokens=a_half,
        intra_node_bandwidth=1 / inv_bw,
        inter_node_bandwidth=1 / inv_bw,
        intra_node_latency_s=lat,
        inter_node_latency_s=lat,
        gpus_per_node=n,
        micro_batch_overhead_s=overhead,
        memory_bytes=calibrate.device_memory(dev),
        clip_overhead_s=per_clip,
    )


def auto_hardware(dims: ModelDims, device: torch.device, world: dist.ProcessGroup | None) -> Hardware:
    return cuda_profile(device) if device.type == "cuda" else cpu_profile(dims, world)
