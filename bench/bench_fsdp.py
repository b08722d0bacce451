"""FSDP2 modes against replicated training: per-rank memory at W=4 and CPU step time at W=2 and W=4.

    PYTHONPATH=$PWD python bench/bench_fsdp.py                # memory table + step times
    PYTHONPATH=$PWD python bench/bench_fsdp.py --steps 6      # more timed steps per mode

One spawn of W gloo ranks per world size trains the same model under parallel.mode=dynamic with
``parallel.fsdp`` = none (replicated, plain AdamW), per_step and per_layer, on the same global
batches; the modes' steps are interleaved (one step of each in turn) so all see the same machine load.

Memory (W=4, "small" widths: 4 blocks of 256 wide): bytes a rank holds *at rest* (between steps) in
parameters, gradients and AdamW moments, and the most bytes of gathered (unsharded) weights seen at
any block's forward: the buffers a mode adds during a step. Step time: median over the timed steps
of the slowest rank's step, the ratio against replicated training measured in the same run.
A benchmark, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dit.config import load_config  # noqa: E402
from dynamic_cp.runtime.fsdp import bytes_at_rest, track_gathered_peak  # noqa: E402
from dynamic_cp.runtime.launch import trainer_class  # noqa: E402
from dynamic_cp.runtime.testing import run_gloo  # noqa: E402

MODES = ("none", "per_step", "per_layer")
MODELS = {
    "tiny": "{num_layers: 4, patch_size: [1, 4, 4]}",  # 4 heads x 32, FFN 512
    "small": "{num_layers: 4, patch_size: [1, 4, 4], num_attention_heads: 4, attention_head_dim: 64, "
    "ffn_dim: 1024, text_dim: 64}",
}


def overrides(out: str, model: str, mode: str) -> list[str]:
    items = {
        "output_dir": out,
        "model.overrides": MODELS[model],
        "data.num_clips": 64,
        "data.num_val_clips": 1,
        "data.frame_counts": "[1, 5, 9]",
        "data.resolutions": "[[16, 16], [32, 16], [32, 32]]",
        "train.global_batch_size": 8,
        "train.micro_batch_tokens": 400,
        "train.warmup_steps": 1,
        "parallel.mode": "dynamic",
        "parallel.cap_tokens": 200,
        "parallel.plan_ahead": False,
        "parallel.fsdp": mode,
        "parallel.shard_optimizer": False,  # replicated = every rank holds everything
    }
    return [f"{k}={v}" for k, v in items.items()]


def worker(rank: int, world_size: int, model: str, steps: int, out: str) -> dict:
    trainers, iters, peaks = {}, {}, {}
    for mode in MODES:
        cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides(f"{out}/{mode}", model, mode))
        t = trainer_class(cfg, dist.group.WORLD)(cfg, dist.group.WORLD)
        peaks[mode] = [0]
        if mode != "none":  # replicated weights are always all there
            track_gathered_peak(t.model, peaks[mode])
        trainers[mode], iters[mode] = t, t.data_iterator()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for step in range(steps + 1):  # step 0 warms up (FSDP lazy init, DTensor sharding caches)
        for mode in MODES:
            batch = next(iters[mode])
            dist.barrier()
            t0 = time.perf_counter()
            trainers[mode].train_step(batch)
            seconds = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            if step > 0:
                times[mode].append(float(seconds))
    for it in iters.values():
        it.close()
    replicated = sum(p.numel() * p.element_size() for p in trainers["none"].model.parameters())
    return {
        "times": times,
        "memory": {m: bytes_at_rest(t.model, t.optimizer) for m, t in trainers.items()},
        "gathered": {m: (replicated if m == "none" else peaks[m][0]) for m in MODES},
        "replicated": replicated,
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:7.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode (after one warm-up)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mem = run_gloo(worker, 4, "small", 1, f"{tmp}/mem", timeout_s=1800)
        print("memory per rank at rest, W=4, 'small' model (MiB; max over ranks; params+grads+AdamW)")
        rep = mem[0]["replicated"]
        print(
            f"  {'mode':10s} {'params':>8s} {'grads':>8s} {'AdamW':>8s} {'total':>8s} {'x repl.':>8s} {'gathered in step':>17s}"
        )
        base = None
        for mode in MODES:
            rows = [mem[r]["memory"][mode] for r in range(4)]
            p, g, o = (max(row[k] for row in rows) for k in ("params", "grads", "optim"))
            total = max(sum(row.values()) for row in rows)
            base = base or total
            print(
                f"  {mode:10s} {_mib(p)} {_mib(g)} {_mib(o)} {_mib(total)} {total / base:8.3f} "
                f"{_mib(mem[0]['gathered'][mode]):>17s}"
            )
        print(
            f"  (replicated fp32 weights: {_mib(rep).strip()} MiB; 1/W of replicated total: {_mib(base / 4).strip()} MiB)"
        )
        print()
        print(f"CPU step time, tiny model, median of {args.steps} steps (slowest rank), ratio to replicated")
        for w in (2, 4):
            res = run_gloo(worker, w, "tiny", args.steps, f"{tmp}/w{w}", timeout_s=1800)[0]
            med = {m: statistics.median(res["times"][m]) for m in MODES}
            cells = "  ".join(f"{m}: {med[m] * 1e3:7.1f} ms ({med[m] / med['none']:.2f}x)" for m in MODES)
            print(f"  W={w}: {cells}")


if __name__ == "__main__":
    main()
