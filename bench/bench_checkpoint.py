"""How long a checkpoint save blocks training: synchronous against ``train.async_checkpoint``.

    PYTHONPATH=$PWD python bench/bench_checkpoint.py               # 79M parameters: 316 MB of weights
    PYTHONPATH=$PWD python bench/bench_checkpoint.py --repeats 5

The checkpoint is what ``Trainer.save`` writes for a replicated run: weights and EMA weights
(safetensors) and trainer.pt with AdamW's two moments, i.e. 4 x the weights. Synchronous: training
waits for ``save_checkpoint`` to return. Async: training waits only for ``BackgroundCheckpointer.save``
to stage the state in CPU memory and start its writer thread; the write itself is timed too (until
``wait`` returns) to show it is the same work moved out of the way. The first async save, which
allocates the staging buffers, is reported apart. The two kinds alternate, and
the medians of ``--repeats`` saves of each are compared in this one process. Extra host memory of
async: the staged copy (bytes of every tensor saved) and the resident-set growth while it is held.
A benchmark, not a test: nothing here asserts a timing.
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

from dit.async_checkpoint import BackgroundCheckpointer  # noqa: E402
from dit.checkpoint import nbytes, save_checkpoint  # noqa: E402
from dit.ema import EMA  # noqa: E402
from dit.model import VideoDiT  # noqa: E402
from dit.sizes import model_kwargs  # noqa: E402

# 12 blocks of 640 wide (10 heads x 64), FFN 2560: 79M parameters, 316 MB of fp32 weights
WIDTHS = {"num_layers": 12, "num_attention_heads": 10, "attention_head_dim": 64, "ffn_dim": 2560}


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind (median)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = VideoDiT(**model_kwargs("tiny", WIDTHS))
    ema = EMA(model, 0.99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step, so that AdamW holds its two moments
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = {"optimizer": optimizer.state_dict(), "lr_schedule": {}, "bad_steps": 0}
    weights = nbytes(model)
    total = weights + nbytes(ema.model) + nbytes(state)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{weights / 1e6:.0f} MB of weights; a checkpoint holds {total / 1e6:.0f} MB of tensors")  # fmt: skip

    sync_s, async_block_s, async_write_s, staged = [], [], [], 0
    writer = BackgroundCheckpointer()
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        root = Path(tmp) / "checkpoints"
        # the first async save allocates its staging buffers (fresh pages); later ones copy into them
        before = rss_bytes()
        t0 = time.perf_counter()
        writer.save(root, 0, model, ema.model, state, {}, keep=2)
        first_block = time.perf_counter() - t0
        rss_growth = rss_bytes() - before
        writer.wait()
        for i in range(args.repeats):
            t0 = time.perf_counter()
            save_checkpoint(root, 2 * i + 1, model, ema.model, state, {}, keep=2)
            sync_s.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            writer.save(root, 2 * i + 2, model, ema.model, state, {}, keep=2)
            async_block_s.append(time.perf_counter() - t0)
            staged = writer.staged_bytes
            writer.wait()
            async_write_s.append(time.perf_counter() - t0)

    sync, block, write = (statistics.median(x) for x in (sync_s, async_block_s, async_write_s))
    print(f"{'':28s}{'median s':>10s}   all (s)")
    print(f"{'sync save (blocks)':28s}{sync:10.3f}   {', '.join(f'{x:.3f}' for x in sync_s)}")
    print(f"{'async: blocks training':28s}{block:10.3f}   {', '.join(f'{x:.3f}' for x in async_block_s)}")
    print(f"{'async: until on disk':28s}{write:10.3f}   {', '.join(f'{x:.3f}' for x in async_write_s)}")
    print(f"{'async: first save (allocates)':28s}{first_block:10.3f}")
    print(f"async blocks {sync / block:.1f}x less than sync (after the first save)")
    print(f"extra host memory of async: {staged / 1e6:.0f} MB staged ({staged / weights:.1f}x the weights); "
          f"resident set grew by {rss_growth / 1e6:.0f} MB at the first save, and stays so (buffers are reused)")  # fmt: skip


if __name__ == "__main__":
    main()
