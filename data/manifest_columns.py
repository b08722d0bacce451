"""A manifest's rows as columns: a million-row manifest costs each rank a few arrays, not a million objects.
The readers that fill them: data/manifest_table.py (CSV, dispatch) and data/manifest_arrow.py (Parquet, JSONL).

Per row the table holds the source metadata (frames, height, width; fps, NaN where the row has none
yet) and where the row's path and caption are: for a manifest file, the byte offset of its record,
re-read from the file when that clip is loaded (a rank materialises only the rows it loads); for a
folder listing, its strings as UTF-8 bytes end to end (``data.cache_index.strings``). About 30 bytes
a row instead of a ``Row`` with its strings and ``VideoInfo`` (bench/bench_index.py --manifest).

    frames, height, width  (n,) int32    source metadata (0 where not probed yet)
    fps                    (n,) float64  NaN where not probed yet
    missing                (n,) bool     a row with metadata whose file does not exist (checked while reading)
    captioned              (n,) bool     the caption is not empty
"""

from __future__ import annotations

import csv
import io
import json
import os
from array import array
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from data.cache_index import strings
from data.manifest import COLUMNS, Row, info_from
from data.readers import VideoInfo


class ManifestTable:
    """Rows of a manifest (``data.manifest_table.read``) or of a list of ``Row`` (``from_rows``); ``row(j)``
    builds one."""

    def __init__(self, frames, height, width, fps, missing, captioned, records):
        self.frames, self.height, self.width = frames, height, width
        self.fps, self.missing, self.captioned = fps, missing, captioned
        self._records = records  # j -> (absolute path, caption)

    @classmethod
    def from_rows(cls, rows: list[Row]) -> ManifestTable:
        columns = _Columns("", "rows")  # Row paths are absolute, or relative to the working directory
        for i, r in enumerate(rows):
            meta = (
                (None,) * 4
                if r.info is None
                else (r.info.num_frames, r.info.height, r.info.width, r.info.fps)
            )
            columns.add(r.path, r.text, meta, i + 1)
        return columns.table(_MemoryRecords([r.path for r in rows], [r.text for r in rows]))

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def has_info(self) -> np.ndarray:
        return ~np.isnan(self.fps)

    def info(self, j: int) -> VideoInfo | None:
        if np.isnan(self.fps[j]):
            return None
        return VideoInfo(int(self.frames[j]), int(self.height[j]), int(self.width[j]), float(self.fps[j]))

    def set_info(self, j: int, info: VideoInfo) -> None:
        self.frames[j], self.height[j], self.width[j], self.fps[j] = (
            info.num_frames, info.height, info.width, info.fps,
        )  # fmt: skip

    def path(self, j: int) -> str:
        return self._records.get(j)[0]

    def row(self, j: int) -> Row:
        path, text = self._records.get(j)
        return Row(path, text, self.info(j))

    def rows(self) -> list[Row]:
        return [self.row(j) for j in range(len(self))]


