"""Command line: what would Dynamic-CP save over static CP and Megatron's scheduler on my data?

    python -m dynamic_cp.simulate --workload opensora --gpus 64 --model wan-1.3b
    python -m dynamic_cp.simulate --manifest data.csv --gpus 16 32 --gantt out/run
    python -m dynamic_cp.simulate --lengths ../shared/workloads/wikipedia_lengths.txt --gpus 128

Prints, per GPU count, each method's simulated step time, speedup over static CP, efficiency
(lower bound / step) and solver milliseconds. ``--gantt PREFIX`` writes PREFIX_<method>_<W>.png.
Then, per weight-sharding mode (``--fsdp``, default all: none, per_step, per_layer): memory per GPU,
whether it fits, the step's lower bound, and static CP, Megatron's scheduler and Dynamic-CP under that
mode's token cap and collectives, with the mode ``parallel.fsdp: auto`` would pick.

``--pp N`` (N > 1) puts the world on N pipeline stages instead: each method plans over W / N ranks,
and the table shows the pipeline step, bubble fraction, memory per GPU and each plan's order bound
(``dynamic_cp/planning/compare_pipeline.py``); ``--gantt`` then draws one row per (stage, rank).
"""

from __future__ import annotations

import argparse
import sys

from data.cli import add_debug_flag, run_cli
from dynamic_cp.planning.compare import METHODS, compare, format_rows
from dynamic_cp.planning.compare_modes import MODE_METHODS, compare_modes, format_mode_rows
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import normalize_cp_sizes
from dynamic_cp.planning.hardware import builtin_profiles
from dynamic_cp.planning.memory import FSDP_MODES
from dynamic_cp.planning.model_dims import MODELS
from dynamic_cp.planning.planner import check_lengths, min_cp_index
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
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (parallel.pp_size); 1: none")
    ap.add_argument("--pp-schedule", default="1f1b", choices=["1f1b", "gpipe"], help="parallel.pp_schedule")
    ap.add_argument("--pp-layers", type=int, nargs="+", help="blocks per stage (default: balanced)")
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


def run_pipeline(args, cm: CostModel, world: int) -> None:
    """One world size on ``args.pp`` stages: the pipeline table (and Gantt charts)."""
    from dynamic_cp.planning.compare_pipeline import compare_pipeline, format_pipeline_rows, work_bound
    from dynamic_cp.planning.pipeline_memory import pipeline_token_cap
    from dynamic_cp.planning.pipeline_sim import default_stage_layers, gantt_pipeline
    from dynamic_cp.planning.pipeline_stages import check_pipeline

    check_pipeline(world, args.pp, cm.dims.layers)
    R = world // args.pp
    layers = args.pp_layers or default_stage_layers(cm.dims, args.pp)
    if len(layers) != args.pp:
        raise ValueError(f"--pp-layers lists {len(layers)} stages; give --pp={args.pp} block counts")
    cap = args.cap or pipeline_token_cap(cm.dims, cm.hw.memory_bytes, layers, R, args.checkpointing)
    lengths = batch_for(args, world)
    try:
        min_cp_index(check_lengths(lengths), cap, normalize_cp_sizes(R))
    except ValueError as err:  # the user's to fix, as without stages; say what PP changed
        raise ValueError(f"{err}; with --pp {args.pp} a CP group has at most {R} ranks: add --checkpointing, "
                         "use fewer stages or more GPUs") from None  # fmt: skip
    print(
        f"\n== {args.workload or args.manifest or args.lengths} | {world} GPUs = {args.pp} stages x {R} ranks "
        f"({args.pp_schedule}, blocks {layers}) | {args.model} on {cm.hw.name} | {len(lengths)} clips, "
        f"{sum(lengths):,} tokens, max {max(lengths):,} | cap {cap:,.0f} tokens/rank"
    )
    rows = compare_pipeline(
        lengths, args.pp, R, cap, cm, layers, args.pp_schedule, args.checkpointing, args.methods
    )
    print(format_pipeline_rows(rows, work_bound(lengths, cm, args.pp, R, cap), cm.hw.memory_bytes))
    print(
        "(step = last op + each stage's gradient all-reduce over its ranks; bubble = idle share of the ops' span)"
    )
    for r in rows if args.gantt else []:
        if r.plan is not None:
            path = f"{args.gantt}_{r.method}_{world}_pp{args.pp}.png"
            title = (
                f"{r.method}: {world} GPUs, {args.pp} stages, step {r.step_s:.2f} s, bubble {r.bubble:.1%}"
            )
            gantt_pipeline(r.schedule, r.plan, path, title)
            print(f"wrote {path}")


def run(args) -> int:
    cm = CostModel.from_name(args.model, args.hardware, args.comm)
    for world in args.gpus:
        if args.pp > 1:
            run_pipeline(args, cm, world)
            continue
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
