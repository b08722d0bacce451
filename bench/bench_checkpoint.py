"""How long checkpoint saves stall training: synchronous against ``train.async_checkpoint``.

    PYTHONPATH=$PWD python bench/bench_checkpoint.py                # 82M parameters: 329 MB of weights
    PYTHONPATH=$PWD python bench/bench_checkpoint.py --steps 8
    PYTHONPATH=$PWD python bench/bench_checkpoint.py --steps 9 --every 3   # saves 3 steps apart

Two short runs of ``Trainer`` in this process, the same model and data, a checkpoint after every
step (weights and EMA as safetensors, AdamW's moments in trainer.pt: 4 x the weights):

- sync: training waits in ``Trainer.save`` until the checkpoint is on disk;
- async: training waits in ``Trainer.save`` (references and RNG states only) and, at the next
  optimizer step, in ``wait_staged`` until the background thread has copied the state to CPU
  buffers; the thread writes while training goes on. The wait for the last write at the end of the
  run is reported apart (it stalls no step).

Reported: seconds a save stalls training (median over the saves), the ratio sync / async, the
steps' own seconds for scale, and the host memory async adds: the staged copy (bytes of every
tensor saved), held from the first save to the end of the run. Both runs share this machine's
load, so only the ratio of one invocation means anything. A benchmark, not a test: nothing here
asserts a timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dit.config import load_config  # noqa: E402
from dit.trainer import Trainer  # noqa: E402

# 12 blocks of 640 wide (10 heads x 64), FFN 2560: 82M parameters, 329 MB of fp32 weights
MODEL = "{num_layers: 12, num_attention_heads: 10, attention_head_dim: 64, ffn_dim: 2560}"


def timed(obj, name: str, seconds: list[float]) -> None:
    """Record the seconds of every call of ``obj.name`` into ``seconds``."""
    method = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def run(out: Path, steps: int, async_save: bool, every: int = 1) -> dict:
    overrides = [
        f"output_dir={out}", f"model.overrides={MODEL}", "data.num_clips=32", "data.num_val_clips=1",
        "data.frame_counts=[1]", "data.resolutions=[[16, 16]]", "train.global_batch_size=2",
        f"train.max_steps={steps}", f"train.checkpoint_every={every}", "train.keep_checkpoints=2",
        "train.val_every=1000", "train.log_every=1", "train.warmup_steps=1", "flow.val_sigmas=[0.5]",
        f"train.async_checkpoint={str(async_save).lower()}",
    ]  # fmt: skip
    trainer = Trainer(load_config(str(ROOT / "configs" / "tiny.yaml"), overrides), device=torch.device("cpu"))
    save_s, staged_s, step_s, end_s = [], [], [], []
    timed(trainer, "save", save_s)
    timed(trainer, "run_step", step_s)
    if async_save:
        timed(trainer._background, "wait_staged", staged_s)
        timed(trainer._background, "wait", end_s)
    trainer.train()
    # the saves of steps K, 2K, ... before the last step: each stalls in save() and, with async, at
    # the next optimizer step (wait_staged runs at every step: entry s is step s + 1's)
    saves = steps // every - 1
    after = [(j + 1) * every for j in range(saves)]  # index of the step after save j in staged_s
    stalls = [save_s[j] + (staged_s[after[j]] if async_save else 0.0) for j in range(saves)]
    return {
        "stall": stalls,
        "in_save": save_s[:saves],
        "in_wait_staged": [staged_s[i] for i in after] if async_save else [0.0] * saves,
        "step": step_s,
        "end": end_s[-1] if end_s else 0.0,
        "staged": trainer._background.staged_bytes if async_save else 0,
        "weights": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps of each run")
    parser.add_argument(
        "--every", type=int, default=1, help="a checkpoint every K steps (train.checkpoint_every)"
    )
    args = parser.parse_args()
    if args.steps % args.every or args.steps // args.every < 2:
        parser.error(
            f"--steps {args.steps} must be a multiple of --every {args.every}, with at least 2 saves"
        )
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(Path(tmp) / "sync", args.steps, async_save=False, every=args.every)
        asyn = run(Path(tmp) / "async", args.steps, async_save=True, every=args.every)
    weights = sync["weights"]
    print(f"model: {weights / 4e6:.1f}M parameters, {weights / 1e6:.0f} MB of weights; "
          f"{args.steps} steps, a checkpoint every {args.every}")  # fmt: skip
    print(f"{'':30s}{'median s':>9s}   per save (s)")
    for name, r in (("sync: a save stalls training", sync), ("async: a save stalls training", asyn)):
        print(f"{name:30s}{statistics.median(r['stall']):9.3f}   {', '.join(f'{x:.3f}' for x in r['stall'])}")
    for name in ("in_save", "in_wait_staged"):
        print(f"{'  async, of which ' + name:30s}{statistics.median(asyn[name]):9.3f}   "
              f"{', '.join(f'{x:.3f}' for x in asyn[name])}")  # fmt: skip
    print(f"{'a step (forward, backward, AdamW)':30s}{statistics.median(sync['step']):9.3f}")
    ratio = statistics.median(sync["stall"]) / max(statistics.median(asyn["stall"]), 1e-9)
    print(f"async stalls training {ratio:.1f}x less than sync; its last write took {asyn['end']:.3f} s more "
          "at the end of the run")  # fmt: skip
    print(f"extra host memory of async: {asyn['staged'] / 1e6:.0f} MB staged ({asyn['staged'] / weights:.1f}x "
          "the weights), held from the first save on")  # fmt: skip


if __name__ == "__main__":
    main()