class _Columns:
    """Grows the columns in compact arrays, converting and checking the metadata a chunk of rows at a
    time with numpy (a million rows: the per-row Python work is what the start-up time is made of)."""

    CHUNK = 1 << 13  # rows converted together: few numpy calls, a few MB of transient objects

    def __init__(self, root: str, file: str):
        self.root, self.file = root, file
        self.listing = _Listing(root)  # which rows' files exist
        self.ints, self.fps, self.flags = array("i"), array("d"), bytearray()
        self._paths, self._meta, self._lines, self._captioned = [], [], [], bytearray()
        self._pending = None  # (values, has_info, first row) of the add_columns batch being stored

    def add(self, path: str, text: str, meta: tuple, line: int) -> None:
        """``path`` as written (relative to the manifest's folder or absolute); ``meta`` the values of
        num_frames, height, width, fps as read (None or "" where absent)."""
        if not path:
            raise ValueError(f"{self.file}:{line}: empty 'path'")
        self._paths.append(path)
        self._meta.append(meta)
        self._lines.append(line)
        self._captioned.append(bool(text))
        if len(self._paths) == self.CHUNK:
            self._flush()

    def _flush(self) -> None:
        raw = np.array(self._meta, dtype=object).reshape(-1, 4)  # (m, 4)
        has_info = ~((raw == None) | (raw == "")).any(axis=1)  # noqa: E711 (elementwise)
        values = np.full(raw.shape, np.nan)
        try:
            values[has_info] = raw[has_info].astype(np.float64)
        except (ValueError, TypeError):
            self._bad_row()
        self._append(Paths.of(self._paths), values, has_info, self._captioned)
        self._paths, self._meta, self._lines, self._captioned = [], [], [], bytearray()

    def _bad_row(self):
        """Name the first bad row of the chunk, as a row-by-row read would."""
        if self._pending is not None:  # rows given as columns (add_columns)
            values, has_info, first = self._pending
            self._meta = [tuple(v) if h else (None,) * 4 for v, h in zip(values.tolist(), has_info.tolist())]
            self._lines = [f"row {first + k}" for k in range(len(values))]
        for m, line in zip(self._meta, self._lines):
            info_from(dict(zip(COLUMNS[2:], m)), f"{self.file}:{line}")
        raise AssertionError("a bad row passed info_from")  # pragma: no cover

    def add_columns(self, paths: Paths, values: np.ndarray, has_info: np.ndarray, captioned, first: int):
        """Rows given as columns (a Parquet or JSONL batch): ``values`` (m, 4) float64 num_frames, height,
        width, fps (NaN where ``has_info`` is False); ``first`` the number of the first row, for messages."""
        empty = np.flatnonzero(paths.ends == paths.starts)
        if len(empty):
            raise ValueError(f"{self.file}: row {first + int(empty[0])}: empty 'path'")
        # The rows' metadata as _bad_row reads it, built only when a row is bad: a tuple and a string
        # per row for every batch was 40% of a million-row Parquet manifest's first plan.
        self._pending = (values, has_info, first)
        self._append(paths, values, has_info, captioned)
        self._pending = None

    def _append(self, paths, values, has_info, captioned) -> None:
        """Check and store a chunk of rows: ``values`` (m, 4) float64, NaN where ``has_info`` is False."""
        n, h, w, fps = values[has_info].T
        ok = (
            np.isfinite(values[has_info]).all()
            and min(n.min(initial=1), h.min(initial=1), w.min(initial=1)) >= 1
            and (fps > 0).all()
        )
        if not ok:
            self._bad_row()
        ints = np.where(has_info[:, None], values[:, :3], 0).astype(
            np.int32
        )  # int(): as VideoInfo(int(n), ...)
        self.ints.frombytes(ints.tobytes())
        self.fps.frombytes(np.ascontiguousarray(values[:, 3]).tobytes())
        # Rows that carry metadata are trusted without probing, but a missing file is cheap to catch.
        missing = self.listing.missing_in(paths, has_info).astype(np.uint8)
        self.flags.extend((missing | (np.asarray(captioned, dtype=np.uint8) << 1)).tobytes())

    def table(self, records) -> ManifestTable:
        if self._paths:
            self._flush()
        ints = np.frombuffer(self.ints, dtype=np.int32).reshape(-1, 3)
        flags = np.frombuffer(self.flags, dtype=np.uint8)
        fps = np.frombuffer(self.fps, dtype=np.float64).copy()  # writable: probing fills it in
        frames, height, width = (ints[:, k].copy() for k in range(3))
        return ManifestTable(frames, height, width, fps, (flags & 1) > 0, (flags & 2) > 0, records)


