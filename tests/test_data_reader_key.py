"""``data.reader`` (issue 31): the one key that picks the video reader of data.scan, data.cache and
training, validated by the config; ``data.options.backend`` (``--option backend=``) is its deprecated alias.

Each reader name is followed to the call that decodes (``read_frames``) or probes (``probe``) a real
file, through the real entry points, with a spy that records the name and calls the real function.
Planted, each caught here: dit/setup.py not passing ``cfg.reader`` to build_dataset (training decodes
with 'auto'); data/cache.py dropping ``--reader`` (same); data/scan.py probing with 'auto' instead of
``--reader``; the alias dropped in from_dict (the config's reader stays 'auto'); the "disagree" check
removed from choose_reader (both keys accepted)."""

from __future__ import annotations

import os

import pytest

import data.scan
import data.video_dataset
from data import cache, readers
from data.media import make_video
from dit.config import DataConfig, load_config
from dit.setup import build_datasets

NAMES = ("auto", "decord", "pyav", "torchcodec")


def _loads(name: str) -> bool:
    try:
        readers.check_backend(name)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videos")
    for i in range(2):
        make_video(folder / f"clip{i}.mp4", 16, 16, 8, 5)
        (folder / f"clip{i}.txt").write_text(f"clip {i}")
    return folder


@pytest.fixture
def used(monkeypatch):
    """The reader names that reached a decode or a probe, in call order."""
    calls = []

    def spy(real):
        def call(path, *args):
            calls.append(args[-1])
            return real(path, *args)

        return call

    monkeypatch.setattr(data.video_dataset, "read_frames", spy(readers.read_frames))
    monkeypatch.setattr(data.scan, "probe", spy(readers.probe))
    return calls


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("name", NAMES)
def test_each_reader_reaches_scan_cache_and_training(videos, tmp_path, used, name, capsys):
    """torchcodec cannot load here (CPU torch, PyPI's CUDA-linked wheels; README): where it cannot,
    the name still arrives, as its one-line refusal, before anything is written."""
    ok = _loads(name)
    manifest = tmp_path / "m.csv"
    assert data.scan.main([str(videos), "--out", str(manifest), "--reader", name, "--workers", "1"]) == (
        0 if ok else 2
    )
    if not ok:
        _one_line_error(capsys, f"reader '{name}'", "--reader")
        assert not manifest.exists()
        return
    assert used == [name, name]  # both files probed with it
    used.clear()

    out = tmp_path / "cache"
    argv = ["--source", str(manifest), "--vae", "identity", "--text-encoder", "hashed", "--out", str(out)]
    argv += ["--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]", "--option", "progress=false"]
    assert cache.main(argv + ["--reader", name]) == 0
    assert used == [name, name]
    used.clear()

    cfg = load_config(
        "configs/tiny.yaml", [f"data.source={manifest}", f"data.reader={name}", "data.num_val_clips=1"]
    )
    train, idx, _, _ = build_datasets(cfg.data, (1, 1, 1))
    train[idx[0]]
    assert used == [name]


def test_a_reader_that_cannot_load_is_refused_by_cache_and_training(videos, tmp_path, monkeypatch, capsys):
    """torchcodec hidden, as on a machine without it: one line naming data.reader / --reader, nothing written."""
    monkeypatch.setattr(readers, "_torchcodec", lambda: None)
    out = tmp_path / "cache"
    argv = ["--source", str(videos), "--vae", "identity", "--text-encoder", "hashed", "--out", str(out)]
    argv += ["--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]", "--option", "progress=false"]
    assert cache.main(argv + ["--reader", "torchcodec"]) == 2
    _one_line_error(capsys, "reader 'torchcodec' is set (data.reader, --reader)", "'pyav' or 'auto'")
    assert not out.exists()
    cfg = load_config(
        "configs/tiny.yaml", [f"data.source={videos}", "data.reader=torchcodec", "data.num_val_clips=1"]
    )
    with pytest.raises(ValueError, match=r"reader 'torchcodec' is set \(data.reader"):
        build_datasets(cfg.data, (1, 1, 1))


def test_a_bad_reader_is_one_line_listing_the_choices():
    for overrides in (["data.reader=ffmpeg"], ["data.options={backend: ffmpeg}"]):
        with pytest.raises(ValueError) as e:
            load_config("configs/tiny.yaml", overrides)
        msg = str(e.value)
        assert "\n" not in msg and "'ffmpeg' is not a video reader" in msg, msg
        assert msg.endswith("choose one of auto, decord, pyav, torchcodec"), msg
    with pytest.raises(SystemExit):  # argparse lists the choices
        cache.parse_args(
            [
                "--source",
                "x",
                "--out",
                "y",
                "--vae",
                "identity",
                "--text-encoder",
                "hashed",
                "--reader",
                "ffmpeg",
            ]
        )


def test_the_old_key_is_an_alias(videos, tmp_path, used, capsys):
    """data.options.backend and --option backend= still choose the reader (with a DeprecationWarning);
    given with data.reader / --reader and another name: one line. The visible config shows data.reader."""
    with pytest.warns(DeprecationWarning, match="name the video reader with data.reader"):
        cfg = load_config("configs/tiny.yaml", ["data.options={backend: pyav, fps: 8}"])
    assert cfg.data.reader == "pyav" and cfg.data.options == {"fps": 8}  # moved, not kept twice
    with pytest.warns(DeprecationWarning):
        assert load_config(None, ["data.options={backend: pyav}", "data.reader=pyav"]).data.reader == "pyav"
        assert DataConfig(options={"backend": "decord"}).reader == "decord"  # built in Python
        for overrides in (
            ["data.options={backend: pyav}", "data.reader=auto"],
            ["data.options={backend: pyav}", "data.reader=decord"],
        ):
            with pytest.raises(
                ValueError,
                match=r"^data.reader='\w+' and data.options.backend='pyav' disagree; drop data.options.backend",
            ):
                load_config(None, overrides)

        out = tmp_path / "cache"
        argv = ["--source", str(videos), "--vae", "identity", "--text-encoder", "hashed"]
        argv += ["--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]", "--option", "progress=false"]
        assert cache.main(argv + ["--out", str(out), "--option", "backend=pyav"]) == 0
        assert len(used) == 4 and set(used) == {"pyav"}  # two probes (a folder has no metadata), two decodes
        capsys.readouterr()
        assert (
            cache.main(
                argv + ["--out", str(tmp_path / "c2"), "--option", "backend=pyav", "--reader", "decord"]
            )
            == 2
        )
        _one_line_error(capsys, "reader='decord' and backend='pyav' disagree")
        assert not os.path.exists(tmp_path / "c2")
