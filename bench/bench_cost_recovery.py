"""Recovery from a wrong prior (simulation): plan from h100 on a cluster that is not an h100 cluster.

    PYTHONPATH=$PWD python bench/bench_cost_recovery.py                      # 32-128 GPUs, 4 workloads
    PYTHONPATH=$PWD python bench/bench_cost_recovery.py --gpus 64 --slowdown 2 4

The true cluster (``dynamic_cp.planning.cost_recovery.true_cluster``) has links ``--slowdown`` x
slower (inter-node 1.3x more), GEMM/attention efficiency 0.75x/0.7x with 2.5x/3x later knees, 2x the
per-micro-batch overhead and 2-3x the collective latency. Each step plans a fresh global batch
(4 clips per GPU, wan-1.3b) with the current model, the true cluster "runs" it (timings with 5%
noise), and the model is refit every step. Efficiency = true lower bound / true step time; "true"
is the plan the true model itself makes. Columns: step 0 (the prior) and the mean of steps 15-19.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynamic_cp.planning.cost_model import CostModel  # noqa: E402
from dynamic_cp.planning.cost_recovery import recover, true_cluster  # noqa: E402
from dynamic_cp.planning.workloads import WORKLOADS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--workloads", nargs="+", default=sorted(WORKLOADS))
    ap.add_argument("--slowdown", type=float, nargs="+", default=[3.0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="wan-1.3b")
    args = ap.parse_args()
    prior = CostModel.from_name(args.model, "h100")
    print(
        "| workload | GPUs | links | eff. step 0 (prior / true) | eff. steps 15-19 (learned / true) "
        "| pred. error step 0 | pred. error steps 15-19 |"
    )
    print("|---|---|---|---|---|---|---|")
    for slow in args.slowdown:
        true = true_cluster(prior, slow)
        for w in args.gpus:
            for name in args.workloads:
                steps = recover(name, w, prior, true, steps=args.steps)
                late = steps[-5:]
                print(
                    f"| {name} | {w} | {slow:g}x slower | {steps[0].efficiency:.3f} / {steps[0].efficiency_true:.3f} "
                    f"| {statistics.mean(s.efficiency for s in late):.3f} / "
                    f"{statistics.mean(s.efficiency_true for s in late):.3f} "
                    f"| {100 * steps[0].prediction_error:.0f}% "
                    f"| {100 * statistics.median(s.prediction_error for s in late):.1f}% |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