class _Listing:
    """Which paths name a regular file (``os.path.isfile``), from one directory listing per folder instead
    of one ``stat`` per row: a million clips in a few thousand folders cost a few thousand ``scandir``
    calls (on a network file system each ``stat`` is a round trip). A folder is held, for one manifest
    read, as the sorted 64-bit hashes of its files' names: 8 bytes a file. Paths arrive as UTF-8 bytes
    (``Paths``) and are split and hashed with numpy, no Python string per row. A name the listing
    lacks is checked with ``os.path.isfile``, so a row is called missing exactly when isfile says so;
    a hash collision can only let a missing file through, which the load then counts
    (``missing_file``)."""

    def __init__(self, root: str):
        self.prefix, self.folders = os.path.join(root, ""), {}

    def _names(self, folder: str) -> np.ndarray:
        got = self.folders.get(folder)
        if got is None:
            try:
                with os.scandir(folder or ".") as entries:
                    names = [e.name.encode("utf-8", "surrogateescape") for e in entries if e.is_file()]
            except OSError:  # absent or unreadable: every row in it is stat'ed
                names = []
            got = np.unique(_hash_bytes(*Paths.of_bytes(names)))
            self.folders[folder] = got
        return got

    def missing(self, paths: list[str], check) -> np.ndarray:
        """(m,) bool: ``not os.path.isfile(root/p)`` for the paths to ``check``, False for the others."""
        return self.missing_in(Paths.of(paths), np.asarray(check, dtype=bool))

    def missing_in(self, paths: Paths, check: np.ndarray) -> np.ndarray:
        out = np.zeros(len(paths), dtype=bool)
        for start in range(0, len(paths), _Columns.CHUNK):  # bounded transient arrays
            rows = start + np.flatnonzero(check[start : start + _Columns.CHUNK])
            if len(rows):
                out[rows] = self._missing_rows(paths, rows)
        for k in np.flatnonzero(out).tolist():
            out[k] = not os.path.isfile(os.path.join(self.prefix, paths.get(k)))
        return out

    def _missing_rows(self, paths: Paths, rows: np.ndarray) -> np.ndarray:
        buf, s, e = paths.buf, paths.starts[rows], paths.ends[rows]
        lo, hi = int(s.min()), int(e.max())  # only this chunk's bytes: a chunk is a slice of a larger buffer
        slashes = np.append(lo + np.flatnonzero(buf[lo:hi] == 47), hi)  # b"/" (and a sentinel at the end)
        last = np.searchsorted(slashes, e) - 1  # the last slash before each path's end ...
        cut = np.where(last >= 0, slashes[np.maximum(last, 0)], -1)
        cut = np.where(cut >= s, cut, -1)  # ... inside the path, else -1: a name only
        absolute = (e > s) & (buf[np.minimum(s, len(buf) - 1)] == 47)
        names = _hash_bytes(buf, np.where(cut >= 0, cut + 1, s), e)
        # one folder per (bytes before the last slash, absolute or not): rows alike resolve alike
        folders = _hash_bytes(buf, s, np.where(cut >= 0, cut, s)) ^ absolute.astype(np.uint64)
        distinct, first, inverse = np.unique(folders, return_index=True, return_inverse=True)
        order = np.argsort(inverse.reshape(-1), kind="stable")
        bounds = np.searchsorted(inverse.reshape(-1)[order], np.arange(len(distinct) + 1))
        out = np.zeros(len(rows), dtype=bool)
        for u, k in enumerate(first.tolist()):
            p = paths.get(int(rows[k]))
            full = p if p.startswith("/") else self.prefix + p
            folder = full.rpartition("/")[0] or ("/" if full.startswith("/") else "")
            group = order[bounds[u] : bounds[u + 1]]
            out[group] = ~np.isin(names[group], self._names(folder))
        return out


class Paths:
    """Strings as UTF-8 bytes: string k is ``buf[starts[k]:ends[k]]`` (a CSV block's fields, an Arrow
    string array's buffers, or strings end to end)."""

    def __init__(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self.buf, self.starts, self.ends = buf, starts, ends

    @classmethod
    def of(cls, values: list[str]) -> Paths:
        buf, offsets = strings(values)
        return cls(buf, offsets[:-1], offsets[1:])

    @classmethod
    def of_bytes(cls, values: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in values], out=offsets[1:])
        return np.frombuffer(b"".join(values), dtype=np.uint8), offsets[:-1], offsets[1:]

    @classmethod
    def of_arrow(cls, column) -> Paths:
        """A pyarrow string array (no nulls) without a Python object per string."""
        _, offsets, data = column.buffers()
        offsets = np.frombuffer(offsets, dtype=np.int32)[column.offset : column.offset + len(column) + 1]
        buf = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
        return cls(buf, offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64))

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, k: int) -> str:
        return self.buf[self.starts[k] : self.ends[k]].tobytes().decode("utf-8", "surrogateescape")


