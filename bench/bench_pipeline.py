"""Pipeline stages on CPU gloo ranks: PP 2 x 1 against one process, and Dynamic-CP against static CP 2
under PP 2 x 2 (4 ranks).

    PYTHONPATH=$PWD python bench/bench_pipeline.py --steps 4

Both parts train the tiny VideoDiT (configs/tiny.yaml, its 4 blocks: 2 a stage) on mixed clips
(1, 5 and 9 frames at 16x16 to 24x16; with ``cap_tokens=480`` the 9-frame clips, 576 and 864 tokens, need CP 2) through the
real runtime. Part 1: the single-process trainer's steps, then PP 2 x 1's on the same global batches,
then the single process again (its median over both runs; the load of the machine is printed
before and after). Part 2: in one 4-rank spawn, a dynamic and a static (CP 2) trainer under PP 2 x 2,
their steps alternating, so both see the same load; the ratio is of median step times (train_step,
data excluded). A benchmark, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dit.batching import GlobalBatchSampler  # noqa: E402
from dit.config import load_config  # noqa: E402
from dit.trainer import Trainer  # noqa: E402
from dynamic_cp.runtime.launch import trainer_class  # noqa: E402
from dynamic_cp.runtime.testing import run_gloo  # noqa: E402

CONFIG = ROOT / "configs" / "tiny.yaml"
ITEMS = {
    "data.num_clips": 256,
    "data.num_val_clips": 1,
    "data.frame_counts": "[1, 5, 9]",
    "data.resolutions": "[[16, 16], [24, 16]]",
    "train.global_batch_size": 8,
    "train.warmup_steps": 1,
    "train.val_every": 1000,
    "parallel.cap_tokens": 480,  # the 9-frame clips (576 and 864 tokens) need CP 2
    "parallel.plan_ahead": False,
    "parallel.hardware": "h100",
    "parallel.learn_costs": False,
}


def _cfg(out: str, **extra):
    return load_config(CONFIG, [f"{k}={v}" for k, v in {"output_dir": out, **ITEMS, **extra}.items()])


def one_process(out: str, steps: int) -> list[float]:
    torch.set_num_threads(1)  # as each gloo rank runs
    trainer = Trainer(_cfg(out, **{"parallel.mode": "none"}), device=torch.device("cpu"))
    sampler = GlobalBatchSampler(
        trainer.train_indices, trainer.cfg.train.global_batch_size, trainer.cfg.data.seed
    )
    times = []
    for s in range(steps + 1):  # step 0 warms up
        clips = trainer.prepare([trainer.train_set[i] for i in sampler.batch(s)], s)
        t0 = time.perf_counter()
        trainer.train_step(clips)
        times.append(time.perf_counter() - t0)
    return times[1:]


def pipelined(rank: int, world_size: int, out: str, steps: int, modes: list[dict]) -> dict:
    trainers, iters, times = [], [], []
    for k, items in enumerate(modes):
        cfg = _cfg(f"{out}/{k}", **items)
        trainers.append(trainer_class(cfg, dist.group.WORLD)(cfg, dist.group.WORLD))
        iters.append(trainers[-1].data_iterator())
        times.append([])
    for _ in range(steps + 1):  # alternate the modes step by step; step 0 warms up
        for trainer, batches, seconds in zip(trainers, iters, times):
            batch = next(batches)
            dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step(batch)
            dist.barrier()  # the step ends when the slowest stage does
            seconds.append(time.perf_counter() - t0)
            trainer.step += 1
    for batches in iters:
        batches.close()
    return {"times": [t[1:] for t in times]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        one = one_process(f"{tmp}/one", args.steps)
        pp1 = {
            "parallel.pp_size": 2,
            "parallel.mode": "dynamic",
            "parallel.cap_tokens": 1200,
        }  # R=1: one rank a clip
        pp2 = run_gloo(pipelined, 2, f"{tmp}/pp2", args.steps, [pp1], timeout_s=600)
        one += one_process(f"{tmp}/one_again", args.steps)
        t_one, t_pp = statistics.median(one), statistics.median(pp2[0]["times"][0])
        print(f"PP 2 x 1 (2 ranks): {t_pp:.3f} s a step; one process {t_one:.3f} s: {t_one / t_pp:.2f}x")
        modes = [
            {"parallel.pp_size": 2, "parallel.mode": "dynamic"},
            {"parallel.pp_size": 2, "parallel.mode": "static", "parallel.static_cp_size": 2},
        ]
        res = run_gloo(pipelined, 4, f"{tmp}/pp2x2", args.steps, modes, timeout_s=600)
        t_dyn, t_static = (statistics.median(t) for t in res[0]["times"])
        print(
            f"PP 2 x 2 (4 ranks): dynamic {t_dyn:.3f} s, static CP 2 {t_static:.3f} s a step: "
            f"dynamic {t_static / t_dyn:.2f}x static"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
