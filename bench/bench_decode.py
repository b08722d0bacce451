"""Decode throughput: our reader (data.readers, decord by frame index) against plain PyAV, same files.

    python bench/bench_decode.py                          # defaults below, ~1 minute on 2 CPU cores
    python bench/bench_decode.py --size 640x360 --seconds 8 --repeats 3

Files are encoded first with imageio-ffmpeg's ffmpeg (H.264 mp4 and VP9 webm, moving test pattern).
Readers, each given the same frame indices:
- ours/decord: ``data.readers.read_frames(backend="decord")``, the default where decord is installed;
- ours/pyav:   ``read_frames(backend="pyav")``, our fallback: seeks to the keyframe before the clip;
- ours/tcodec: ``read_frames(backend="torchcodec")`` where torchcodec loads (an optional extra, README),
  else n/a: its exact seek mode scans the file's packets, then decodes from the keyframe before each frame;
- PyAV loop:   open, decode from the start, keep the wanted frames, stop after the last one (the usual
  loop in video training code). Ratios are ours / PyAV loop, from the same run.
Two workloads: clip (what training does: --clip-frames frames at half the source rate from the
middle of the file) and full (every frame, in order). Decoders run with their default threading.

A benchmark, not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import av  # noqa: E402
import numpy as np  # noqa: E402

from data.media import make_video  # noqa: E402
from data.readers import _torchcodec, probe, read_frames  # noqa: E402


def pyav_frames(path: str, indices: list[int]) -> np.ndarray:
    """The plain loop: decode from frame 0, keep the wanted frames, stop after the last one."""
    wanted, last, got = set(indices), max(indices), {}
    with av.open(path) as c:
        for i, frame in enumerate(c.decode(c.streams.video[0])):
            if i in wanted:
                got[i] = frame.to_ndarray(format="rgb24")
            if i >= last:
                break
    return np.stack([got[i] for i in indices])  # (f, h, w, 3), as every reader here returns


def timed(repeats: int, fn, *args) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="320x180", help="WxH of the test files")
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=30.0, help="duration of each file")
    ap.add_argument("--gop", type=int, default=60, help="keyframe interval in frames (web encodes: 1-5 s)")
    ap.add_argument("--clip-frames", type=int, default=33, help="frames per training clip (4k+1)")
    ap.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp folder)")
    args = ap.parse_args()
    w, h = map(int, args.size.split("x"))
    n = int(args.fps * args.seconds)
    folder = args.dir or tempfile.mkdtemp(prefix="bench_decode_")
    print(f"files: {w}x{h}, {n} frames at {args.fps} fps, keyframe every {args.gop} frames, in {folder}")
    print(f"median of {args.repeats} runs; frames per second delivered as RGB arrays")
    cols = ("codec", "workload", "frames", "ours/decord", "ours/pyav", "ours/tcodec", "PyAV loop")
    cols += ("decord x", "pyav x", "tcodec x")
    print("{:<6} {:<8} {:>6} {:>12} {:>10} {:>12} {:>10} {:>9} {:>7} {:>9}".format(*cols))
    has_torchcodec = _torchcodec() is not None
    for ext in (".mp4", ".webm"):
        path = os.path.join(folder, f"bench{ext}")
        if not os.path.exists(path):
            make_video(path, w, h, args.fps, n, gop=args.gop)
        info = probe(path)
        span = 2 * (args.clip_frames - 1)  # half the source rate
        start = (info.num_frames - 1 - span) // 2
        clip = [start + 2 * k for k in range(args.clip_frames)]
        full = list(range(info.num_frames))
        for name, idx in (("clip", clip), ("full", full)):
            fd = len(idx) / timed(args.repeats, read_frames, path, idx, "decord")
            fp = len(idx) / timed(args.repeats, read_frames, path, idx, "pyav")
            ft = (
                len(idx) / timed(args.repeats, read_frames, path, idx, "torchcodec")
                if has_torchcodec
                else None
            )
            fb = len(idx) / timed(args.repeats, pyav_frames, path, idx)
            codec = "H.264" if ext == ".mp4" else "VP9"
            tc, tcx = (f"{ft:>12.0f}", f"{ft / fb:>8.2f}x") if ft else (f"{'n/a':>12}", f"{'n/a':>9}")
            row = f"{codec:<6} {name:<8} {len(idx):>6} {fd:>12.0f} {fp:>10.0f} {tc} {fb:>10.0f}"
            print(f"{row} {fd / fb:>8.2f}x {fp / fb:>6.2f}x {tcx}")


if __name__ == "__main__":
    main()
