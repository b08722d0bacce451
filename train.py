"""Train a video DiT.

    python train.py --config configs/tiny.yaml [section.key=value ...] [--resume [auto|PATH] | --overwrite]
    torchrun --max-restarts=3 --nproc_per_node=8 train.py --config my.yaml --resume auto   # restartable
    python train.py --config configs/wan-14b-finetune.yaml --dry-run     # check it, train nothing
    python train.py --config configs/tiny.yaml train.lr=1e-3 --print-config > my.yaml

Single process by default. Under torchrun, parallel.mode=static or parallel.mode=dynamic runs
context parallelism (see README).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from data.cli import add_debug_flag, run_cli


def main(argv: list[str] | None = None) -> int:
    from dit.config_cli import help_epilog

    parser = argparse.ArgumentParser(
        description=__doc__, epilog=help_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the merged config as YAML and exit"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="build data and model (meta device), print clips, tokens, parameters, memory, plan; train nothing",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", 8)),
        help="ranks the dry run plans for under parallel.mode=static/dynamic (default $WORLD_SIZE or 8)",
    )
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config file")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        help="'auto' (also the flag alone, or train.resume=auto): the newest whole checkpoint of output_dir, "
        "or a fresh start when there is none; safe as the argument of every restart. A PATH: that run "
        "directory's newest whole checkpoint, or that step directory",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="train into an output_dir an earlier run used: that run is moved to <output_dir>.old-N first",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="let --resume continue with data/model/flow settings other than the checkpoint's "
        "(refused by default: the run would learn something else than it did)",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides such as train.max_steps=200")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the flags
    if args.resume and "=" in args.resume and not os.path.exists(args.resume):
        # `--resume train.max_steps=2000`: argparse took the override as the optional path
        args.overrides.insert(0, args.resume)
        args.resume = "auto"

    return run_cli(lambda: run(args), args.debug)


def run(args) -> int:
    from dit.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        from dit.config_cli import dump_config

        print(dump_config(cfg), end="")
        return 0
    if args.dry_run:  # exit code 1 when it found problems (missing paths, ...)
        from dynamic_cp.dry_run import dry_run

        return dry_run(cfg, args.world_size if cfg.parallel.mode != "none" else 1)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.parallel.mode == "none" and processes > 1:  # each would train alone into one output_dir
        raise ValueError(
            f"parallel.mode=none under torchrun with {processes} processes: each would train the whole "
            "run alone into the same output_dir; set parallel.mode=dynamic (or static), or run one process"
        )
    resume = resolve_resume(cfg, args.resume, args.overwrite, args.allow_config_change)
    is_main = os.environ.get("RANK", "0") == "0"
    if is_main:  # building the model and data, then step 0's validation, can take minutes
        print(
            f"{cfg.output_dir}: building the model and the data ({cfg.data.source}), then step 0", flush=True
        )
    if cfg.parallel.mode == "none":
        from data.cpu_threads import set_cpu_threads
        from dit.trainer import Trainer

        if note := set_cpu_threads():  # on a loaded CPU: fewer threads than cores (data/cpu_threads.py)
            print(note, flush=True)

        Trainer(cfg, resume=resume).train()
    else:
        from dynamic_cp.runtime.launch import run_distributed

        run_distributed(cfg, resume=resume)
    if is_main:
        print(finished(cfg.output_dir))
    return 0


def finished(output_dir: str) -> str:
    """The run's last line: where its checkpoint is and the command that samples it."""
    from dit.checkpoint_whole import newest_whole_checkpoint

    step_dir = newest_whole_checkpoint(Path(output_dir) / "checkpoints", lambda _: None)
    if step_dir is None:
        return f"done: no checkpoint in {output_dir}/checkpoints"
    return (
        f"done: checkpoint {step_dir}; sample it with: python sample.py --checkpoint {output_dir} "
        '--prompt "your caption" --grid'
    )


def resolve_resume(
    cfg, resume_arg: str | None, overwrite: bool, allow_config_change: bool = False
) -> str | None:
    """The step directory to resume (None: start fresh) from ``--resume`` or ``train.resume``, after
    refusing or moving aside a used output_dir. Every rank resolves it from the same files (a
    shared file system, as resuming needs anyway); only torchrun's rank 0 moves, drops or reports.

    A checkpoint this launch cannot load, or one trained on other data/model/flow settings, stops the
    run here in one line (``dit/resume_checks.py``), before anything in output_dir is written. A run
    with checkpoints never starts fresh: ``--resume auto`` starts at step 0 only where no save finished."""
    from dit.checkpoint import find_resume_checkpoint, resolve_checkpoint
    from dit.checkpoint_whole import step_dirs
    from dit.resume_checks import check_resume
    from dit.run_dir import drop_metrics_of_unsaved_run, prepare_output_dir

    is_main = os.environ.get("RANK", "0") == "0"
    report = print if is_main else (lambda line: None)
    resume_arg = resume_arg if resume_arg is not None else cfg.train.resume
    if resume_arg is None:
        prepare_output_dir(cfg.output_dir, None, overwrite, is_main)
        return None
    if resume_arg != "auto":
        prepare_output_dir(cfg.output_dir, resume_arg, overwrite, is_main)
        step_dir = resolve_checkpoint(resume_arg, report, whole=True)
    else:
        prepare_output_dir(cfg.output_dir, cfg.output_dir, overwrite, is_main)
        step_dir = find_resume_checkpoint(cfg.output_dir, report)
        saved = Path(cfg.output_dir) / "checkpoints"
        if step_dir is None and saved.is_dir() and any(not p.name.endswith(".tmp") for p in step_dirs(saved)):
            raise ValueError(
                f"--resume auto: {saved} holds checkpoints but none is whole (see the lines above); "
                "restore one, or resume an earlier one with --resume PATH"
            )
        if step_dir is None:
            report(f"--resume auto: no whole checkpoint in {cfg.output_dir}; starting fresh")
            if is_main:
                drop_metrics_of_unsaved_run(cfg.output_dir)
            return None
    check_resume(cfg, step_dir, allow_config_change)
    return str(step_dir)


if __name__ == "__main__":
    sys.exit(main())
