"""JSONL manifests through pyarrow.json (data/manifest_arrow.py read_jsonl) against the line-by-line read."""

import json
import logging

import pytest
from _data_media import make_clips

from data import manifest_arrow, scan
from data.build import build_dataset
from data.manifest_table import ManifestTable, read

pytest.importorskip("pyarrow.json")

POLICY = dict(
    fps=8, max_frames=9, vae_stride=(1, 1, 1), patch=(1, 1, 1), max_failure_share=0.5, progress=False
)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    """Real clips scanned to JSONL by data.scan, plus: a row whose file is missing, a row without
    metadata (probed at build), a blank and a whitespace line, CRLF, an extra nested key, a null
    and an empty caption, non-ASCII text, metadata as floats."""
    root = tmp_path_factory.mktemp("jsonl")
    make_clips(str(root / "clips"))
    path = root / "m.jsonl"
    assert scan.main([str(root / "clips"), "--out", str(path), "--workers", "2"]) == 0
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    extra = [
        json.dumps({**first, "path": "clips/gone.mp4", "text": "missing"}),
        "",
        "   ",
        json.dumps({"path": json.loads(lines[1])["path"], "text": None}),  # no metadata: probed
        json.dumps({**first, "text": "déjà vu, the same clip", "meta": {"k": [1, 2]}}) + "\r",
        json.dumps({**first, "num_frames": float(first["num_frames"]), "fps": 23.976024, "text": ""}),
    ]
    path.write_text("\n".join(lines + extra) + "\n")
    return path


def _tables_equal(a: ManifestTable, b: ManifestTable):
    assert len(a) == len(b) and a.rows() == b.rows()
    for name in ("frames", "height", "width", "missing", "captioned"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a.fps.tobytes() == b.fps.tobytes()


def test_the_columnar_jsonl_read_equals_the_line_by_line_read(manifest, monkeypatch, caplog):
    """Table, dataset (length, every clip's shape, path and caption) and failures equal the line-by-line
    read's; the missing file is one warning line naming the fix. Planted, each caught: blank lines
    kept in the byte offsets (read_jsonl gives None: its row count no longer matches); `captioned` as
    utf8_length >= 0 (the empty caption counts as captioned); the schema's fps as float32 (fps differs
    in its last bits)."""
    columnar = manifest_arrow.read_jsonl(str(manifest))
    assert columnar is not None
    line_by_line = read(str(manifest), fast=False)
    _tables_equal(columnar, line_by_line)
    assert line_by_line.missing.sum() == 1 and (~line_by_line.has_info).sum() == 1
    assert (~line_by_line.captioned).sum() == 2

    with caplog.at_level(logging.WARNING, logger="data"):
        fast = build_dataset(str(manifest), **POLICY)
    lines = [r.getMessage() for r in caplog.records if "gone.mp4" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].endswith(
        "gone.mp4: missing_file (listed in the manifest but not on disk: fix its path, "
        "or rerun python -m data.scan to drop it)"
    )
    monkeypatch.setattr(manifest_arrow, "read_jsonl", lambda path: None)  # the line-by-line read
    slow = build_dataset(str(manifest), **POLICY)
    assert len(fast) == len(slow) == 8
    for i in range(len(fast)):
        assert (fast.meta(i), fast.path(i), fast.caption(i)) == (slow.meta(i), slow.path(i), slow.caption(i))
    assert (
        fast.failures.failed
        == slow.failures.failed
        == {str(manifest.parent / "clips/gone.mp4"): "missing_file"}
    )
    assert fast.failures.skipped == slow.failures.skipped


@pytest.mark.parametrize(
    "line, error",
    [
        (
            '{"path": "a.mp4", "num_frames": "33", "height": 64, "width": 64, "fps": 16}',
            None,
        ),  # a string number
        ('{"path": 7, "text": "a number as path"}', None),
        ('{"path": "a.mp4", "text": 5}', None),
        ('{"text": "no path"}', r"m.jsonl:2: each line needs an object with a 'path' key"),
        ('{"path": ""}', r"m.jsonl:2: empty 'path'"),
        ("[1, 2]", r"m.jsonl:2: each line needs an object with a 'path' key"),
        ('{"path": "a.mp4",', r"m.jsonl:2: not valid JSON"),
        (
            '{"path": "a.mp4", "num_frames": -1, "height": 64, "width": 64, "fps": 16}',
            r"m.jsonl:2: bad metadata",
        ),
    ],
)
def test_what_the_columnar_read_leaves_to_the_line_by_line_read(tmp_path, line, error):
    """Lines pyarrow does not take as json.loads would: read_jsonl gives None, and read() gives the
    line-by-line table, or its one-line error naming the line."""
    (tmp_path / "a.mp4").write_bytes(b"")
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"path": "a.mp4", "text": "fine", "num_frames": 9, "height": 64, "width": 64, "fps": 8}\n' + line
    )
    assert manifest_arrow.read_jsonl(str(path)) is None
    if error is None:
        _tables_equal(read(str(path)), read(str(path), fast=False))
    else:
        with pytest.raises(ValueError, match=error):
            read(str(path))


