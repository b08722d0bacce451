"""Folders, CSV/JSONL manifests and scan on real media; tokens from metadata equal decoded tokens."""

import csv
import json
import os

import pytest
from _data_media import CLIPS, make_clips

from data import scan
from data.build import build_dataset
from data.manifest_table import read_manifest
from data.readers import probe
from data.tokens import num_tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    make_clips(str(root / "set"))
    return str(root / "set")


def test_folder_source_with_sidecar_captions(folder):
    ds = build_dataset(folder, vae_stride=(1, 1, 1), patch=(1, 1, 1), progress=False)
    assert len(ds) == len(CLIPS) and not ds.failures.failed
    names = sorted(c[0] for c in CLIPS)
    for i, name in enumerate(names):
        s = ds[i]
        _, w, h, fps, n = next(c for c in CLIPS if c[0] == name)
        assert s["caption"] == f"a test pattern, {w}x{h} at {fps} fps" and s["index"] == i
        assert s["video"].shape == (3, n, h, w)  # pixel space, no policy limits: the whole file
        assert -1 <= s["video"].min() and s["video"].max() <= 1


def test_scan_writes_metadata_and_manifests_read_back(folder, tmp_path, capsys):
    out = tmp_path / "meta" / "manifest.csv"
    assert scan.main([folder, "--out", str(out), "--workers", "2"]) == 0
    assert "5 files, 0 failed" in capsys.readouterr().out
    rows = list(csv.DictReader(open(out)))
    assert [r["path"] for r in rows][0].startswith("..")  # stored relative to the manifest
    for row in read_manifest(out):
        info = probe(row.path)
        assert row.info.num_frames == info.num_frames and (row.info.height, row.info.width) == (
            info.height,
            info.width,
        )
        assert row.text.startswith("a test pattern")
    # the same rows as JSONL give the same dataset
    jsonl = tmp_path / "meta" / "manifest.jsonl"
    scan.main([str(out), "--out", str(jsonl)])
    opts = dict(fps=12, max_frames=17, resolution=32, progress=False)
    a, b, c = (
        build_dataset(str(out), **opts),
        build_dataset(str(jsonl), **opts),
        build_dataset(folder, **opts),
    )
    assert (
        [a.meta(i) for i in range(len(a))]
        == [b.meta(i) for i in range(len(b))]
        == [c.meta(i) for i in range(len(c))]
    )


def test_manifest_without_metadata_is_probed_and_paths_resolve(folder, tmp_path):
    sub = tmp_path / "nested"
    sub.mkdir()
    man = sub / "m.jsonl"
    with open(man, "w") as f:
        for name, *_ in CLIPS[:2]:
            f.write(
                json.dumps({"path": os.path.relpath(os.path.join(folder, name), sub), "text": name}) + "\n"
            )
    ds = build_dataset(str(man), progress=False, vae_stride=(1, 1, 1), patch=(1, 1, 1))
    assert [ds[i]["caption"] for i in range(2)] == [CLIPS[0][0], CLIPS[1][0]]


@pytest.mark.parametrize(
    "opts",
    [
        dict(vae_stride=(1, 1, 1), patch=(1, 1, 1)),
        dict(fps=12, vae_stride=(4, 8, 8)),
        dict(fps=10, max_frames=9, resolution=48, crop="random", vae_stride=(4, 8, 8)),
        dict(resolution=64, max_tokens=24, vae_stride=(4, 8, 8), patch=(1, 2, 2)),
    ],
)
def test_tokens_from_metadata_equal_tokens_of_decoded_clip(folder, opts):
    ds = build_dataset(folder, progress=False, **opts)
    assert len(ds) + len(ds.failures.skipped) == len(CLIPS)
    stride, patch = ds.policy.vae_stride, ds.policy.patch
    for i in range(len(ds)):
        m = ds.meta(i)
        video = ds[i]["video"]
        assert tuple(video.shape[1:]) == (m.num_frames, m.height, m.width)
        assert num_tokens(*video.shape[1:], stride, patch) == num_tokens(
            m.num_frames, m.height, m.width, stride, patch
        )
        if stride[0] == 4:
            assert (m.num_frames - 1) % 4 == 0 and m.height % 16 == 0 and m.width % 16 == 0
        if "max_tokens" in opts:
            assert num_tokens(m.num_frames, m.height, m.width, stride, patch) <= opts["max_tokens"]


def test_unknown_option_and_bad_source_are_value_errors(folder, tmp_path):
    with pytest.raises(ValueError, match="max_frame"):
        build_dataset(folder, max_frame=9)
    with pytest.raises(ValueError, match="does not exist"):
        build_dataset(str(tmp_path / "missing.csv"))
    with pytest.raises(ValueError, match="neither"):
        build_dataset(str(tmp_path / "no_such_folder"))
    with pytest.raises(ValueError, match="no usable clips"):
        build_dataset(folder, min_frames=200, progress=False)


def test_images_are_one_frame_clips(tmp_path):
    import numpy as np
    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 255, (40, 72, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "still.png")
    (tmp_path / "still.txt").write_text("a still image")
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    ds = build_dataset(str(tmp_path), resolution=32, max_failure_share=0.5, progress=False)
    assert len(ds) == 1 and ds.failures.failed == {str(tmp_path / "broken.jpg"): "not_an_image_or_corrupt"}
    m, s = ds.meta(0), ds[0]
    assert (
        m.num_frames == 1
        and s["video"].shape == (3, 1, m.height, m.width)
        and s["caption"] == "a still image"
    )
    assert num_tokens(m.num_frames, m.height, m.width) == (m.height // 16) * (m.width // 16)
