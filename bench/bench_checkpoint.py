"""How long checkpoint saves stall training: synchronous against ``train.async_checkpoint``.

    PYTHONPATH=$PWD python bench/bench_checkpoint.py                # 82M parameters: 329 MB of weights
    PYTHONPATH=$PWD python bench/bench_checkpoint.py --steps 8
    PYTHONPATH=$PWD python bench/bench_checkpoint.py --steps 9 --every 3   # saves 3 steps apart
    PYTHONPATH=$PWD python bench/bench_checkpoint.py --fsdp --steps 15 --every 3  # FSDP, 2 gloo ranks

Two short runs of ``Trainer`` in this process, the same model and data, a checkpoint after every
step (weights and EMA as safetensors, AdamW's moments in trainer.pt: 4 x the weights):

- sync: training waits in ``Trainer.save`` until the checkpoint is on disk;
- async: training waits in ``Trainer.save`` (references and RNG states only) and, at the next
  optimizer step, in ``wait_staged`` until the background thread has copied the state to CPU
  buffers; the thread writes while training goes on. The wait for the last write at the end of the
  run is reported apart (it stalls no step).

With ``--fsdp``: the same model under ``parallel.fsdp=per_layer`` on 2 gloo ranks (processes of
this machine), sync DCP saves (``dcp.save``, then rank 0 gathers the full weights and writes the
export) against ``AsyncFSDPCheckpointer`` (DCP's ``async_save``: shards staged to CPU, written by
DCP's thread; rank 0's export written by a second thread). A save stalls training in ``save``
(staging, the full-weight gather, and the wait for the previous save if still in flight) and in the
per-step ``check`` (a two-value all-reduce while a save is pending). Per save, the slower rank's
stall is reported. Extra host memory: the staged copy of each rank's shards (model, AdamW moments,
EMA), held until DCP's thread has written them, and the peak RSS of each rank in both runs.

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


def _overrides(out: Path, steps: int, async_save: bool, every: int) -> list[str]:
    return [
        f"output_dir={out}", f"model.overrides={MODEL}", "data.num_clips=32", "data.num_val_clips=1",
        "data.frame_counts=[1]", "data.resolutions=[[16, 16]]", "train.global_batch_size=2",
        f"train.max_steps={steps}", f"train.checkpoint_every={every}", "train.keep_checkpoints=2",
        "train.val_every=1000", "train.log_every=1", "train.warmup_steps=1", "flow.val_sigmas=[0.5]",
        f"train.async_checkpoint={str(async_save).lower()}",
    ]  # fmt: skip


def run(out: Path, steps: int, async_save: bool, every: int = 1) -> dict:
    overrides = _overrides(out, steps, async_save, every)
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


# ----------------------------------------------------------------------------- FSDP: 2 gloo ranks


def _local_bytes(state) -> int:
    """Bytes this rank holds of a (sharded) state dict: DTensors count their local shard."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_local_bytes(v) for v in state)
    return 0


