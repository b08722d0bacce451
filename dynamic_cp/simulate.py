"""Command line: what would Dynamic-CP save over static CP and Megatron's scheduler on my data?

    python -m dynamic_cp.simulate --workload opensora --gpus 64 --model wan-1.3b
    python -m dynamic_cp.simulate --manifest data.csv --gpus 16 32 --gantt out/run
    python -m dynamic_cp.simulate --lengths ../shared/workloads/wikipedia_lengths.txt --gpus 128

Prints, per GPU count, each method's simulated step time, speedup over static CP, efficiency
(lower bound / step) and solver milliseconds. ``--gantt PREFIX`` writes PREFIX_<method>_<W>.png.
Then, per weight-sharding mode (``--fsdp``, default all: none, per_step, per_layer): memory per GPU,
whether it fits, the step's lower bound, and static CP, Megatron's scheduler and Dynamic-CP under that
mode's token cap and collectives, with the mode ``parallel.fsdp: auto`` would pick.
"""

from __future__ import annotations

import argparse
import sys

from data.cli import add_debug_flag, run_cli
from dynamic_cp.planning.compare import METHODS, compare, format_rows
from dynamic_cp.planning.compare_modes import MODE_METHODS, compare_modes, format_mode_rows
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.hardware import builtin_profiles
from dynamic_cp.planning.memory import FSDP_MODES
from dynamic_cp.planning.model_dims import MODELS
from dynamic_cp.planning.simulator import gantt, simulate
from dynamic_cp.planning.workloads import WORKLOADS, read_lengths, read_manifest, sample_batch, workload


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dynamic_cp.simulate", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="built-in workload (DESIGN.md statistics)")
    src.add_argument("--manifest", help="CSV/JSONL manifest (path,text,num_frames,height,width,fps)")
    src.add_argument("--lengths", help="text file of token counts, one per line")
    ap.add_argument("--gpus", type=int, nargs="+", default=[64], help="world sizes to simulate")
    ap.add_argument("--model", default="wan-1.3b", choices=sorted(MODELS))
    ap.add_argument("--hardware", default="h100", help=f"profile name {builtin_profiles()} or YAML path")
    ap.add_argument("--comm", default="auto", choices=["auto", "ulysses", "ring"])
    ap.add_argument("--samples-per-gpu", type=float, default=4.0, help="global batch = this x GPUs")
    ap.add_argument("--batch", type=int, help="global batch size in clips (overrides --samples-per-gpu)")
    ap.add_argument("--cap", type=float, help="tokens per rank (default: the cost model's memory model)")
    ap.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing in the memory model"
    )
    ap.add_argument(
        "--fsdp",
        nargs="+",
        default=["all"],
        choices=["all", "off", *FSDP_MODES],
        help="weight-sharding modes to compare (all, or off to skip the per-mode table)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--gantt", metavar="PREFIX", help="write PREFIX_<method>_<gpus>.png per-rank charts")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="clip-policy option for --manifest, as in data.options (e.g. fps=16, max_frames=81, resolution=632)",
    )
    return ap


def batch_for(args, world: int) -> list[int]:
    n = args.batch or max(1, int(round(args.samples_per_gpu * world)))
    if args.workload:
        return workload(args.workload, n, args.seed)
    if args.manifest:
        from data.clip_policy import parse_options  # imports torch: only for manifests

        pool = read_manifest(args.manifest, parse_options(args.option))
    else:
        pool = read_lengths(args.lengths)
    if args.manifest and args.batch is None and len(pool) <= n:
        return list(pool)  # a small manifest is one global batch
    return sample_batch(pool, n, args.seed)


def main(argv=None) -> int:
    ap = build_parser()
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    return run_cli(lambda: run(args), args.debug)


def run(args) -> int:
    cm = CostModel.from_name(args.model, args.hardware, args.comm)
    for world in args.gpus:
        cap = args.cap or cm.token_cap(shard_world=world, activation_checkpointing=args.checkpointing)
        lengths = batch_for(args, world)
        print(
            f"\n== {args.workload or args.manifest or args.lengths} | {world} GPUs | {args.model} on "
            f"{cm.hw.name} | {len(lengths)} clips, {sum(lengths):,} tokens, max {max(lengths):,} | "
            f"cap {cap:,.0f} tokens/rank"
        )
        bound, rows = compare(lengths, world, cap, cm, args.methods)
        print(format_rows(bound, rows))
        if args.gantt:
            for r in rows:
                if r.plan is None:
                    continue
                path = f"{args.gantt}_{r.method}_{world}.png"
                sched = simulate(r.plan, lengths, cm)
                title = f"{r.method}: {world} GPUs, step {sched.step_s:.2f} s, efficiency {r.efficiency:.2f}"
                gantt(sched, r.plan, lengths, path, title)
                print(f"wrote {path}")
        if "off" not in args.fsdp:
            modes = FSDP_MODES if "all" in args.fsdp else tuple(m for m in FSDP_MODES if m in args.fsdp)
            methods = [m for m in MODE_METHODS if m in args.methods or m == "dynamic-cp"]
            chosen, mode_rows = compare_modes(
                lengths, world, cm, args.checkpointing, args.cap, modes, methods
            )
            print()
            print(format_mode_rows(chosen, mode_rows, cm.hw.memory_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
