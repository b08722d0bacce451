"""The user path, no manual calibration: train.py under torchrun, Dynamic-CP against static CP.

    PYTHONPATH=$PWD python bench/bench_learned_costs.py --nproc 2            # dynamic vs static CP 2
    PYTHONPATH=$PWD python bench/bench_learned_costs.py --nproc 4            # vs static CP 2 and CP 4

Every run is ``torchrun --nproc_per_node=N train.py --config configs/tiny.yaml`` with the defaults a
user gets (``parallel.hardware: auto``: a quick CPU measurement at start-up, then the cost model
refits from the run's own micro-batches every ``parallel.refit_every`` steps, with bounded
exploration) on a mixed synthetic dataset: 32x32 clips of 1-9 frames at patch 1x4x4 (64-576 tokens),
most short, cap 300 tokens per rank, so a 9-frame clip needs CP 2. Contenders alternate run by run
(dynamic, static, dynamic, ...), so all see the same machine load; each figure is the median over
the steps after ``--warmup`` of every run of that contender.

Reported: median step time and the ratio static / dynamic (per round and overall); the median
|predicted - measured| / measured of the step and of its compute window; the share of step time
the model predicts exploratory choices cost; the learner's own time per step (observe, refit,
timeline) as a share of the step. A benchmark, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = {
    # 32x32 frames, patch 1x4x4: 64 tokens a frame, so clips of 64-576 tokens; one in 16 has 9 frames
    # (576 tokens, above the 300-token cap: CP 2), the rest 1-4 frames, as in a long-tailed set
    "model.overrides": "{patch_size: [1, 4, 4]}",
    "data.frame_counts": "[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 4, 4, 4, 4, 9]",
    "data.resolutions": "[[32, 32]]",
    "data.num_clips": 2048,
    "data.num_val_clips": 1,
    "train.micro_batch_tokens": 300,
    "parallel.cap_tokens": 300,
    "train.val_every": 100000,
    "train.log_every": 1,
    "train.warmup_steps": 1,
}


def run(mode: str, cp: int, nproc: int, steps: int, batch: int, out: Path, extra: list[str]) -> list[dict]:
    items = {
        **DATA,
        "output_dir": str(out),
        "train.max_steps": steps,
        "train.checkpoint_every": steps,
        "train.global_batch_size": batch,
        "parallel.mode": mode,
        "parallel.static_cp_size": cp,
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
        *[f"{k}={v}" for k, v in items.items()], *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "compute_s" in x]


def summarize(records: list[dict], warmup: int) -> dict:
    after = [r for r in records if r["step"] > warmup]
    step_err = [
        abs(r["predicted_step_s"] - r["step_s"]) / r["step_s"] for r in after if "predicted_step_s" in r
    ]
    compute_err = [abs(r["predicted_s"] - r["compute_s"]) / r["compute_s"] for r in after]
    return {
        "step_s": statistics.median(r["step_s"] for r in after),
        "compute_s": statistics.median(r["compute_s"] for r in after),
        "step_err": statistics.median(step_err) if step_err else float("nan"),
        "compute_err": statistics.median(compute_err),
        "explore_share": sum(r.get("explore_s", 0.0) for r in records) / sum(r["step_s"] for r in records),
        "learn_share": statistics.median(r.get("learn_s", 0.0) / r["step_s"] for r in records),
        "cp_hist": after[-1]["cp_hist"],
    }


def clock_cost_s(calls: int = 100000) -> float:
    """Seconds per ``comm_clock.timed()`` with a clock active (what each collective call pays)."""
    import torch

    from dynamic_cp.attention.comm_clock import CommClock, timed

    with CommClock(torch.device("cpu")).active():
        t = time.perf_counter()
        for _ in range(calls):
            with timed():
                pass
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="runs per contender, alternated")
    ap.add_argument("--steps", type=int, default=30, help="steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the medians (learning)")
    ap.add_argument("--batch", type=int, default=32, help="global batch size in clips")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("extra", nargs="*", help="more config overrides for every run (key=value)")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.nproc > (cores or 1):
        print(
            f"note: {args.nproc} ranks on {cores} cores time-share them, so work a plan spreads over "
            "more ranks than cores cannot run in parallel: the ratios measure CPU work, not the speed "
            "of a cluster with one device per rank",
            flush=True,
        )
    contenders = [("dynamic", 1), ("static", 2)] + ([("static", 4)] if args.nproc >= 4 else [])
    per_round: dict[str, list[dict]] = {f"{m}{c if m == 'static' else ''}": [] for m, c in contenders}
    records: dict[str, list[dict]] = {k: [] for k in per_round}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for (mode, cp), name in zip(contenders, per_round):
                recs = run(
                    mode, cp, args.nproc, args.steps, args.batch, Path(tmp) / f"{name}_{r}", args.extra
                )
                per_round[name].append(summarize(recs, args.warmup))
                records[name].extend(r_ for r_ in recs if r_["step"] > args.warmup)
                s = per_round[name][-1]
                print(
                    f"round {r} {name:8s} step {s['step_s']:.3f} s  compute {s['compute_s']:.3f} s  "
                    f"pred err step {100 * s['step_err']:.1f}% compute {100 * s['compute_err']:.1f}%  "
                    f"explore {100 * s['explore_share']:.2f}%  learner {100 * s['learn_share']:.2f}%  CP {s['cp_hist']}",
                    flush=True,
                )
    print(
        f"\n{args.nproc} ranks, global batch {args.batch}, {args.steps} steps per run, warm-up {args.warmup}"
    )
    med = {k: statistics.median(r["step_s"] for r in v) for k, v in records.items()}
    baseline = min((k for k in med if k.startswith("static")), key=med.get)
    for k, v in med.items():
        print(f"  {k:8s} median step {v:.3f} s")
    ratios = [
        min(per_round[k][i]["step_s"] for k in per_round if k.startswith("static"))
        / per_round["dynamic"][i]["step_s"]
        for i in range(args.rounds)
    ]
    dyn = per_round["dynamic"]
    print(f"  Dynamic-CP over the faster static ({baseline}): {med[baseline] / med['dynamic']:.2f}x overall")
    print(f"  per round: {', '.join(f'{x:.2f}x' for x in ratios)}")
    print(
        f"  dynamic: median |pred - meas| / meas of the step {100 * statistics.median(d['step_err'] for d in dyn):.1f}%, "
        f"of the compute window {100 * statistics.median(d['compute_err'] for d in dyn):.1f}%"
    )
    print(
        f"  exploration (predicted cost share of all steps): {100 * statistics.mean(d['explore_share'] for d in dyn):.2f}%; "
        f"learner time share: {100 * statistics.median(d['learn_share'] for d in dyn):.2f}%; "
        f"comm clock {clock_cost_s() * 1e6:.2f} us per collective call"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"per_round": per_round, "median_step_s": med, "ratios": ratios}, indent=1)
        )


if __name__ == "__main__":
    main()
