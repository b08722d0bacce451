"""Manifests as columns (data/manifest_table.py): the same rows as a parse into objects, none held per row."""

import gc
import json
import os

from data.build import build_dataset
from data.clip_policy import ClipPolicy
from data.manifest import Row
from data.manifest_table import read_table
from data.readers import VideoInfo
from data.video_dataset import VideoDataset

CSV = (
    "path,text,num_frames,height,width,fps\n"
    'a.mp4,"a dog, running",33,64,64,16\n'
    "\n"  # a blank line: skipped, as csv.DictReader skips it
    'sub/b.mp4,"two lines:\nand a ""quote""",9,32,48,8\n'
    "c.mp4,,120,720,1280,29.97\n"
    "d.mp4,too short,1,64,64,16\n"
    "gone.mp4,missing,33,64,64,16\n"
    "e.mp4,not probed\n"  # a short row: no metadata, probed at build
    "a.mp4,the same file again,33,64,64,16\n"
)


def _files(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("a.mp4", "sub/b.mp4", "c.mp4", "d.mp4", "e.mp4"):
        (tmp_path / name).write_bytes(b"")  # rows with metadata are never opened while building
    (tmp_path / "m.csv").write_text(CSV)
    with open(tmp_path / "m.jsonl", "w") as f:
        for r in read_table(tmp_path / "m.csv").rows():
            rec = {"path": os.path.relpath(r.path, tmp_path), "text": r.text}
            if r.info:
                rec.update(
                    num_frames=r.info.num_frames, height=r.info.height, width=r.info.width, fps=r.info.fps
                )
            f.write(json.dumps(rec) + "\n")


def _expected(root):
    rows = [
        ("a.mp4", "a dog, running", VideoInfo(33, 64, 64, 16.0)),
        ("sub/b.mp4", 'two lines:\nand a "quote"', VideoInfo(9, 32, 48, 8.0)),
        ("c.mp4", "", VideoInfo(120, 720, 1280, 29.97)),
        ("d.mp4", "too short", VideoInfo(1, 64, 64, 16.0)),
        ("gone.mp4", "missing", VideoInfo(33, 64, 64, 16.0)),
        ("e.mp4", "not probed", None),
        ("a.mp4", "the same file again", VideoInfo(33, 64, 64, 16.0)),
    ]
    return [Row(os.path.join(root, p), t, i) for p, t, i in rows]


def test_csv_and_jsonl_tables_give_the_rows_and_the_dataset_of_a_row_list(tmp_path):
    """Quoted commas, a caption spanning two lines, a blank line, a short row, a repeated file: each row
    read back by its byte offset. Planted an off-by-one in the CSV record offsets (starts[first + 1]) ->
    the rows after the first come back shifted and this fails."""
    _files(tmp_path)
    expected = _expected(str(tmp_path))
    for name in ("m.csv", "m.jsonl"):
        table = read_table(tmp_path / name)
        assert table.rows() == expected, name
        assert table.missing.tolist() == [False, False, False, False, True, False, False]
        assert table.captioned.tolist() == [True, True, False, True, True, True, True]
    # The dataset over the table equals the dataset over the same rows as objects (the folder path),
    # the unprobed empty file counted as failed, the missing one as missing, the 1-frame one as skipped.
    policy = dict(fps=8, max_frames=9, min_frames=5, resolution=32, vae_stride=(4, 8, 8), patch=(1, 2, 2))
    build = dict(max_failure_share=1.0, progress=False, probe_workers=1)
    a = VideoDataset(read_table(tmp_path / "m.csv"), ClipPolicy(**policy), **build)
    b = VideoDataset(expected, ClipPolicy(**policy), **build)
    c = build_dataset(str(tmp_path / "m.jsonl"), **policy, **build)
    for ds in (a, b, c):
        assert [ds.path(i) for i in range(len(ds))] == [expected[j].path for j in (0, 1, 2, 6)]
        assert [ds.caption(i) for i in range(len(ds))] == [expected[j].text for j in (0, 1, 2, 6)]
        assert [ds.meta(i) for i in range(len(ds))] == [b.meta(i) for i in range(len(b))]
        assert [ds.info(i) for i in range(len(ds))] == [expected[j].info for j in (0, 1, 2, 6)]
        assert ds.failures.failed == {expected[4].path: "missing_file", expected[5].path: "zero_bytes"}
        assert ds.failures.skipped == {expected[3].path: "too_short"}


def test_a_manifest_dataset_holds_no_object_per_row(tmp_path):
    """Planted `self.rows = table.rows()` in VideoDataset.__init__ -> 2,000 Row objects stay alive and this
    fails; so does keeping the old list of (Row, ClipMeta) items."""
    (tmp_path / "a.mp4").write_bytes(b"")
    lines = [f"a.mp4,clip {i},{1 + 4 * (i % 9)},64,{64 + 16 * (i % 3)},16\n" for i in range(2000)]
    (tmp_path / "m.csv").write_text("path,text,num_frames,height,width,fps\n" + "".join(lines))
    ds = build_dataset(str(tmp_path / "m.csv"), fps=16, progress=False)
    gc.collect()
    assert len(ds) == 2000 and ds.caption(1234) == "clip 1234"
    assert sum(isinstance(o, Row) for o in gc.get_objects()) == 0
    assert ds.meta(1234).num_frames == 1 + 4 * (1234 % 9)


def test_a_byte_that_is_not_utf8_is_named_by_line_and_file_offset(tmp_path):
    """The manifest is read line by line as bytes: the error names the line and the byte in the file
    (planted: the offset within the line -> fails)."""
    import pytest

    (tmp_path / "m.csv").write_bytes(b"path,text\na.mp4,caf\xe9\n")
    with pytest.raises(ValueError, match=r"m.csv:2: not UTF-8 text \(.* at byte 19\); save it as UTF-8"):
        read_table(tmp_path / "m.csv")


def _write_parquet(tmp_path, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = read_table(tmp_path / "m.csv").rows()
    info = lambda name: [None if r.info is None else getattr(r.info, name) for r in rows]  # noqa: E731
    table = pa.table(
        {
            "path": [os.path.relpath(r.path, tmp_path) for r in rows],
            "text": [r.text or None for r in rows],  # an empty caption as a null
            "num_frames": pa.array(info("num_frames"), pa.int32()),
            "height": info("height"),
            "width": info("width"),
            "fps": info("fps"),
            "aesthetic": [5.0] * len(rows),  # a column the manifest does not use: never read
        }
    )
    pq.write_table(table, tmp_path / "m.parquet", row_group_size=row_group_size)


def test_a_parquet_manifest_gives_the_csv_rows_and_dataset(tmp_path):
    """The same rows as the CSV, through the same columns (nulls where the CSV has empty fields), read
    back from row groups of 3 rows out of order. Planted: the row group found with side="left" in
    _ParquetRecords.get -> the first row of each group comes from the group before and this fails; the
    null mask dropped (nulls read as NaN metadata) -> the unprobed row is refused as bad metadata."""
    _files(tmp_path)
    _write_parquet(tmp_path, row_group_size=3)
    expected = _expected(str(tmp_path))
    table = read_table(tmp_path / "m.parquet")
    assert [table.row(j) for j in (6, 0, 3, 2, 5, 1, 4)] == [expected[j] for j in (6, 0, 3, 2, 5, 1, 4)]
    csv_table = read_table(tmp_path / "m.csv")
    for name in ("missing", "captioned", "frames", "height", "width"):
        assert getattr(table, name).tolist() == getattr(csv_table, name).tolist(), name
    policy = dict(fps=8, max_frames=9, min_frames=5, resolution=32, vae_stride=(4, 8, 8), patch=(1, 2, 2))
    build = dict(max_failure_share=1.0, progress=False, probe_workers=1)
    a, b = (build_dataset(str(tmp_path / m), **policy, **build) for m in ("m.csv", "m.parquet"))
    assert len(a) == len(b) == 4
    for i in range(4):
        assert (b.path(i), b.caption(i), b.meta(i), b.info(i)) == (
            a.path(i),
            a.caption(i),
            a.meta(i),
            a.info(i),
        )
    assert (b.failures.failed, b.failures.skipped) == (a.failures.failed, a.failures.skipped)


def test_parquet_without_pyarrow_and_bad_parquet_are_one_line(tmp_path, monkeypatch):
    """pyarrow hidden as on a machine without the extra (None in sys.modules fails the import). Planted:
    the ImportError caught nowhere -> ModuleNotFoundError, not the line naming the extra."""
    import sys

    import pytest

    _files(tmp_path)
    _write_parquet(tmp_path, row_group_size=4)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"bad.parquet: not a readable Parquet file"):
        read_table(tmp_path / "bad.parquet")
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValueError) as e:
        build_dataset(str(tmp_path / "m.parquet"), progress=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("needs pyarrow: pip install 'dynamic-cp-video[parquet]'"), msg


FAST_CSV = (
    "path,text,num_frames,height,width,fps\r\n"
    'a.mp4,"a dog, running",33,64,64,16\r\n'
    "\r\n"  # a blank line
    'sub/b.mp4,"two lines:\nand a ""quote""",9,32,48,8\n'
    'c.mp4,"",120,720,1280,29.97\n'  # a quoted empty caption
    "d.mp4,too short,1,64,64,16\n"
    "gone.mp4,missing,33,64,64,16\n"
    "e.mp4,not probed,,,,\n"  # no metadata: probed at build
    "a.mp4,the same file again,33.0,64,64,16"  # no newline at the end
)


def _same_tables(a, b):
    assert len(a) == len(b) and a.rows() == b.rows()
    for name in ("frames", "height", "width", "missing", "captioned"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a.fps.tobytes() == b.fps.tobytes()  # NaN where not probed, in the same rows


def test_the_numpy_csv_parse_equals_the_row_by_row_read(tmp_path, monkeypatch):
    """The fast CSV path (data/manifest_table.py _read_csv_fast) against the csv module, with blocks of
    64 bytes so that records straddle blocks: CRLF and LF endings, a blank line, quoted commas, a
    newline and doubled quotes in a caption, a quoted empty caption, a row without metadata, no final
    newline. Planted, each caught: the quote parity inverted (delimiters inside quotes); the record
    offsets without the block's base (rows after the first block come back wrong); the \\r kept in the
    last field (fps unparsable -> the fast path gives up -> the `fast is not None` check fails)."""
    from data import manifest_table as mt

    _files(tmp_path)
    (tmp_path / "f.csv").write_bytes(FAST_CSV.encode())
    slow = mt.read(str(tmp_path / "f.csv"), fast=False)
    monkeypatch.setattr(mt, "BLOCK", 64)
    fast = mt._read_csv_fast(str(tmp_path / "f.csv"))
    assert fast is not None
    _same_tables(fast, slow)
    assert slow.rows()[1].text == 'two lines:\nand a "quote"' and slow.captioned.tolist()[2] is False
    # What the fast path leaves to the csv module gives the same table through read(): a short row,
    # a quoted number, a quoted path.
    for name, text in (
        ("short.csv", "path,text,num_frames,height,width,fps\na.mp4,x\n"),
        ("quoted.csv", 'path,text,num_frames,height,width,fps\na.mp4,x,"33",64,64,16\n'),
        ("qpath.csv", 'path,text,num_frames,height,width,fps\n"a.mp4",x,33,64,64,16\n'),
    ):
        (tmp_path / name).write_text(text)
        assert mt._read_csv_fast(str(tmp_path / name)) is None, name
        _same_tables(mt.read(str(tmp_path / name)), mt.read(str(tmp_path / name), False))


def test_the_csv_fast_path_reads_utf8_that_a_block_cuts(tmp_path, monkeypatch):
    """Captions of 2- and 3-byte UTF-8 characters at block sizes that end reads inside one: the fast
    path checks only its block's whole records, so it still takes the file (not None) and equals the
    row-by-row read. Planted: the UTF-8 check on all the bytes read (into the next block) -> the fast
    path gives up on a cut character -> fails."""
    from data import manifest_table as mt

    rows = "".join(f"v{k}.mp4,café {'日本語' * k},33,64,64,16\n" for k in range(12))
    (tmp_path / "u.csv").write_text("path,text,num_frames,height,width,fps\n" + rows, encoding="utf-8")
    slow = mt.read(str(tmp_path / "u.csv"), fast=False)
    for size in range(16, 90, 7):
        monkeypatch.setattr(mt, "BLOCK", size)
        fast = mt._read_csv_fast(str(tmp_path / "u.csv"))
        assert fast is not None, size
        _same_tables(fast, slow)


def test_distinct_rows_by_one_key_equal_numpy_unique_of_the_rows():
    """plan_rows' _distinct_rows (one int64 key a row) against np.unique(axis=0), on random metadata and
    on values too wide for 63 bits (the fallback). Planted: the key columns decoded in the wrong order
    (range(4) instead of (3, 2, 1, 0)) -> fails."""
    import numpy as np

    from data.manifest_table import _distinct_rows

    rng = np.random.default_rng(0)
    for trial in range(20):
        m = int(rng.integers(0, 2000))
        f = rng.integers(1, 2**31 - 1 if trial % 5 == 0 else 400, m).astype(np.int32)
        h, w = (rng.choice([1, 480, 720, 1080], m).astype(np.int32) for _ in range(2))
        fps = rng.choice([8.0, 24.0, 29.97, 30.0], m)
        got, got_inverse = _distinct_rows(f, h, w, fps)
        want, want_inverse = np.unique(np.stack([f, h, w, fps], axis=1), axis=0, return_inverse=True)
        assert np.array_equal(got, want) and np.array_equal(got_inverse, want_inverse.reshape(-1)), trial


def test_the_folder_listing_calls_missing_what_isfile_calls_missing(tmp_path):
    """_Listing (one scandir per folder) against os.path.isfile, row by row: relative and absolute paths,
    a sub-folder, '..', a folder named like a video, a symlink to a file, a broken symlink, a folder
    that does not exist, a file at the root, non-ASCII names, /a.mp4 beside a.mp4. Planted, each
    caught: `if e.is_file()` dropped from the listing (the folder named like a video counts as a file);
    a slash of the path before taken as this one's (`cut >= s` dropped); absolute and relative folders
    of the same bytes mixed (`^ absolute` dropped: /a.mp4 found in the manifest's folder)."""
    import numpy as np

    from data.manifest_columns import _Listing

    (tmp_path / "sub").mkdir()
    (tmp_path / "dir.mp4").mkdir()
    for name in ("a.mp4", "sub/b.mp4", "sub/été.mp4"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "link.mp4").symlink_to(tmp_path / "a.mp4")
    (tmp_path / "broken.mp4").symlink_to(tmp_path / "nowhere.mp4")
    paths = ["a.mp4", "sub/b.mp4", "sub/../a.mp4", "sub/a.mp4", "dir.mp4", "link.mp4", "broken.mp4",
             "gone/x.mp4", str(tmp_path / "sub" / "b.mp4"), "/etc/hostname", "/no-such-file.mp4", "sub/été.mp4", "été.mp4", "sub/ete.mp4", "/a.mp4", "b.mp4"]  # fmt: skip
    check = [True] * (len(paths) - 1) + [False]  # the last row has no metadata: not checked
    want = [not os.path.isfile(os.path.join(tmp_path, p)) for p in paths[:-1]] + [False]
    assert _Listing(str(tmp_path)).missing(paths, check).tolist() == want
    assert want[:8] == [False, False, False, True, True, False, True, True] and want[-5:-1] == [
        False,
        True,
        True,
        True,
    ]
    assert _Listing(str(tmp_path)).missing([], []).dtype == np.bool_


def test_plan_rows_equals_the_policy_row_by_row_across_chunks(monkeypatch):
    """plan_rows (one key code for the table, a chunk's distinct rows planned before found by search)
    against policy.plan on every row, with chunks of 7 rows so that most rows were planned in an
    earlier chunk, on rows that fit one key and rows too wide for it (the per-chunk fallback). Planted,
    each caught: the known keys not re-sorted after a chunk adds some; the per-chunk rates instead of
    the table's in the code (a rate's key then differs between chunks)."""
    import numpy as np

    from data import manifest_table as mt
    from data.clip_policy import ClipSkip

    monkeypatch.setattr(mt, "PLAN_CHUNK", 7)
    rng = np.random.default_rng(1)
    policy = ClipPolicy(fps=8, max_frames=33, resolution=64, min_frames=5)
    for top in (200, 2**31 - 1):
        m = 300
        table = mt.ManifestTable.from_rows(
            [Row(f"/nowhere/{k}.mp4", "", VideoInfo(int(rng.integers(1, 60)) if k % 50 else top,
                                                      int(rng.choice([32, 64, 480])), int(rng.choice([48, 64])),
                                                      float(rng.choice([8.0, 24.0, 29.97]))))
             for k in range(m)]
        )  # fmt: skip
        rows = rng.permutation(m)[: m - 20]
        kept, metas, skipped = mt.plan_rows(table, rows, policy)
        want_kept, want_metas, want_skipped = [], [], []
        for j in rows.tolist():
            try:
                c = policy.plan(table.info(j))
                want_kept.append(j)
                want_metas.append((c.num_frames, c.height, c.width))
            except ClipSkip as e:
                want_skipped.append((j, e.reason))
        assert kept.tolist() == want_kept and metas.tolist() == [list(x) for x in want_metas], top
        assert [(j, e.reason) for j, e in skipped] == want_skipped and want_skipped, top


def test_the_numpy_decimal_parse_equals_float_of_the_text():
    """_decimals (the CSV fast path's numbers: digits over an exact power of ten) against float() of
    each field, bitwise, on 20,000 random plain decimals up to 15 digits (frame counts, sizes, rates
    such as 29.97 and 23.976024) and edge cases; anything else is None (numpy's own parse then).
    Planted: multiplying by 0.1 ** digits after the dot instead of dividing by 10 ** them (off by an
    ulp for some) -> fails; accepting a second dot -> fails."""
    import numpy as np

    from data.manifest_table import _decimals

    def parse(fields):
        b = [f.encode() for f in fields]
        w = max(3, max(map(len, b)))
        chars = np.zeros((len(b), w), dtype=np.uint8)
        for k, x in enumerate(b):
            chars[k, : len(x)] = np.frombuffer(x, dtype=np.uint8)
        return _decimals(chars, np.array([len(x) for x in b]))

    rng = np.random.default_rng(0)
    fields = ["5.", ".5", "007", "29.97", "23.976024", "0", "999999999999999", "1.00000000000001"]
    for _ in range(20000):
        digits = "".join(rng.choice(list("0123456789"), int(rng.integers(1, 16))))
        dot = int(rng.integers(0, len(digits) + 1))
        fields.append(digits if rng.random() < 0.3 else digits[:dot] + "." + digits[dot:])
    got = parse(fields)
    assert got is not None and got.tobytes() == np.array([float(f) for f in fields]).tobytes()
    for bad in ("1e3", "-1", " 1", "1.2.3", ".", "nan", "1234567890123456", "+2"):
        assert parse(["30", bad]) is None, bad


def test_line_blocks_are_the_lines_of_the_file_at_every_block_size():
    """line_blocks (data/manifest_columns.py; the CSV fast path and the JSONL line offsets both read
    through it) against a byte-by-byte split, at block sizes from 1 byte (every line longer than a
    block) up: blank lines, \\r, quoted newlines (quoted=True only), a quote left open, with and
    without a final newline, after a header line. Planted, each caught: the last line without a
    newline dropped; ``base`` not advanced (offsets of later blocks wrong); quoted newlines cutting
    lines; the quotes of the whole read kept (positions past the block)."""
    import io
    import random

    from data.manifest_columns import line_blocks

    def split(text: bytes, quoted: bool) -> list[tuple[int, bytes]]:
        lines, start, inside = [], 0, False
        for k, byte in enumerate(text):
            if quoted and byte == 34:
                inside = not inside
            elif byte == 10 and not inside:
                lines.append((start, text[start:k]))
                start = k + 1
        return lines + ([(start, text[start:])] if start < len(text) else [])

    rng = random.Random(0)
    texts = [b"", b"\n", b"a", b"\n\n", b'x\n\ny,"a\nb"\r\nlast', b'open "quote\nto the end']
    texts += [bytes(rng.choice(b'ab,"\n\r ') for _ in range(rng.randrange(40))) for _ in range(40)]
    for text in texts:
        for header in (b"", b"path,text\n"):
            for quoted in (False, True):
                want = split(text, quoted)
                for size in (1, 2, 3, 7, 64):
                    f = io.BytesIO(header + text)
                    f.readline() if header else None
                    got = []
                    for block in line_blocks(f, size, quoted):
                        assert block.data == (header + text)[block.base : block.base + len(block.data)]
                        assert block.buf.tobytes() == block.data[: len(block.buf)]
                        bounds = zip(block.starts.tolist(), block.ends.tolist())
                        got += [(block.base + s - len(header), block.data[s:e]) for s, e in bounds]
                        if quoted:
                            assert block.quotes.tolist() == [
                                k for k, c in enumerate(block.buf.tobytes()) if c == 34
                            ]
                    assert got == want, (text, header, quoted, size)
