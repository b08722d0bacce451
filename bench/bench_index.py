"""Time to first plan and resident memory of one rank on a 1,000,000-clip latent cache: old index vs new.

    python bench/bench_index.py                    # 1,000,000 samples
    python bench/bench_index.py --samples 100000

Writes one synthetic cache index in each format (no shards: planning reads only the index), then, per
format, a fresh process does what a training rank does before its first step: open the cache
(``build_dataset``), draw step 0's global batch (``GlobalBatchSampler`` over every clip), read the
token counts of that batch from metadata, plan it (``dynamic_cp.planning.planner.plan``), and read its
own share of index rows. It reports the seconds that took and the process's peak resident memory,
with and without what the imports (torch, the project) hold before the index is touched.

old = version 1 (every sample a dict in index.json); new = version 2 (columns in samples.safetensors).

    python bench/bench_index.py --manifest                          # a 1,000,000-row manifest.csv (and .jsonl, .parquet)
    python bench/bench_index.py --manifest --old-tree /tmp/old      # and the same with another checkout
    python bench/bench_index.py --manifest --old-tree /tmp/old --repeats 3   # median of 3 interleaved rounds

``--manifest`` does the same from a CSV manifest, and the same rows as JSONL and Parquet, with metadata (what ``python -m data.scan`` writes)
instead of a cache: the rank builds the pixel dataset (the clip policy of a Wan fine-tune: 16 fps, 81
frames, 256x256 area), plans, and reads its own rows' paths. The rows name 100 empty files (a rank
checks that each listed file exists; the files are never opened). ``--old-tree`` runs the same rank
with another source tree first on PYTHONPATH (``git archive COMMIT | tar -x -C /tmp/old``): before the
columnar manifest table every rank held a ``Row`` and a ``ClipMeta`` per row.
Benchmarks print; they never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("BENCH_INDEX_TREE", ROOT))  # --old-tree: the child imports that tree

from data.cache_dataset import FORMAT, INDEX  # noqa: E402
from data.cache_index import SAMPLES, SHARD, save_columns, strings  # noqa: E402

HEADER = {
    "format": FORMAT,
    "vae": {"kind": "wan", "stride": [4, 8, 8]},
    "latent_channels": 16,
    "text_dim": 4096,
    "dtype": "bfloat16",
    "policy": None,
    "failed": {},
    "skipped": {},
}


def synthetic(n: int, seed: int = 0):
    """Shapes of a long-tailed video set (Open-Sora-like 4k+1 frame buckets, two resolutions)."""
    rng = np.random.default_rng(seed)
    frames = 1 + 4 * rng.choice([0, 4, 8, 16, 20, 32], size=n, p=[0.2, 0.2, 0.25, 0.2, 0.1, 0.05])
    size = rng.choice([256, 480], size=n, p=[0.6, 0.4])
    meta = np.stack([frames, size, size * 16 // 9 // 16 * 16], axis=1).astype(np.int32)  # (n, 3)
    latent = np.stack([np.full(n, 16), 1 + (frames - 1) // 4, meta[:, 1] // 8, meta[:, 2] // 8], 1)
    captions = [f"clip {i}: a person walks a dog along a beach at sunset, camera pans left" for i in range(n)]
    sources = [f"/data/videos/part-{i // 10000:04d}/clip-{i:08d}.mp4" for i in range(n)]
    return meta, latent.astype(np.int32), captions, sources


def write_old(root: str, n: int) -> None:
    meta, latent, captions, sources = synthetic(n)
    with open(os.path.join(root, INDEX), "w", encoding="utf-8") as f:
        head = json.dumps({**HEADER, "version": 1, "num_samples": n})
        f.write(head[:-1] + ', "samples": [\n')  # streamed: the writer never holds a million dicts
        for i in range(n):
            row = {"key": str(i), "meta": meta[i].tolist(), "latent_shape": latent[i].tolist(),
                   "caption": captions[i], "source": sources[i], "shard": SHARD.format(i // 256),
                   "text_len": 20}  # fmt: skip
            f.write((",\n" if i else "") + json.dumps(row))
        f.write("\n]}\n")


def write_new(root: str, n: int) -> None:
    meta, latent, captions, sources = synthetic(n)
    arrays = {"meta": meta, "latent_shape": latent, "text_len": np.full(n, 20, dtype=np.int32),
              "key": np.arange(n, dtype=np.int64), "chunk": (np.arange(n) // 256).astype(np.int32)}  # fmt: skip
    for name, values in (("caption", captions), ("source", sources)):
        arrays[f"{name}_bytes"], arrays[f"{name}_offsets"] = strings(values)
    save_columns(os.path.join(root, SAMPLES), arrays)
    with open(os.path.join(root, INDEX), "w", encoding="utf-8") as f:
        json.dump({**HEADER, "version": 2, "num_samples": n}, f)


def write_manifest(root: str, n: int, seed: int = 0) -> str:
    """A scanned manifest of n rows: source lengths 2-40 s, three sizes, four frame rates."""
    rng = np.random.default_rng(seed)
    fps = rng.choice([24.0, 25.0, 29.97, 30.0], size=n)
    frames = (rng.uniform(2, 40, size=n) * fps).astype(int)
    sizes = np.array([[480, 854], [720, 1280], [1080, 1920]])[rng.choice(3, size=n, p=[0.3, 0.5, 0.2])]
    os.makedirs(os.path.join(root, "clips"))
    for k in range(100):
        open(os.path.join(root, "clips", f"clip-{k:03d}.mp4"), "wb").close()
    path = os.path.join(root, "manifest.csv")
    with open(path, "w", encoding="utf-8") as f:
        f.write("path,text,num_frames,height,width,fps\n")
        for i in range(n):
            f.write(f'clips/clip-{i % 100:03d}.mp4,"clip {i}: a person walks a dog along a beach at sunset, '
                    f'camera pans left",{frames[i]},{sizes[i, 0]},{sizes[i, 1]},{fps[i]}\n')  # fmt: skip
    return path


def write_jsonl(csv_path: str) -> str:
    """The same rows as JSONL (numbers as JSON numbers)."""
    import csv

    path = csv_path[: -len(".csv")] + ".jsonl"
    with open(csv_path, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        for r in csv.DictReader(f):
            rec = {"path": r["path"], "text": r["text"], "num_frames": int(r["num_frames"]),
                   "height": int(r["height"]), "width": int(r["width"]), "fps": float(r["fps"])}  # fmt: skip
            out.write(json.dumps(rec) + "\n")
    return path


def rss_mb() -> float:
    """Peak resident memory of this process so far (Linux VmHWM: unlike ru_maxrss, it does not carry
    over the parent's peak through fork + exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024  # KiB


def child(root: str, ranks: int, clips_per_rank: int) -> None:
    """One rank's start-up; prints a JSON line."""
    import torch

    from data.build import build_dataset
    from data.tokens import num_tokens
    from dit.batching import GlobalBatchSampler
    from dynamic_cp.planning.cost_model import CostModel
    from dynamic_cp.planning.planner import plan

    torch.manual_seed(0)
    cm = CostModel.from_name("wan-1.3b", "h100")
    imports = rss_mb()
    t0 = time.perf_counter()
    manifest = root.endswith((".csv", ".jsonl", ".parquet"))
    if manifest:
        ds = build_dataset(root, fps=16, max_frames=81, resolution=256, progress=False)
    else:
        ds = build_dataset(root)
    batch = GlobalBatchSampler(range(len(ds)), ranks * clips_per_rank, seed=0).batch(0)
    lengths = [
        num_tokens(*vars(ds.meta(i)).values(), ds.vae_stride) for i in batch
    ]  # all-gathered in training
    p = plan(lengths, ranks, cm.token_cap(shard_world=ranks), cm)
    if manifest:  # rank 0's share: paths and source metadata
        rows = [(ds.path(i), ds.info(i)) for i in batch[:clips_per_rank]]
    else:  # rank 0's share: keys, shards, captions
        rows = [ds.samples[i] for i in batch[:clips_per_rank]]
    seconds = time.perf_counter() - t0
    assert p is not None and len(rows) == clips_per_rank
    print(json.dumps({"seconds": seconds, "rss_mb": rss_mb(), "imports_mb": imports}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=8, help="ranks the plan is made for")
    ap.add_argument("--clips-per-rank", type=int, default=4)
    ap.add_argument("--manifest", action="store_true", help="a CSV manifest instead of a cache index")
    ap.add_argument("--old-tree", help="with --manifest: also run the rank with this source tree")
    ap.add_argument("--repeats", type=int, default=1, help="with --manifest: rounds over the trees (median)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.ranks, args.clips_per_rank)
    if args.manifest:
        return manifest_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name, write in (("old", write_old), ("new", write_new)):
            root = os.path.join(tmp, name)
            os.makedirs(root)
            write(root, args.samples)
            size = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root)) / 2**20
            cmd = [sys.executable, __file__, "--child", root, "--ranks", str(args.ranks)]
            cmd += ["--clips-per-rank", str(args.clips_per_rank)]
            env = {**os.environ, "PYTHONPATH": ROOT}
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
            results[name] = {**json.loads(out.strip().splitlines()[-1]), "size_mb": size}
    print(f"{args.samples:,} samples; one rank's start-up to its first plan ({args.ranks} ranks x "
          f"{args.clips_per_rank} clips), fresh process per format")  # fmt: skip
    print("index  on disk MB  first plan s  peak RSS MB  RSS over imports MB")
    for name, r in results.items():
        print(f"{name:5s}  {r['size_mb']:10.0f}  {r['seconds']:12.2f}  {r['rss_mb']:11.0f}  "
              f"{r['rss_mb'] - r['imports_mb']:19.0f}")  # fmt: skip
    old, new = results["old"], results["new"]
    print(
        f"old / new: {old['seconds'] / new['seconds']:.1f}x time, {old['rss_mb'] / new['rss_mb']:.1f}x peak RSS"
    )


def run_child(root: str, args, tree: str = ROOT) -> dict:
    cmd = [sys.executable, __file__, "--child", root, "--ranks", str(args.ranks)]
    cmd += ["--clips-per-rank", str(args.clips_per_rank)]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "BENCH_INDEX_TREE": os.path.abspath(tree)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def manifest_main(args) -> None:
    trees = ([("old", args.old_tree)] if args.old_tree else []) + [("new", ROOT)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_manifest(tmp, args.samples)
        size = os.path.getsize(path) / 2**20
        sources = [("csv", path), ("jsonl", write_jsonl(path))]
        try:  # the same rows as Parquet (the [parquet] extra), row groups of 64k rows
            import pyarrow.csv
            import pyarrow.parquet as pq
        except ImportError:
            print("pyarrow is not installed: no Parquet row (pip install 'dynamic-cp-video[parquet]')")
        else:
            parquet = os.path.join(tmp, "manifest.parquet")
            pq.write_table(pyarrow.csv.read_csv(path), parquet, row_group_size=65536)
            sources.append(("parquet", parquet))
        runs = {}  # rounds interleave the trees, so a change of load hits old and new alike
        for _ in range(args.repeats):
            for tree, root in trees:
                for kind, source in sources:
                    runs.setdefault((tree, kind), []).append(run_child(source, args, root))
        results = {key: sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2] for key, rs in runs.items()}
    print(f"{args.samples:,}-row manifest.csv ({size:.0f} MB; as Parquet: row groups of 65,536); one rank's "
          f"start-up to its first plan ({args.ranks} ranks x {args.clips_per_rank} clips), fresh process each, "
          f"median of {args.repeats}")  # fmt: skip
    print("tree  manifest  first plan s  peak RSS MB  RSS over imports MB")
    for (tree, kind), r in results.items():
        print(
            f"{tree:4s}  {kind:8s}  {r['seconds']:12.2f}  {r['rss_mb']:11.0f}  {r['rss_mb'] - r['imports_mb']:19.0f}"
        )
    for kind, _ in sources if args.old_tree else []:
        old, new = results["old", kind], results["new", kind]
        print(f"{kind}: old / new: {old['seconds'] / new['seconds']:.1f}x time, "
              f"{(old['rss_mb'] - old['imports_mb']) / (new['rss_mb'] - new['imports_mb']):.1f}x RSS over imports")  # fmt: skip


if __name__ == "__main__":
    main()
