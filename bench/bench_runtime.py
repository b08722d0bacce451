"""Dynamic-CP against static CP 2 in the real training runtime: 2 gloo ranks, a mixed-length batch.

    python bench/bench_runtime.py                        # calibrate the cost model here, then compare
    python bench/bench_runtime.py --profile cpu.yaml     # use a profile from `python -m dynamic_cp.calibrate`

Both modes train the tiny VideoDiT (configs/tiny.yaml) through ``DistributedTrainer``: lengths are
gathered, planned, clips routed, micro-batches run with their group's CP attention, one gradient
all-reduce, AdamW. Every global batch holds the same clips (a fixed 32-clip dataset reshuffled each
step): 2 long clips of 9 frames at 32x32 (576 tokens, more than the 300-token per-rank cap, so
they need CP 2) and 30 short ones (1, 2 or 4 frames: 64, 128 or 256 tokens), about what DESIGN.md's
long-tailed video statistics look like at toy scale. Steps of the two modes alternate
in one run, so both see the same machine load; the ratio is of median step times.

Calibration (without --profile): both ranks time forward+backward of packed micro-batches at CP 1
(side by side, as in a step) and at CP 2 (Ulysses over gloo), with the time spent in the all-to-alls
apart, and ``CostModel.fit`` (the runtime's own online fit) gives the per-micro-batch and per-clip
overheads, GEMM and attention FLOP/s and the all-to-all latency and bandwidth. Online learning is
off in both trainers here (``parallel.learn_costs=false``): this bench measures one calibrated
model; ``bench/bench_learned_costs.py`` measures the default path that learns.

Predicted = the simulator's critical path of the executed plan under the calibrated profile;
measured = the step's compute window (first micro-batch to last, slowest rank) from the runtime's
timeline. A benchmark, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from data.synthetic import SyntheticClips, render  # noqa: E402
from data.types import ClipMeta  # noqa: E402
from dit.clips import TrainClip, micro_batch_loss  # noqa: E402
from dit.config import load_config  # noqa: E402
from dit.packing import grid_positions  # noqa: E402
from dynamic_cp.attention.comm_clock import CommClock  # noqa: E402
from dynamic_cp.attention.cp_attention import make_cp_attention  # noqa: E402
from dynamic_cp.planning.cost_fit import Observation  # noqa: E402
from dynamic_cp.planning.cost_model import CostModel  # noqa: E402
from dynamic_cp.planning.hardware import Hardware  # noqa: E402
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer  # noqa: E402
from dynamic_cp.runtime.step_plans import build_cost_model  # noqa: E402
from dynamic_cp.runtime.testing import run_gloo  # noqa: E402

WORLD = 2
CAP = 300
# (frames, height, width) of the 16 clips of every global batch; tokens = frames * h/4 * w/4.
SHAPES = [(9, 32, 32)] * 2 + [(1, 32, 32)] * 12 + [(2, 32, 32)] * 10 + [(4, 32, 32)] * 8
# Calibration micro-batches (clip lengths) and CP sizes.
CALIBRATION = [
    ([64], 1),
    ([64] * 4, 1),
    ([64] * 8, 1),  # with [512]: same tokens, 8x the clips, separates per-clip cost from FLOP rates
    ([512], 1),
    ([64, 128, 64], 1),
    ([128, 128], 1),
    ([256], 1),
    ([256, 64], 1),
    ([576], 1),
    ([832], 1),
    ([1088], 1),
    ([64] * 4, 2),
    ([128] * 4, 2),
    ([256, 256, 64], 2),
    ([576], 2),
    ([576, 64], 2),
    ([1088], 2),
]


def overrides(out: str, mode: str, hardware: str) -> list[str]:
    items = {
        "output_dir": out,
        "model.overrides": "{patch_size: [1, 4, 4]}",  # the token counts of SHAPES and CALIBRATION
        "data.num_val_clips": 1,
        "train.global_batch_size": len(SHAPES),
        "train.micro_batch_tokens": CAP,
        "train.warmup_steps": 1,
        "parallel.mode": mode,
        "parallel.static_cp_size": 2,
        "parallel.cp_method": "ulysses",
        "parallel.cap_tokens": CAP,
        "parallel.hardware": hardware,
        "parallel.learn_costs": False,
    }
    return [f"{k}={v}" for k, v in items.items()]


class MixedClips(SyntheticClips):
    """Synthetic clips with fixed shapes: clip i has SHAPES[i]."""

    def __init__(self, seed: int = 0):
        super().__init__(len(SHAPES), seed=seed)

    def spec(self, index: int):
        f, h, w = SHAPES[index]
        return dataclasses.replace(super().spec(index), num_frames=f, height=h, width=w)

    def meta(self, index: int) -> ClipMeta:
        f, h, w = SHAPES[index]
        return ClipMeta(f, h, w)

    def __getitem__(self, index: int) -> dict:
        s = self.spec(index)
        return {"video": render(s), "caption": s.caption, "index": index}


# ------------------------------------------------------------------------------ calibration


def _clips(lengths: list[int], text_dim: int, gen: torch.Generator) -> list[TrainClip]:
    """Random clips of 32x32 frames (64 tokens per frame), 12 text tokens each."""
    out = []
    for i, n in enumerate(lengths):
        grid = (n // 64, 8, 8)
        x0 = torch.randn(n, 48, generator=gen)
        out.append(
            TrainClip(i, x0, torch.randn_like(x0), 0.5, grid_positions(grid), torch.randn(12, text_dim))
        )
    return out


def _measure(model, world, heads: int, repeats: int = 7) -> list[tuple[float, float]]:
    """Median fwd+bwd seconds (slowest rank) and collective seconds of every CALIBRATION
    micro-batch: the median, like the step times it is meant to predict (the minimum
    under-predicted medians by 10-25% here)."""
    gen = torch.Generator().manual_seed(0)
    text_dim = model.config.text_dim
    out = []
    for lengths, c in CALIBRATION:
        clips = _clips(lengths, text_dim, gen)
        times, comms = [], []
        for i in range(repeats + 1):
            dist.barrier(group=world)
            clock = CommClock(torch.device("cpu"))
            t0 = time.perf_counter()
            with clock.active():
                attention, shard = make_cp_attention(world if c > 1 else None, lengths, "ulysses", heads)
                token_range = (shard.start, shard.end) if c > 1 else None
                micro_batch_loss(model, clips, attention, len(lengths), token_range).backward()
            elapsed = torch.tensor([time.perf_counter() - t0, clock.seconds()], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=world)
            if i:
                times.append(float(elapsed[0]))
                comms.append(float(elapsed[1]))
        model.zero_grad(set_to_none=True)
        out.append((statistics.median(times), statistics.median(comms)))
    return out


def fit_profile(cm: CostModel, measured: list[tuple[float, float]]) -> Hardware:
    """``CostModel.fit`` (the runtime's own fit) on the calibration micro-batches, from a prior
    with this machine's shape: one node of WORLD ranks, no efficiency knees."""
    prior = CostModel(
        cm.dims,
        dataclasses.replace(
            cm.hw, name="cpu-gloo", gpus_per_node=WORLD, gemm_half_tokens=0.0, attention_half_tokens=0.0
        ),
        cm.comm,
    )
    obs = [
        Observation(tuple(lengths), c, (c, 1), False, s, comm)
        for (lengths, c), (s, comm) in zip(CALIBRATION, measured)
    ]
    return replace(prior.fit(obs).hw, name="cpu-gloo-fitted", memory_bytes=64e9)


# ------------------------------------------------------------------------------ the comparison


def worker(rank: int, world_size: int, root: str, profile: str | None, steps: int) -> dict:
    world = dist.group.WORLD
    result: dict = {}
    if profile is None:
        cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides(f"{root}/cal", "dynamic", "h100"))
        trainer = DistributedTrainer(cfg, world)
        cm = build_cost_model(cfg, trainer.model.config)
        measured = _measure(trainer.model, world, trainer.model.config.num_attention_heads)
        hw = fit_profile(cm, measured)  # same inputs on every rank -> same profile
        profile = f"{root}/cpu_fitted.yaml"
        if rank == 0:
            Path(profile).write_text(hw.to_yaml())
            fitted = CostModel(cm.dims, hw, cm.comm)
            result["calibration"] = [
                (lengths, c, s, fitted.micro_batch_time(lengths, c))
                for (lengths, c), (s, _) in zip(CALIBRATION, measured)
            ]
            result["profile"] = dataclasses.asdict(hw)
        dist.barrier(group=world)

    trainers, iters = {}, {}
    for mode in ("dynamic", "static"):
        cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides(f"{root}/{mode}", mode, profile))
        t = DistributedTrainer(cfg, world)
        t.train_set, t.train_indices = MixedClips(), list(range(len(SHAPES)))
        trainers[mode], iters[mode] = t, t.data_iterator()
    records: dict[str, list[dict]] = {"dynamic": [], "static": []}
    for step in range(steps + 1):  # step 0 warms up both
        for mode in ("dynamic", "static"):
            dist.barrier(group=world)
            t0 = time.perf_counter()
            batch = next(iters[mode])
            metrics = trainers[mode].train_step(batch)
            elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=world)
            if step:
                records[mode].append({**metrics, "step_s": float(elapsed), "lengths": batch.lengths})
    for it in iters.values():
        it.close()
    result["records"] = records
    return result


