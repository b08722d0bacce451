"""Train a video DiT.

    python train.py --config configs/tiny.yaml [section.key=value ...] [--resume [PATH] | --overwrite]
    python train.py --config configs/wan-14b-finetune.yaml --dry-run     # check it, train nothing
    python train.py --config configs/tiny.yaml train.lr=1e-3 --print-config > my.yaml

Single process by default. Under torchrun, parallel.mode=static or parallel.mode=dynamic runs
context parallelism (see README).
"""

from __future__ import annotations

import argparse
import os
import sys

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
        help="resume from a run directory or step directory; alone, from output_dir's latest checkpoint",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="train into an output_dir an earlier run used: that run is moved to <output_dir>.old-N first",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides such as train.max_steps=200")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.resume and "=" in args.resume and not os.path.exists(args.resume):
        # `--resume train.max_steps=2000`: argparse took the override as the optional path
        args.overrides.insert(0, args.resume)
        args.resume = "auto"

    return run_cli(lambda: run(args), args.debug)


def run(args) -> int:
    from dit.config import load_config
    from dit.run_dir import prepare_output_dir

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        from dit.config_cli import dump_config

        print(dump_config(cfg), end="")
        return 0
    if args.dry_run:  # exit code 1 when it found problems (missing paths, ...)
        from dynamic_cp.dry_run import dry_run

        return dry_run(cfg, args.world_size if cfg.parallel.mode != "none" else 1)
    resume = cfg.output_dir if args.resume == "auto" else args.resume
    # torchrun's RANK: only rank 0 moves an old run aside (the same rank that writes the new one)
    prepare_output_dir(cfg.output_dir, resume, args.overwrite, os.environ.get("RANK", "0") == "0")
    if cfg.parallel.mode == "none":
        from dit.trainer import Trainer

        Trainer(cfg, resume=resume).train()
    else:
        from dynamic_cp.runtime.launch import run_distributed

        run_distributed(cfg, resume=resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
