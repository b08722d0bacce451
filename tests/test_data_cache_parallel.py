"""A cache built by several gloo processes equals the one-process cache, also after a SIGKILL and --resume.

Real mp4/webm files (imageio-ffmpeg), a small random AutoencoderKLWan and UMT5 encoder saved to local
folders, a manifest with uneven chunks (11 clips in shards of 2: the last chunk holds one clip) and a
file that fails only at load time, so failure lists travel through the shards too.
"""

import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _data_media import CLIPS, make_broken, make_clips
from safetensors import safe_open
from test_data_cache import save_text_encoder, save_vae

from data import cache
from data.build import build_dataset
from data.cache_shards import ProcessGroupWorld
from data.manifest import Row, write_manifest
from data.readers import VideoInfo
from dynamic_cp.runtime.testing import run_gloo

ROOT = Path(__file__).resolve().parents[1]
POLICY = ["--fps", "12", "--max-frames", "9", "--resolution", "32", "--option", "max_failure_share=0.5"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_cache")
    clips = make_clips(str(root / "videos"))
    broken = make_broken(str(root / "videos"), clips[0])
    rows = []
    for rep in range(2):  # every clip twice, with other captions: 10 good clips
        for path, (_, w, h, fps, n) in zip(clips, CLIPS):
            rows.append(Row(path, f"a test pattern {w}x{h} at fps" + " a" * rep, VideoInfo(n, h, w, fps)))
    # trusted metadata, undecodable file: fails at load time, inside a rank's chunk
    garbage = next(p for p in broken if p.endswith("garbage.webm"))
    rows.insert(5, Row(garbage, "a test", VideoInfo(30, 32, 48, 24)))
    rows.append(Row(str(root / "videos" / "gone.mp4"), "a", VideoInfo(30, 32, 48, 24)))  # missing at build
    write_manifest(rows, str(root / "manifest.csv"))
    vae = save_vae("wan", str(root / "vae"))
    text = save_text_encoder("umt5", str(root / "text"))
    base = ["--source", str(root / "manifest.csv"), "--vae", "wan", "--vae-path", vae, "--text-encoder"]
    base += ["umt5", "--text-path", text, "--max-length", "32", "--dtype", "float32", "--shard-size", "2"]
    return root, base + POLICY + ["--vae-batch", "2"]


def _kill_on_second_shard() -> None:
    """SIGKILL this process once it has encoded its second chunk, just before that shard is written."""
    from data import cache_shards

    write, calls = cache_shards.write_shard, [0]

    def dying(*args, **kw):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(*args, **kw)

    cache_shards.write_shard = dying


def _worker(rank, world_size, argv, kill_rank=None):
    if rank == kill_rank:
        _kill_on_second_shard()
    summary = cache.cache_from_args(cache.parse_args(argv), ProcessGroupWorld(), "cpu")
    return {k: summary[k] for k in ("num_shards", "reused", "encoded")} | {
        "log": summary["failures"].summary()
    }


def _build(argv, world_size, **kw):
    return run_gloo(_worker, world_size, argv, *kw.values(), timeout_s=240)[0]


def _contents(out):
    """Everything a reader sees: the index and settings as JSON, every tensor of every file by name."""
    index = json.load(open(os.path.join(out, "index.json")))
    settings = json.load(open(os.path.join(out, "settings.json")))
    tensors = {}
    for path in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                tensors[(os.path.basename(path), k)] = f.get_tensor(k)
    return index, settings, tensors


def _assert_same_cache(a, b):
    index_a, settings_a, tensors_a = _contents(a)
    index_b, settings_b, tensors_b = _contents(b)
    assert index_a == index_b and settings_a == settings_b  # samples, keys, order, shards, failure lists
    assert tensors_a.keys() == tensors_b.keys()
    for k, t in tensors_a.items():  # bitwise: the same clips in the same VAE batches on every layout
        assert t.dtype == tensors_b[k].dtype and torch.equal(t, tensors_b[k]), k
    assert {t.dtype for (name, _), t in tensors_a.items() if name.startswith("shard")} == {torch.float32}


def test_parallel_cache_equals_one_process_and_resumes_after_sigkill(setup):
    root, argv = setup
    out = lambda name: ["--out", str(root / name)]  # noqa: E731
    one = _build(argv + out("one"), 1)  # one gloo process: the same thread count as every rank below
    index = json.load(open(root / "one" / "index.json"))
    assert one == {"num_shards": 6, "reused": 0, "encoded": 6, "log": one["log"]}
    # dataset order; clip 5 failed at load time and is left out, not replaced
    samples = build_dataset(str(root / "one")).samples
    assert [samples[i]["key"] for i in range(len(samples))] == [str(i) for i in range(11) if i != 5]
    assert sorted(index["failed"].values()) == ["missing_file", "not_a_video_or_corrupt"]
    for world_size in (2, 3):
        got = _build(argv + out(f"w{world_size}"), world_size)
        assert got == one  # every chunk encoded exactly once: no overlapping shares
        _assert_same_cache(root / "one", root / f"w{world_size}")

    # rank 1 of 2 dies by SIGKILL before writing its second shard; the launcher tears its partner down
    with pytest.raises(Exception, match="signal|SIGKILL|exit"):
        _build(argv + out("killed"), 2, kill_rank=1)
    kept = glob.glob(str(root / "killed" / "shard-*.safetensors"))
    assert not os.path.exists(root / "killed" / "index.json") and 1 <= len(kept) < 6
    assert cache.main(argv + out("killed")) == 2  # partly written, no --resume: refused in one line
    with pytest.raises(ValueError, match="partly written latent cache"):  # not read as a folder of videos
        build_dataset(str(root / "killed"))
    assert cache.main(argv + out("killed") + ["--dtype", "bfloat16", "--resume"]) == 2  # other settings
    resumed = _build(argv + out("killed") + ["--resume"], 2)
    assert resumed["reused"] == len(kept) and resumed["reused"] + resumed["encoded"] == 6
    assert resumed["log"] == one["log"]
    _assert_same_cache(root / "one", root / "killed")
    assert not glob.glob(str(root / "killed" / "*.tmp"))


def test_torchrun_command_line_equals_one_process(tmp_path):
    """``torchrun -m data.cache`` end to end (identity VAE and hashed text: no model to load)."""
    clips = make_clips(str(tmp_path / "videos"))
    argv = ["--source", str(tmp_path / "videos"), "--vae", "identity", "--text-encoder", "hashed"]
    argv += ["--dtype", "float32", "--shard-size", "2", "--option", "vae_stride=[1,1,1]"]
    argv += ["--option", "patch=[1,1,1]"] + POLICY
    assert len(clips) == 5 and cache.main(argv + ["--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        cmd + ["-m", "data.cache", *argv, "--out", str(tmp_path / "two")],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "3 shards, 0 reused from an earlier run, 3 encoded now on 2 process(es)" in result.stdout
    _assert_same_cache(tmp_path / "one", tmp_path / "two")


def _failing_worker(rank, world_size, argv):
    try:
        cache.cache_from_args(cache.parse_args(argv), ProcessGroupWorld(), "cpu")
    except Exception as e:  # every rank must stop, none may hang in a collective
        return type(e).__name__
    return "finished"


def _one_clip_shards(tmp_path, broken_at: list[int], max_failure_share: float) -> list[str]:
    """Arguments of a cache of 6 rows, shards of one clip (chunk i is rank i % 2's), broken files at
    ``broken_at``; identity VAE and hashed text (no model to load)."""
    clips = make_clips(str(tmp_path / "videos"))
    broken = sorted(p for p in make_broken(str(tmp_path / "videos"), clips[0]) if "zero" not in p)
    rows = [Row(clips[0], "a", VideoInfo(30, 32, 48, 24)) for _ in range(6)]
    for i, path in zip(broken_at, broken):
        rows[i] = Row(path, "a", VideoInfo(30, 32, 48, 24))
    write_manifest(rows, str(tmp_path / "m.csv"))
    argv = ["--source", str(tmp_path / "m.csv"), "--vae", "identity", "--text-encoder", "hashed"]
    argv += ["--shard-size", "1", "--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]"]
    return argv + [
        "--max-frames",
        "5",
        "--resolution",
        "16",
        "--option",
        f"max_failure_share={max_failure_share}",
    ]


def test_failure_share_is_checked_over_all_ranks_and_every_rank_stops(tmp_path):
    """Each rank alone stays under max_failure_share (1 broken clip of 6); together they do not (2 of 6)."""
    argv = _one_clip_shards(tmp_path, broken_at=[1, 2], max_failure_share=0.25)  # one on each rank
    for world_size, out in ((1, "one"), (2, "two")):
        stops = run_gloo(_failing_worker, world_size, argv + ["--out", str(tmp_path / out)], timeout_s=60)
        assert stops[0] == "TooManyFailures" and set(stops[1:]) <= {"RunStopped"}, stops
        assert not os.path.exists(tmp_path / out / "index.json")  # nothing half-done looks finished


def test_a_rank_that_stops_stops_the_others_at_their_next_chunk(tmp_path):
    """Rank 1 stops at its first chunk (1 broken clip of 6, above 10%); rank 0, whose clips are all
    good, stops after its first chunk too, instead of encoding its whole share (chunks 0, 2, 4).
    Planted: build_cache summing once after each rank's whole share -> shards 0, 2 and 4 on disk."""
    argv = _one_clip_shards(tmp_path, broken_at=[1], max_failure_share=0.1) + ["--out", str(tmp_path / "c")]
    assert run_gloo(_failing_worker, 2, argv, timeout_s=60) == ["RunStopped", "TooManyFailures"]
    assert sorted(os.listdir(tmp_path / "c")) == ["settings.json", "shard-00000.safetensors"]
