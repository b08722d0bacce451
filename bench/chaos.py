"""Chaos run: torchrun restarts a job whose ranks are SIGKILLed every K seconds; does it end right?

    PYTHONPATH=$PWD python bench/chaos.py                          # 2 ranks, 40 steps, 3 kills, 25 s apart
    PYTHONPATH=$PWD python bench/chaos.py --ranks 4 --kills 5 --every 45

Two runs of the same tiny job (``configs/tiny.yaml`` shrunk, parallel.mode=dynamic, replicated
weights, a checkpoint every ``--checkpoint-every`` steps), both launched as a cluster job would be:

    torchrun --max-restarts=N --nproc_per_node=R train.py ... --resume auto

1. uninterrupted (no kill): the reference;
2. chaos: every ``--every`` seconds after launch, one rank drawn at random (seeded) gets SIGKILL, at
   most ``--kills`` times (at most 5) and only while the job still runs; torchrun has that many
   restarts.

Reported: failures survived (kills the job finished after), steps recomputed (per kill: the last
step rank 0 had logged, minus the step the next attempt resumed from), whether every step appears
once in metrics.jsonl with the reference's loss, and whether the final weights equal the
reference's bitwise. A benchmark, not a test: it prints what happened and exits 1 if the job failed
or the weights differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

sys.path.insert(0, str(ROOT / "tests"))
from conftest import tiny_overrides  # noqa: E402

from dynamic_cp.runtime.testing import torchrun_workers  # noqa: E402

# the tests' tiny job (tests/conftest.py), on the Dynamic-CP runtime with replicated weights
PARALLEL = {
    "train.val_every": 1000,
    "parallel.mode": "dynamic",
    "parallel.fsdp": "none",
    "parallel.hardware": "h100",  # fixed prices, no refit: every attempt plans the same steps
    "parallel.learn_costs": "false",
}


def launch(out: Path, args, restarts: int) -> subprocess.Popen:
    over = tiny_overrides(out.parent, **PARALLEL, **{"output_dir": str(out), "train.max_steps": args.steps,
                          "train.checkpoint_every": args.checkpoint_every})  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
        f"--max-restarts={restarts}", "train.py", "--config", "configs/tiny.yaml",
        *over, "--resume", "auto",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return found


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    step_dir = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    return load_file(step_dir / "model" / "diffusion_pytorch_model.safetensors")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--every", type=float, default=25.0, help="seconds between kills (from launch)")
    parser.add_argument("--kills", type=int, default=3, help="at most 5")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 1 <= args.kills <= 5:
        raise SystemExit("--kills must be 1 to 5")
    import torch

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        whole, chaos = Path(tmp) / "whole", Path(tmp) / "chaos"
        started = time.perf_counter()
        ref = launch(whole, args, restarts=0)
        ref_out, _ = ref.communicate()
        if ref.returncode != 0:
            print(ref_out[-3000:])
            return 1
        ref_s = time.perf_counter() - started

        started = time.perf_counter()
        job = launch(chaos, args, restarts=args.kills)
        kills = []  # (seconds after launch, rank, last step logged)
        while job.poll() is None and len(kills) < args.kills:
            time.sleep(max(0.0, started + args.every * (len(kills) + 1) - time.perf_counter()))
            workers = torchrun_workers(job.pid) if job.poll() is None else {}
            if not workers:
                continue
            rank = rng.choice(sorted(workers))
            last = max((r["step"] for r in rows(chaos) if "loss" in r), default=0)
            try:
                os.kill(workers[rank], signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills.append((time.perf_counter() - started, rank, last))
        out, _ = job.communicate()
        chaos_s = time.perf_counter() - started

        # how each attempt began (rank 0 says it once): resumed at a step, or fresh (step 0)
        starts = re.findall(
            r"resumed from \S+ at step (\d+)|no whole checkpoint in \S+; (starting) fresh", out
        )
        resumed = [int(step) if step else 0 for step, _ in starts][1:]  # [0]: the first launch
        recomputed = [max(0, last - r) for (_, _, last), r in zip(kills, resumed)]
        steps = [r["step"] for r in rows(chaos) if "loss" in r]
        want = {r["step"]: r["loss"] for r in rows(whole) if "loss" in r}
        got = {r["step"]: r["loss"] for r in rows(chaos) if "loss" in r}
        finished = job.returncode == 0
        equal = False
        if finished:
            a, b = final_weights(whole), final_weights(chaos)
            equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    print(f"{args.ranks} ranks, {args.steps} steps, checkpoint every {args.checkpoint_every}, "
          f"SIGKILL every {args.every:g} s (at most {args.kills})")  # fmt: skip
    print(f"uninterrupted run: {ref_s:.0f} s; chaos run: {chaos_s:.0f} s")
    for (at, rank, last), r in zip(kills, resumed + [None] * len(kills)):
        print(f"  kill at {at:5.0f} s: rank {rank} (rank 0 had logged step {last}); next attempt resumed at "
              f"step {r if r is not None else '-'}")  # fmt: skip
    print(
        f"failures survived: {len(kills) if finished else 0} of {len(kills)} (job exit code {job.returncode})"
    )
    print(f"steps recomputed: {sum(recomputed)} ({', '.join(map(str, recomputed)) or 'none'})")
    print(f"each step once in metrics.jsonl: {steps == list(range(1, args.steps + 1))}; "
          f"losses equal to the uninterrupted run's: {got == want}")  # fmt: skip
    print(f"final weights equal to the uninterrupted run's (bitwise): {equal}")
    return 0 if finished and equal else 1


if __name__ == "__main__":
    sys.exit(main())