_P, _POWERS = np.uint64(0x100000001B3), [np.ones(1, dtype=np.uint64)]


def _hash_bytes(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """(n,) uint64 hash of each byte string ``buf[starts[k]:ends[k]]``: a polynomial in the bytes
    (mod 2**64, numpy wraps), the length mixed in, then splitmix64's finaliser. Only ever compared with
    itself: a folder listing's names against manifest rows' names."""
    lengths = (ends - starts).astype(np.int64)
    out = lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    total = int(lengths.sum())
    if total:
        top = int(lengths.max())
        if len(_POWERS[0]) <= top:  # P**k for k up to the longest string
            powers = np.full(2 * top + 1, _P)
            powers[0] = 1
            _POWERS[0] = np.cumprod(powers, dtype=np.uint64)
        at = np.cumsum(lengths) - lengths  # each string's first position in the gathered bytes
        positions = np.arange(total) - np.repeat(at - starts, lengths)  # (total,) positions in buf
        exponents = np.repeat(at + lengths - 1, lengths) - np.arange(total)
        terms = buf[positions].astype(np.uint64) * _POWERS[0][exponents]
        full = lengths > 0
        out[full] += np.add.reduceat(terms, at[full])
    out ^= out >> np.uint64(30)
    out *= np.uint64(0xBF58476D1CE4E5B9)
    out ^= out >> np.uint64(27)
    out *= np.uint64(0x94D049BB133111EB)
    return out ^ (out >> np.uint64(31))


class _MemoryRecords:
    def __init__(self, paths: list[str], texts: list[str]):
        self.paths, self.texts = strings(paths), strings(texts)

    def get(self, j: int) -> tuple[str, str]:
        return tuple(b[o[j] : o[j + 1]].tobytes().decode("utf-8") for b, o in (self.paths, self.texts))


class _FileRecords:
    """Records of a manifest file, found again by byte offset. Opened per read, so DataLoader workers
    (forked or spawned) never share a file position."""

    def __init__(self, path: str):
        self.file, self.root, self.offsets = path, os.path.dirname(os.path.abspath(path)), array("q")
        self.jsonl = path.endswith(".jsonl")
        self.fields: list[str] | None = None

    def resolve(self, p: str) -> str:
        return os.path.normpath(p if os.path.isabs(p) else os.path.join(self.root, p))

    def scan(self):
        """(byte offset, line number, path, text, (num_frames, height, width, fps)) of every row, streamed."""
        with open(self.file, "rb") as f:
            if self.jsonl:
                yield from self._scan_jsonl(f)
            else:
                yield from self._scan_csv(f)

    def _scan_jsonl(self, f):
        offset = 0
        for i, line in enumerate(f):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.file}:{i + 1}: not valid JSON ({e}); one object per line") from e
            if not isinstance(r, dict) or "path" not in r:
                raise ValueError(f"{self.file}:{i + 1}: each line needs an object with a 'path' key")
            meta = (r.get("num_frames"), r.get("height"), r.get("width"), r.get("fps"))
            yield start, i + 1, str(r["path"] or ""), r.get("text"), meta

    def _scan_csv(self, f):
        starts = array("q", [0])  # byte offset of each physical line: a quoted field may span lines

        def lines():
            for line in f:
                starts.append(starts[-1] + len(line))
                try:
                    yield line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{self.file}:{len(starts) - 1}: not UTF-8 text ({e.reason} at byte "
                        f"{starts[-2] + e.start}); save it as UTF-8"
                    ) from None

        reader = csv.reader(lines())
        self.fields = next(reader, None)
        if not self.fields or "path" not in self.fields:
            raise ValueError(
                f"{self.file}: the CSV header needs a 'path' column (Open-Sora style: {','.join(COLUMNS)})"
            )
        # Column positions; a short row lacks the last ones (csv.DictReader's restval None).
        at = [self.fields.index(c) if c in self.fields else 1 << 30 for c in COLUMNS]
        while True:
            first = reader.line_num  # physical lines read so far: the next record starts after them
            values = next(reader, None)
            if values is None:
                return
            if not values:
                continue  # a blank line, as csv.DictReader skips it
            n = len(values)
            path, text, *meta = (values[k] if k < n else None for k in at)
            yield starts[first], first + 1, path or "", text, tuple(meta)

    def _record(self, values: list[str]) -> dict:
        return {name: _padded(values)(k) for k, name in enumerate(self.fields)}

    def get(self, j: int) -> tuple[str, str]:
        with open(self.file, "rb") as f:
            f.seek(int(self.offsets[j]))
            if self.jsonl:
                r = json.loads(f.readline())
            else:
                r = self._record(next(csv.reader(io.TextIOWrapper(f, encoding="utf-8", newline=""))))
        return self.resolve(str(r["path"] or "")), str(r.get("text") or "")