def fsdp_worker(rank: int, world_size: int, out: str, steps: int, async_save: bool, every: int) -> dict:
    """One FSDP per_layer run on this rank; -> its seconds in save, check and run_step, and memory."""
    import resource

    import torch.distributed as dist

    from dynamic_cp.runtime.fsdp_checkpoint import _sharded_state
    from dynamic_cp.runtime.launch import resolve_auto_fsdp, trainer_class

    overrides = [
        *_overrides(Path(out), steps, async_save, every), "parallel.mode=dynamic", "parallel.fsdp=per_layer",
        "parallel.hardware=h100", "parallel.learn_costs=false",
    ]  # fmt: skip
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), overrides)
    world = dist.group.WORLD
    cfg = resolve_auto_fsdp(cfg, world, None, None)
    trainer = trainer_class(cfg, world)(cfg, world)
    save_s, check_s, step_s, end_s = [], [], [], []
    if async_save:
        # the training loop's check() before each step, not the one save() and wait() make inside
        writer, loop_check = trainer._background, trainer._background.check
        timed(writer, "wait", end_s)
        inner = writer.wait

        def check() -> None:
            t0 = time.perf_counter()
            loop_check()
            check_s.append(time.perf_counter() - t0)

        def wait() -> None:
            writer.check = loop_check
            try:
                inner()
            finally:
                writer.check = check

        writer.check, writer.wait = check, wait
    timed(trainer, "save", save_s)
    timed(trainer, "run_step", step_s)
    trainer.train()
    staged = _local_bytes(_sharded_state(trainer.model, trainer.optimizer, trainer.ema))
    return {
        "save": save_s,
        "check": check_s,
        "step": step_s,
        "end": end_s[-1] if end_s else 0.0,
        "staged": staged if async_save else 0,
        "weights": sum(_local_bytes(p) for p in trainer.model.parameters()),
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


def run_fsdp(out: Path, steps: int, async_save: bool, every: int) -> dict:
    """Both ranks' figures, merged: per save the slower rank's stall."""
    from dynamic_cp.runtime.testing import run_gloo

    ranks = run_gloo(fsdp_worker, 2, str(out), steps, async_save, every, timeout_s=1800)
    saves = steps // every - 1

    def stall(r: dict, j: int) -> float:
        # check() runs before every step (entry i before step i + 1): save j (after step (j+1)K) is
        # checked before steps (j+1)K + 1 ... (j+2)K, then waited for in save j + 1
        checks = r["check"][(j + 1) * every : (j + 2) * every] if r["check"] else []
        return r["save"][j] + sum(checks)

    return {
        "stall": [max(stall(r, j) for r in ranks) for j in range(saves)],
        "in_save": [max(r["save"][j] for r in ranks) for j in range(saves)],
        "step": [max(x) for x in zip(*(r["step"] for r in ranks))],
        "end": max(r["end"] for r in ranks),
        "staged": [r["staged"] for r in ranks],
        "weights": sum(r["weights"] for r in ranks),
        "max_rss": [r["max_rss"] for r in ranks],
    }


def _row(label: str, seconds: list[float], width: int) -> None:
    """One line of the report: the label, the median, then every save's seconds."""
    print(f"{label:{width}s}{statistics.median(seconds):9.3f}   {', '.join(f'{x:.3f}' for x in seconds)}")


def main_fsdp(steps: int, every: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sync = run_fsdp(Path(tmp) / "sync", steps, False, every)
        asyn = run_fsdp(Path(tmp) / "async", steps, True, every)
    weights = sync["weights"]
    print(f"model: {weights / 4e6:.1f}M parameters, {weights / 1e6:.0f} MB of weights, FSDP per_layer on "
          f"2 gloo ranks; {steps} steps, a checkpoint every {every}")  # fmt: skip
    print(f"{'':34s}{'median s':>9s}   per save (s, the slower rank)")
    for name, r in (("sync dcp.save: a save stalls", sync), ("async_save: a save stalls", asyn)):
        _row(name, r["stall"], 34)
    _row("  async, of which in save()", asyn["in_save"], 34)
    print(f"{'a step (forward, backward, AdamW)':34s}{statistics.median(sync['step']):9.3f}")
    ratio = statistics.median(sync["stall"]) / max(statistics.median(asyn["stall"]), 1e-9)
    print(f"async stalls training {ratio:.1f}x less than sync; its last write took {asyn['end']:.3f} s more "
          "at the end of the run")  # fmt: skip
    staged = ", ".join(f"rank {i} {b / 1e6:.0f} MB" for i, b in enumerate(asyn["staged"]))
    print(f"extra host memory of async: staged shards {staged} (the shards of model, AdamW moments, EMA)")
    rss = ", ".join(
        f"rank {i} {a / 1e6:.0f} vs {b / 1e6:.0f} MB"
        for i, (a, b) in enumerate(zip(asyn["max_rss"], sync["max_rss"]))
    )
    print(f"peak RSS, async vs sync: {rss}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps of each run")
    parser.add_argument(
        "--every", type=int, default=1, help="a checkpoint every K steps (train.checkpoint_every)"
    )
    parser.add_argument(
        "--fsdp", action="store_true", help="FSDP per_layer on 2 gloo ranks: DCP save vs async_save"
    )
    args = parser.parse_args()
    if args.steps % args.every or args.steps // args.every < 2:
        parser.error(
            f"--steps {args.steps} must be a multiple of --every {args.every}, with at least 2 saves"
        )
    if args.fsdp:
        main_fsdp(args.steps, args.every)
        return
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(Path(tmp) / "sync", args.steps, async_save=False, every=args.every)
        asyn = run(Path(tmp) / "async", args.steps, async_save=True, every=args.every)
    weights = sync["weights"]
    print(f"model: {weights / 4e6:.1f}M parameters, {weights / 1e6:.0f} MB of weights; "
          f"{args.steps} steps, a checkpoint every {args.every}")  # fmt: skip
    print(f"{'':30s}{'median s':>9s}   per save (s)")
    for name, r in (("sync: a save stalls training", sync), ("async: a save stalls training", asyn)):
        _row(name, r["stall"], 30)
    for name in ("in_save", "in_wait_staged"):
        _row("  async, of which " + name, asyn[name], 30)
    print(f"{'a step (forward, backward, AdamW)':30s}{statistics.median(sync['step']):9.3f}")
    ratio = statistics.median(sync["stall"]) / max(statistics.median(asyn["stall"]), 1e-9)
    print(f"async stalls training {ratio:.1f}x less than sync; its last write took {asyn['end']:.3f} s more "
          "at the end of the run")  # fmt: skip
    print(f"extra host memory of async: {asyn['staged'] / 1e6:.0f} MB staged ({asyn['staged'] / weights:.1f}x "
          "the weights), held from the first save on")  # fmt: skip


if __name__ == "__main__":
    main()
