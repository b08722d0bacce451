"""Train a video DiT.

    python train.py --config configs/tiny.yaml [section.key=value ...] [--resume [PATH]]

Single process by default. Under torchrun, parallel.mode=static or parallel.mode=dynamic runs
context parallelism (see README).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config file")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        help="resume from a run directory or step directory; alone, from output_dir's latest checkpoint",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides such as train.max_steps=200")
    args = parser.parse_args(argv)
    if args.resume and "=" in args.resume and not os.path.exists(args.resume):
        # `--resume train.max_steps=2000`: argparse took the override as the optional path
        args.overrides.insert(0, args.resume)
        args.resume = "auto"

    from dit.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
        resume = cfg.output_dir if args.resume == "auto" else args.resume
        if cfg.parallel.mode == "none":
            from dit.trainer import Trainer

            Trainer(cfg, resume=resume).train()
        else:
            from dynamic_cp.runtime.launch import run_distributed

            run_distributed(cfg, resume=resume)
    except ValueError as err:  # a user's mistake: one line that names it and the fix
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
