"""LoRA against full fine-tuning on the same model and batches (CPU, one run), and whether Wan-14B LoRA
fits one 80 GB GPU.

    PYTHONPATH=$PWD python bench/bench_lora.py [--steps 6] [--rank 16]

Part 1 trains the configs/tiny.yaml model both ways on identical global batches, alternating the two
trainers step by step so machine load hits both alike, and prints trainable parameters, AdamW state
bytes and the median step time, with LoRA / full ratios.

Part 2 is an estimate from parameter counts (exact, from a Wan-14B VideoDiT built on the meta device
with the adapters peft injects) and the cost model's activation bytes per token
(``CostModel.activation_bytes_per_token``): frozen bf16 base 2 bytes/param; adapters fp32 weight,
gradient and two AdamW moments, 16 bytes/param; activations on top. It prints the token cap per GPU
with and without activation checkpointing (0.9 of HBM usable, the cost model's default).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.dim() > 0
    )


def part1(steps: int, rank: int) -> None:
    from dit.batching import GlobalBatchSampler
    from dit.config import load_config
    from dit.trainer import Trainer

    # a random base for both (LoRA on the zero-output seeded init is refused: its adapters get zero
    # gradients); the same parameters and operations, so the figures do not change
    common = ["output_dir=/tmp/bench_lora", "train.ema_decay=0", "data.num_clips=256",
              "model.overrides={adaln_zero_init: false}"]  # fmt: skip
    trainers = {}
    for name, extra in (("full", []), ("lora", [f"model.lora={{rank: {rank}}}"])):
        cfg = load_config(ROOT / "configs" / "tiny.yaml", [*common, *extra])
        trainers[name] = Trainer(cfg, device=torch.device("cpu"))
    cfg = trainers["full"].cfg
    sampler = GlobalBatchSampler(trainers["full"].train_indices, cfg.train.global_batch_size, cfg.data.seed)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for step in range(steps + 1):  # step 0 warms up (allocations, first-call kernels)
        samples = [trainers["full"].train_set[i] for i in sampler.batch(step)]
        for name, trainer in trainers.items():
            clips = trainer.prepare(samples, step)
            t0 = time.perf_counter()
            trainer.train_step(clips)
            if step:
                times[name].append(time.perf_counter() - t0)
    rows = {}
    for name, trainer in trainers.items():
        rows[name] = (
            sum(p.numel() for p in trainer.trainable_parameters()),
            optimizer_state_bytes(trainer.optimizer),
            statistics.median(times[name]),
        )
    total = sum(p.numel() for p in trainers["full"].model.parameters())
    print(f"tiny model ({total:,} parameters), global batch {cfg.train.global_batch_size}, {steps} timed steps, "
          f"LoRA rank {rank} on {trainers['lora'].cfg.model.lora.target_modules}")  # fmt: skip
    print(f"{'':6} {'trainable params':>17} {'AdamW state bytes':>18} {'median step s':>14}")
    for name, (params, state, step_s) in rows.items():
        print(f"{name:6} {params:>17,} {state:>18,} {step_s:>14.3f}")
    (fp, fs, ft), (lp, ls, lt) = rows["full"], rows["lora"]
    print(f"{'ratio':6} {lp / fp:>17.4f} {ls / fs:>18.4f} {lt / ft:>14.2f}   (LoRA / full)")


def part2(rank: int) -> None:
    from accelerate import init_empty_weights

    from dit import lora
    from dit.model import VideoDiT
    from dit.model_config import LoraSettings
    from dit.sizes import model_kwargs
    from dynamic_cp.planning.cost_model import CostModel
    from dynamic_cp.planning.hardware import Hardware
    from dynamic_cp.planning.model_dims import ModelDims

    with init_empty_weights():
        model = VideoDiT(**model_kwargs("wan-14b"))
        base = sum(p.numel() for p in model.parameters())
        lora.freeze_base(model, torch.bfloat16)
        adapters = sum(p.numel() for p in lora.add_lora(model, lora.peft_config(LoraSettings(rank=rank))))
    cfg = model.config
    dims = ModelDims.from_config(cfg)
    hw = Hardware.load("h100")
    cost = CostModel(dims, hw)
    usable = 0.9 * hw.memory_bytes
    states = 2 * base + 16 * adapters
    print(f"\nWan-14B LoRA on one {hw.memory_bytes / 1e9:.0f} GB GPU ({hw.name} profile, 0.9 usable):")
    print(f"  base {base / 1e9:.2f}B params x 2 bytes (frozen bf16)      = {2 * base / 1e9:6.1f} GB")
    print(
        f"  adapters {adapters / 1e6:.1f}M params (rank {rank}) x 16 bytes  = {16 * adapters / 1e9:6.2f} GB"
    )
    print(
        f"  full fine-tuning states, unsharded: 16 bytes x {base / 1e9:.2f}B = {16 * base / 1e9:6.1f} GB (does not fit)"
    )
    for ckpt in (False, True):
        per_token = cost.activation_bytes_per_token(ckpt)
        cap = int((usable - states) // per_token)
        verdict = "fits" if cap > 0 else "does not fit"
        print(f"  activation checkpointing {'on ' if ckpt else 'off'}: {per_token / 1e6:.2f} MB/token -> "
              f"{verdict}, token cap {cap:,} per micro-batch (a 480p 81-frame clip is 32,760)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    part1(args.steps, args.rank)
    part2(args.rank)


if __name__ == "__main__":
    main()
