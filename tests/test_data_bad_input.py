"""Bad input to the data path: one line naming the fix, nothing written (issue 31).

The other three cases of the issue have their tests elsewhere, each checked with a plant:
a manifest row with a missing file (tests/test_data_robustness.py: dropped and counted as
`missing_file`, the way a corrupt video is), a partly written cache without --resume and a cache from
other settings (tests/test_data_cache_parallel.py), a cache made for another model
(tests/test_i2v_cache.py, check_cache_fits)."""

import sys

import pytest

from data import cache
from data.build import build_dataset


def test_a_reader_that_is_not_installed_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """decord hidden (None in sys.modules makes its import fail, as on a machine without its wheel).
    Planted: the check_backend call removed from VideoDataset.__init__ -> the dataset builds (rows with
    metadata are never opened), the cache starts, and both asserts fail."""
    monkeypatch.setitem(sys.modules, "decord", None)
    (tmp_path / "a.mp4").write_bytes(b"")
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,text,num_frames,height,width,fps\na.mp4,a dog,9,32,32,8\n")
    with pytest.raises(ValueError, match=r"decord is not installed: pip install decord .* 'pyav' or 'auto'"):
        build_dataset(str(manifest), backend="decord", progress=False)
    assert build_dataset(str(manifest), backend="auto", progress=False).backend == "auto"  # auto: PyAV
    out = tmp_path / "cache"
    argv = ["--source", str(manifest), "--vae", "identity", "--text-encoder", "hashed", "--out", str(out)]
    argv += ["--option", "backend=decord", "--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]"]
    assert cache.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "pip install decord" in err
    assert not out.exists()  # nothing half-written


def test_torchcodec_that_cannot_load_is_one_line(tmp_path, monkeypatch):
    """torchcodec hidden as above (its PyPI wheels from 0.14 on fail the same way on a CPU-only torch).
    Planted: the torchcodec branch removed from check_backend -> the dataset builds and this fails."""
    from data import readers

    monkeypatch.setitem(sys.modules, "torchcodec", None)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    readers._torchcodec.cache_clear()
    monkeypatch.setattr(readers, "_torchcodec", readers._torchcodec.__wrapped__)  # not cached while hidden
    (tmp_path / "a.mp4").write_bytes(b"")
    (tmp_path / "m.csv").write_text("path,text,num_frames,height,width,fps\na.mp4,a dog,9,32,32,8\n")
    with pytest.raises(ValueError, match=r"torchcodec is not installed or cannot load .* README.md"):
        build_dataset(str(tmp_path / "m.csv"), backend="torchcodec", progress=False)


def _snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_a_partly_written_cache_is_refused_unless_resumed_with_the_same_settings(tmp_path, capsys):
    """One process, identity VAE: a finished cache loses its index and a shard (as a killed run leaves
    it). Without --resume, and with --resume but another dtype, the rerun stops in one line naming the
    fix and touches no file; with --resume it finishes. (tests/test_data_cache_parallel.py does the same
    after a real SIGKILL under gloo, slowly.) Planted: the `if not resume` refusal removed from
    data/cache_shards.py check_out_folder -> the first rerun finishes the cache and this fails; the
    settings comparison removed -> the bfloat16 rerun mixes dtypes and this fails."""
    from _data_media import make_clips

    make_clips(str(tmp_path / "videos"), captions=True)
    out = tmp_path / "cache"
    argv = ["--source", str(tmp_path / "videos"), "--vae", "identity", "--text-encoder", "hashed"]
    argv += ["--out", str(out), "--shard-size", "2", "--dtype", "float32", "--fps", "8", "--max-frames", "5"]
    argv += ["--resolution", "16", "--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]"]
    argv += ["--option", "progress=false"]  # no probing bar on stderr: the error is its only line
    assert cache.main(argv) == 0
    (out / "index.json").unlink()
    (out / "shard-00001.safetensors").unlink()
    capsys.readouterr()
    before = _snapshot(out)
    for extra, fix in (
        ([], "add --resume to finish it"),
        (["--dtype", "bfloat16", "--resume"], "other settings"),
    ):
        assert cache.main(argv + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and fix in err, err
        assert _snapshot(out) == before  # nothing written, nothing deleted
    assert cache.main(argv + ["--resume"]) == 0
    assert "1 encoded now" in capsys.readouterr().out
    assert len(build_dataset(str(out))) == 5


def test_a_partly_written_cache_is_refused_under_another_reader(tmp_path, capsys):
    """The reader is a cache setting ('auto' recorded as the reader it resolves to): decord's pixels
    differ from PyAV's by a level or two (docs/data.md), so shards of two readers would mix. A cache
    begun with --reader decord and resumed with --reader pyav stops in one line naming --reader decord
    and touches no file; resumed with decord it finishes and its index records the reader. Planted:
    "reader" left out of data/cache.py cache_settings -> the pyav rerun finishes the cache and this
    fails."""
    import json

    from _data_media import make_clips

    pytest.importorskip("decord")
    make_clips(str(tmp_path / "videos"), captions=True)
    out = tmp_path / "cache"
    argv = ["--source", str(tmp_path / "videos"), "--vae", "identity", "--text-encoder", "hashed"]
    argv += ["--out", str(out), "--shard-size", "2", "--dtype", "float32", "--fps", "8", "--max-frames", "5"]
    argv += ["--resolution", "16", "--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]"]
    argv += ["--option", "progress=false"]
    assert cache.main(argv + ["--reader", "decord"]) == 0
    assert json.loads((out / "index.json").read_text())["reader"] == "decord"
    (out / "index.json").unlink()
    (out / "shard-00001.safetensors").unlink()
    capsys.readouterr()
    before = _snapshot(out)
    assert cache.main(argv + ["--reader", "pyav", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "(reader: 'decord' there, 'pyav' now); rerun with --reader decord or choose a new --out" in err, (
        err
    )
    assert _snapshot(out) == before
    assert cache.main(argv + ["--reader", "decord", "--resume"]) == 0
    assert "1 encoded now" in capsys.readouterr().out