def test_line_offsets_skip_what_strip_skips(tmp_path, monkeypatch):
    """_line_offsets against the lines bytes.strip() keeps, with blocks of 16 bytes (lines straddle
    blocks): blank, whitespace-only, a line starting with spaces, no final newline."""
    monkeypatch.setattr(manifest_arrow, "BLOCK", 16)
    data = b'{"path": "a"}\n\n  \t\n   {"path": "b"}\r\n\x0c\n{"path": "a long one, longer than a block"}\n{}'
    (tmp_path / "m.jsonl").write_bytes(data)
    want, at = [], 0
    for line in data.split(b"\n"):
        if line.strip():
            want.append(at)
        at += len(line) + 1
    assert manifest_arrow._line_offsets(str(tmp_path / "m.jsonl")).tolist() == want


def test_scan_writes_parquet_that_reads_back_as_its_csv(tmp_path, monkeypatch, capsys):
    """python -m data.scan --out x.parquet: the CSV's columns (path relative to the manifest, text,
    int frames and size, float fps), and reading it back gives the rows of the same scan written as CSV
    and as JSONL. Without pyarrow: one line naming the extra before anything is probed or written.
    Planted, each caught: paths written absolute (the stored column differs); fps through float32
    (the rows differ from the CSV's)."""
    import sys

    import pyarrow.parquet as pq

    from data.manifest_table import read_table

    make_clips(str(tmp_path / "clips"))
    for ext in ("csv", "jsonl", "parquet"):
        assert (
            scan.main([str(tmp_path / "clips"), "--out", str(tmp_path / f"m.{ext}"), "--workers", "2"]) == 0
        )
    stored = pq.read_table(tmp_path / "m.parquet")
    assert stored.schema.names == ["path", "text", "num_frames", "height", "width", "fps"]
    assert [str(t) for t in stored.schema.types] == ["string", "string", "int64", "int64", "int64", "double"]
    assert stored.column("path").to_pylist()[0] == "clips/h264_32x32_8fps.mp4"
    rows = read_table(tmp_path / "m.parquet").rows()
    assert (
        len(rows) == 5
        and rows == read_table(tmp_path / "m.csv").rows() == read_table(tmp_path / "m.jsonl").rows()
    )
    assert all(r.info is not None and r.text for r in rows)

    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert scan.main([str(tmp_path / "clips"), "--out", str(tmp_path / "x.parquet")]) != 0
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {tmp_path / 'x.parquet'}: writing a Parquet manifest needs pyarrow: "
        "pip install 'dynamic-cp-video[parquet]'"
    ), err
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("head", ["null\n", "\n  null\n", "[1]\n", '"a.mp4"\n'])
def test_a_first_value_that_is_not_an_object_never_reaches_pyarrow(tmp_path, head):
    """pyarrow 26's open_json kills the process (SIGSEGV) when the first value is null (found by
    tests/test_fuzz_inputs.py): such a file goes to the line-by-line read, which names the line.
    Planted: the check removed -> this test's process crashes."""
    (tmp_path / "a.mp4").write_bytes(b"")
    path = tmp_path / "m.jsonl"
    path.write_text(head + '{"path": "a.mp4"}\n')
    assert manifest_arrow.read_jsonl(str(path)) is None
    with pytest.raises(ValueError, match=r"m.jsonl:\d: each line needs an object with a 'path' key"):
        read(str(path))