def summarize(mode: str, recs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in recs) for k in ("step_s", "compute_s", "predicted_s")}
    err = [100 * (r["predicted_s"] - r["compute_s"]) / r["compute_s"] for r in recs]
    idle = np.mean([r["idle_share"] for r in recs], axis=0)
    return {
        "mode": mode,
        **med,
        "prediction_error_pct": statistics.median(err),
        "cp_hist": recs[0]["cp_hist"],
        "num_micro_batches": recs[0]["num_micro_batches"],
        "idle_share": [round(float(x), 3) for x in idle],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="measured steps per mode (after one warm-up)")
    parser.add_argument("--profile", default=None, help="hardware profile YAML; default: calibrate here")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        res = run_gloo(worker, WORLD, root, args.profile, args.steps, timeout_s=600)[0]
    lengths = res["records"]["dynamic"][0]["lengths"]
    print(
        f"global batch: {len(lengths)} clips, tokens {sorted(lengths, reverse=True)}, cap {CAP}/rank, 2 gloo ranks"
    )
    if "calibration" in res:
        print("\ncalibration (fwd+bwd of one micro-batch, slowest rank): measured vs fitted cost model")
        for lengths_, c, s, p in res["calibration"]:
            print(
                f"  CP {c}  {str(lengths_):28s} {s * 1e3:8.1f} ms  model {p * 1e3:8.1f} ms  ({100 * (p - s) / s:+.0f}%)"
            )
        hw = res["profile"]
        print(
            f"  fitted: overhead {hw['micro_batch_overhead_s'] * 1e3:.2f} ms/micro-batch + "
            f"{hw['clip_overhead_s'] * 1e3:.2f} ms/clip, "
            f"GEMM {hw['peak_flops'] * hw['gemm_efficiency'] / 1e9:.2f} GFLOP/s, "
            f"attention {hw['peak_flops'] * hw['attention_efficiency'] / 1e9:.2f} GFLOP/s, "
            f"all-to-all {hw['intra_node_latency_s'] * 1e3:.3f} ms + {hw['intra_node_bandwidth'] / 1e9:.2f} GB/s"
        )
    rows = [summarize(m, res["records"][m]) for m in ("dynamic", "static")]
    print(
        f"\n{'mode':8s} {'step s':>8s} {'compute s':>10s} {'predicted s':>12s} {'pred err':>9s}  micro-batches  CP sizes   idle share per rank"
    )
    for r in rows:
        print(
            f"{r['mode']:8s} {r['step_s']:8.3f} {r['compute_s']:10.3f} {r['predicted_s']:12.3f} "
            f"{r['prediction_error_pct']:+8.1f}%  {r['num_micro_batches']:13d}  {json.dumps(r['cp_hist']):10s} {r['idle_share']}"
        )
    ratio = rows[1]["step_s"] / rows[0]["step_s"]
    print(f"\nspeed-up of Dynamic-CP over static CP 2 (median step time, same run): {ratio:.2f}x")
    print(
        f"predicted speed-up (simulator, calibrated profile): {rows[1]['predicted_s'] / rows[0]['predicted_s']:.2f}x"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratio": ratio, **res}, indent=1, default=str))


if __name__ == "__main__":
    main()
