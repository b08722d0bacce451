"""Latent-cache throughput: 2 processes vs 1 on the same clips, and batched vs one-by-one VAE calls.

    python bench/bench_cache.py                  # 24 clips, 33 frames at 128x128, a random small Wan VAE
    python bench/bench_cache.py --clips 48 --repeats 2

Every run is the real command, ``torchrun --nproc_per_node N -m data.cache``, on real H.264 files
(encoded here with imageio-ffmpeg's ffmpeg) with a random AutoencoderKLWan and UMT5 encoder saved to a
temporary folder (no weights are downloaded; the shapes, not the values, set the cost). Seconds are the
encoding phase the command reports (after the models and the dataset are loaded, to the index
written), so process start-up is not counted; one warm-up run goes first, uncounted. N processes
share the machine's cores: torchrun's ranks each take cores / N intra-op threads (init_torchrun), and
one process takes them all, so 2 processes vs 1 is at most 2 x T(1 process) / T(1 process, 1 thread):
the "1 thread" case measures that ceiling. Ratios come from runs in this one invocation. Benchmarks
print; they never assert.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def make_inputs(root: str, num_clips: int, frames: int, size: int) -> list[str]:
    import diffusers
    import torch
    from test_data_cache import save_text_encoder  # the tests' tiny UMT5 and its word-level tokenizer

    from data.media import make_video

    videos = os.path.join(root, "videos")
    os.makedirs(videos)
    first = make_video(os.path.join(videos, "clip000.mp4"), size, size, 24, frames)
    for i in range(num_clips):
        path = os.path.join(videos, f"clip{i:03d}.mp4")
        if i:
            os.link(first, path)  # same content, separate files: decoding costs the same
        with open(os.path.splitext(path)[0] + ".txt", "w") as f:
            f.write("a test pattern at fps")
    torch.manual_seed(0)
    diffusers.AutoencoderKLWan(
        base_dim=32, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1
    ).save_pretrained(os.path.join(root, "vae"))
    save_text_encoder("umt5", os.path.join(root, "text"))
    return ["--source", videos, "--vae", "wan", "--vae-path", os.path.join(root, "vae"),
            "--text-encoder", "umt5", "--text-path", os.path.join(root, "text"), "--max-length", "32",
            "--dtype", "bfloat16", "--shard-size", "4", "--max-frames", str(frames)]  # fmt: skip


def run(argv: list[str], out: str, nproc: int, threads: int | None = None) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("OMP_NUM_THREADS", None)  # torchrun would set 1; init_torchrun divides the cores instead
    if threads is not None:  # the reference case: one process held to one thread, as each rank of 2 is
        env["OMP_NUM_THREADS"] = str(threads)
    result = subprocess.run(
        cmd + ["-m", "data.cache", *argv, "--out", out], capture_output=True, text=True, env=env
    )
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return float(re.search(r"in ([0-9.]+) s", result.stdout).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=24)
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each case; the median is shown")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        argv = make_inputs(tmp, args.clips, args.frames, args.size)
        cores = os.cpu_count()
        cases = [("1 process, --vae-batch 1", 1, 1, None), ("2 processes, --vae-batch 1", 2, 1, None),
                 ("1 process, --vae-batch 4", 1, 4, None), ("1 process, 1 thread, batch 1", 1, 1, 1),
                 ("2 processes, --vae-batch 4", 2, 4, None)]  # fmt: skip
        seconds = {name: [] for name, *_ in cases}
        run(argv, os.path.join(tmp, "warm-up"), 1)  # the first run pays cold file and library caches
        for r in range(args.repeats):
            for k, (name, nproc, batch, threads) in enumerate(cases):
                out = os.path.join(tmp, f"cache{r}_{k}")
                seconds[name].append(run(argv + ["--vae-batch", str(batch)], out, nproc, threads))
        print(f"{args.clips} clips of {args.frames} frames at {args.size}x{args.size} (H.264), random Wan VAE "
              f"(base_dim 32, z_dim 16), {os.cpu_count()} cores, median of {args.repeats}")  # fmt: skip
        print("case                         encode s  clips/s")
        med = {name: statistics.median(v) for name, v in seconds.items()}
        for name, s in med.items():
            print(f"{name:28s} {s:8.2f} {args.clips / s:8.2f}")
        base = med["1 process, --vae-batch 1"]
        two, one_thread = med["2 processes, --vae-batch 1"], med["1 process, 1 thread, batch 1"]
        print(f"2 processes vs 1: {base / two:.2f}x; VAE batches of 4 vs one by one: "
              f"{base / med['1 process, --vae-batch 4']:.2f}x; with batches of 4: "
              f"{med['1 process, --vae-batch 4'] / med['2 processes, --vae-batch 4']:.2f}x")  # fmt: skip
        # One process runs torch's kernels on every core (intra-op threads); each of 2 ranks on one.
        # Two ranks at best halve the one-thread time, so 2 processes vs 1 cannot pass this ceiling.
        print(f"1 process, {cores} threads vs 1 thread: {one_thread / base:.2f}x; 2 processes vs 1 process "
              f"of 1 thread: {one_thread / two:.2f}x (ideal 2); ceiling of 2 processes vs 1: "
              f"2 x {base:.2f} / {one_thread:.2f} = {2 * base / one_thread:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
