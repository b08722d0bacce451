"""Planner benchmarks: solver time scaling and plan quality against static CP and Megatron.

    python bench/bench_planner.py quality            # workloads x GPU counts, markdown table
    python bench/bench_planner.py scaling            # solver ms, 100..10,000 clips x 8..1,024 ranks
    python bench/bench_planner.py quality --samples-per-gpu 1 --seeds 0 1 2

Every plan is scored by the same cost model and simulator (dynamic_cp.planning.compare). Timings are wall
clock (quality) and process CPU time (scaling) on this machine. Benchmarks print; they never assert.
"""

from __future__ import annotations

import argparse
import statistics
import time

from dynamic_cp.planning.compare import compare
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.planner import plan
from dynamic_cp.planning.workloads import LONG_TAILED, WORKLOADS, workload


def quality(args) -> None:
    cm = CostModel.from_name(args.model, args.hardware)
    print(
        f"model {args.model}, hardware {args.hardware}, {args.samples_per_gpu} clips per GPU, seeds {args.seeds}"
    )
    print(
        "step time in s (mean over seeds); x = speedup of Dynamic-CP, (max) = baseline / lower bound, the most any "
        "planner could get; eff = lower bound / step, worst seed\n"
    )
    print(
        "| workload | GPUs | bound | static | static-bal | megatron | dynamic-cp | x static (max) | x static-bal "
        "| x megatron (max) | eff dyn | eff megatron | solver ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.workloads:
        for world in args.gpus:
            cap = cm.token_cap(shard_world=world)
            acc = {
                k: []
                for k in ("static", "static-balanced", "megatron", "dynamic-cp", "eff", "effm", "ms", "lb")
            }
            for seed in args.seeds:
                lengths = workload(name, int(args.samples_per_gpu * world), seed)
                bound, rows = compare(lengths, world, cap, cm)
                by = {r.method: r for r in rows}
                for k in ("static", "static-balanced", "megatron", "dynamic-cp"):
                    acc[k].append(by[k].step_s)
                acc["eff"].append(by["dynamic-cp"].efficiency)
                acc["effm"].append(by["megatron"].efficiency)
                acc["ms"].append(by["dynamic-cp"].solver_ms)
                acc["lb"].append(bound)
            m = {k: statistics.fmean(v) for k, v in acc.items()}
            ours = m["dynamic-cp"]
            tail = " (long-tailed)" if name in LONG_TAILED else ""
            # (max) = the speedup a plan reaching the lower bound would have: no planner can beat it.
            print(
                f"| {name}{tail} | {world} | {m['lb']:.2f} | {m['static']:.2f} | {m['static-balanced']:.2f} "
                f"| {m['megatron']:.2f} | {ours:.2f} | {m['static'] / ours:.2f} ({m['static'] / m['lb']:.2f}) "
                f"| {m['static-balanced'] / ours:.2f} | {m['megatron'] / ours:.2f} ({m['megatron'] / m['lb']:.2f}) "
                f"| {min(acc['eff']):.3f} | {min(acc['effm']):.3f} | {m['ms']:.0f} |"
            )


def scaling(args) -> None:
    cm = CostModel.from_name(args.model, args.hardware)
    print(f"solver CPU ms (best of {args.repeats}), workload {args.workload}, model {args.model}\n")
    print("| clips \\ ranks | " + " | ".join(str(w) for w in args.ranks) + " |")
    print("|---" * (len(args.ranks) + 1) + "|")
    for n in args.clips:
        cells = []
        for world in args.ranks:
            cap = cm.token_cap(shard_world=world)
            lengths = workload(args.workload, n, seed=0)
            if max(lengths) > cap * world:
                cells.append("n/a")
                continue
            best = float("inf")
            for _ in range(args.repeats if n * world <= 1_000_000 else 1):
                # CPU time of this process: the solver is single-threaded, so on an idle machine this
                # is its wall time, and it stays honest when other jobs share the cores.
                t = time.process_time()
                plan(lengths, world, cap, cm)
                best = min(best, (time.process_time() - t) * 1e3)
            cells.append(f"{best:.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["quality", "scaling"])
    ap.add_argument("--model", default="wan-1.3b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--gpus", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--samples-per-gpu", type=float, default=4.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workload", default="opensora", help="scaling: which workload's lengths")
    ap.add_argument("--clips", type=int, nargs="+", default=[100, 300, 1000, 3000, 10000])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    quality(args) if args.what == "quality" else scaling(args)


if __name__ == "__main__":
    main()