def _padded(values: list[str]):
    """values[k], or None past the end of a short row."""
    return lambda k: values[k] if k < len(values) else None


# bytes read at a time by line_blocks' readers (the CSV fast path, JSONL line offsets): transient arrays
# of a few times this
BLOCK = 1 << 21


class LineBlock(NamedTuple):
    """Whole lines of a file from its byte ``base``: ``buf``, the block as uint8 (``len(buf)`` bytes);
    ``data``, the bytes read from that byte on, which may run into the next block (cutting it would copy
    a block), so line k is ``data[starts[k]:ends[k]]``, its newline left out. ``quotes``: the positions
    of '"' in ``buf`` where ``line_blocks`` was asked for quoted lines, else None."""

    base: int
    data: bytes
    buf: np.ndarray
    starts: np.ndarray  # (lines,) int64
    ends: np.ndarray  # (lines,) int64
    quotes: np.ndarray | None


def line_blocks(f, size: int = BLOCK, quoted: bool = False) -> Iterator[LineBlock]:
    """The binary file ``f`` from its position to its end, as blocks of whole lines, ``size`` bytes read
    at a time (a line longer than that is read on until it ends). Blank lines are kept; the last line
    may lack its newline. quoted=True (CSV): a newline inside double quotes does not end a line, and
    each block keeps its quotes; only the last block can hold an odd number (a quote left open)."""
    base, rest = f.tell(), b""
    while True:
        block = f.read(size)
        data = rest + block
        if not data:
            return
        buf = np.frombuffer(data, dtype=np.uint8)
        newlines = np.flatnonzero(buf == 10)
        quotes = np.flatnonzero(buf == 34) if quoted else None
        if quoted:
            newlines = _outside(newlines, quotes)
        if block and not len(newlines):
            rest = data  # one line longer than the block: read more
            continue
        cut = int(newlines[-1]) + 1 if block else len(data)  # at the end of the file: all that is left
        ends = newlines if len(newlines) and newlines[-1] + 1 == cut else np.append(newlines, cut)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64, copy=False)
        kept = quotes[quotes < cut] if quoted else None
        yield LineBlock(base, data, buf[:cut], starts, ends.astype(np.int64, copy=False), kept)
        if not block:
            return
        base, rest = base + cut, data[cut:]


def _outside(positions: np.ndarray, quotes: np.ndarray) -> np.ndarray:
    """The positions (of bytes that are not quotes) outside quoted fields: an even number of quote
    characters before them (a doubled quote inside a field counts twice, so it keeps the parity)."""
    return positions[np.searchsorted(quotes, positions) % 2 == 0]
