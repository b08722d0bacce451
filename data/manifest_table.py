"""A manifest's rows as columns: a million-row manifest costs each rank a few arrays, not a million objects.

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

import numpy as np

from data.cache_index import strings
from data.manifest import COLUMNS, MANIFEST_EXTS, Row, info_from
from data.readers import VideoInfo


class ManifestTable:
    """Rows of a manifest (``read``) or of a list of ``Row`` (``from_rows``); ``row(j)`` builds one."""

    def __init__(self, frames, height, width, fps, missing, captioned, records):
        self.frames, self.height, self.width = frames, height, width
        self.fps, self.missing, self.captioned = fps, missing, captioned
        self._records = records  # j -> (absolute path, caption)

    @classmethod
    def read(cls, path: str, fast: bool = True) -> ManifestTable:
        """Stream a .csv, .jsonl or .parquet manifest (bad rows raise ``ValueError`` naming the line).
        fast=False reads a CSV row by row with the csv module (what the numpy parse falls back to)."""
        if path.endswith(".parquet"):
            return _read_parquet(path)
        if fast and path.endswith(".csv"):
            table = _read_csv_fast(path)
            if table is not None:
                return table
        records = _FileRecords(path)
        columns = _Columns(records.root, path)
        for offset, line, p, text, meta in records.scan():
            columns.add(p, text, meta, line)
            records.offsets.append(offset)
        records.offsets = np.frombuffer(records.offsets, dtype=np.int64)
        return columns.table(records)

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
        slashes = np.append(np.flatnonzero(buf == 47), len(buf))  # b"/" (and a sentinel past the end)
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


# bytes of CSV records parsed together by _read_csv_fast: transient arrays of a few times this
BLOCK = 1 << 21


def _read_csv_fast(path: str) -> ManifestTable | None:
    """A CSV manifest parsed with numpy, a block of records at a time, no Python per field: quotes are
    found by the parity of the quote characters before each byte, so a comma or newline outside quotes
    is a delimiter. None where the file needs the csv module (rows of another width, quoted paths or
    numbers, numbers numpy does not parse, bad metadata, a byte that is not UTF-8): ``ManifestTable.read``
    then reads it row by row and names the bad row. Gives what the row-by-row read gives."""
    records = _FileRecords(path)
    with open(path, "rb") as f:
        header = f.readline()
        try:
            fields = next(csv.reader([header.decode("utf-8")]), None)
        except (UnicodeDecodeError, csv.Error):
            return None
        if not fields or "path" not in fields or b'"' in header:
            return None
        records.fields, width = fields, len(fields)
        columns = _Columns(records.root, path)
        offsets, base, rest = [], len(header), b""
        while True:
            block = f.read(BLOCK)
            data = rest + block
            if not data:
                break
            buf = np.frombuffer(data, dtype=np.uint8)
            quotes = np.flatnonzero(buf == 34)  # a byte is inside quotes after an odd number of them
            newlines = _outside(np.flatnonzero(buf == 10), quotes)
            if block and not len(newlines):
                rest = data  # one record longer than the block: read more
                continue
            if not block and len(quotes) % 2:
                return None  # a quote left open at the end of the file
            cut = int(newlines[-1]) + 1 if block else len(data)
            ends = (
                newlines
                if block or (len(newlines) and newlines[-1] == len(data) - 1)
                else np.append(newlines, len(data))
            )
            part = _csv_block(data[:cut], buf[:cut], quotes[quotes < cut], ends, fields, width)
            if part is None:
                return None
            paths, values, has_info, captioned, starts = part
            columns._append(paths, values, has_info, captioned)
            offsets.append(starts + base)
            base, rest = base + cut, data[cut:]
            if not block:
                break
    records.offsets = np.concatenate(offsets) if offsets else np.zeros(0, dtype=np.int64)
    return columns.table(records)


def _outside(positions: np.ndarray, quotes: np.ndarray) -> np.ndarray:
    """The positions (of bytes that are not quotes) outside quoted fields: an even number of quote
    characters before them (a doubled quote inside a field counts twice, so it keeps the parity)."""
    return positions[np.searchsorted(quotes, positions) % 2 == 0]


_POW10 = np.array([float(10**k) for k in range(16)])  # exact: int -> float rounds correctly, 10**15 < 2**53


def _decimals(chars: np.ndarray, length: np.ndarray) -> np.ndarray | None:
    """(n, w) uint8 fields (0 past each field's ``length``) of plain decimals (digits and at most one
    dot, at most 15 digits) -> (n,) float64 equal to ``float(field)``, or None for anything else (signs,
    exponents, spaces, 'nan': numpy's parse then). Exact: the digits as an integer below 2**53, divided
    by an exact power of ten, is one correctly rounded division, as float() of the text is."""
    inside = np.arange(chars.shape[1]) < length[:, None]
    digit, dot = (chars >= 48) & (chars <= 57), chars == 46
    num_digits = digit.sum(axis=1)
    if (inside & ~digit & ~dot).any() or (dot.sum(axis=1) > 1).any() or (num_digits > 15).any():
        return None
    if ((num_digits == 0) & (length > 0)).any():
        return None  # "." alone
    mantissa = np.zeros(len(chars), dtype=np.int64)
    for j in range(chars.shape[1]):
        mantissa = np.where(digit[:, j], mantissa * 10 + (chars[:, j].astype(np.int64) - 48), mantissa)
    has_dot = dot.any(axis=1)
    after = np.where(has_dot, length - 1 - dot.argmax(axis=1), 0)  # digits after the dot
    return mantissa / _POW10[after]


def _csv_block(data: bytes, buf, quotes, ends, fields, width):
    """Whole records ``data`` (ends: the position of each record's end) -> (paths, values, has_info,
    captioned, record starts) as _Columns._append takes them, or None (see _read_csv_fast)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    ends = ends - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13))  # a \r\n line ending
    keep = ends > starts  # blank lines are skipped, as csv.reader skips them
    starts, ends = starts[keep], ends[keep]
    commas = _outside(np.flatnonzero(buf == 44), quotes)
    first = np.searchsorted(commas, starts)
    if not (np.searchsorted(commas, ends) - first == width - 1).all():
        return None  # a short or long row: the csv module's rules
    at = commas[first[:, None] + np.arange(width - 1)] if width > 1 else np.zeros((len(starts), 0), np.int64)
    bounds = np.concatenate([starts[:, None] - 1, at, ends[:, None]], axis=1)  # (n, width + 1)

    def field(name):
        k = fields.index(name)
        return bounds[:, k] + 1, bounds[:, k + 1]  # start, end of the field in each record

    n = len(starts)
    values, has_info = np.full((n, 4), np.nan), np.ones(n, dtype=bool)
    for c, name in enumerate(COLUMNS[2:]):
        if name not in fields:
            has_info[:] = False
            continue
        s, e = field(name)
        length = e - s
        if n and length.max() > 32:
            return None
        w = max(3, int(length.max(initial=0)))
        gathered = np.where(
            np.arange(w) < length[:, None], buf[np.minimum(s[:, None] + np.arange(w), len(buf) - 1)], 0
        )
        if (gathered == 34).any():
            return None
        has_info &= length > 0
        parsed = _decimals(gathered, length)
        if parsed is None:
            text = np.ascontiguousarray(gathered.astype(np.uint8)).view(f"S{w}").reshape(n)
            text[length == 0] = b"nan"
            try:
                parsed = text.astype(np.float64)
            except ValueError:
                return None
        values[:, c] = parsed
    values[~has_info] = np.nan
    v = values[has_info]
    if not (np.isfinite(v).all() and (v[:, :3] >= 1).all() and (v[:, 3] > 0).all()):
        return None
    s, e = field("path")
    if not (e > s).all() or (buf[s] == 34).any():
        return (
            None  # an empty path (named by the row-by-row read) or a quoted one (the csv module unquotes it)
        )
    paths = Paths(buf, s, e)
    if "text" in fields:
        s, e = field("text")
        captioned = (e > s) & ~((e - s == 2) & (buf[np.minimum(s, len(buf) - 1)] == 34))  # "" is empty
    else:
        captioned = np.zeros(n, dtype=bool)
    return paths, values, has_info, captioned.tolist(), starts


PARQUET_EXTRA = "pip install 'dynamic-cp-video[parquet]'"


def _parquet(path: str):
    """pyarrow.parquet, or a one-line ValueError naming the extra (pyarrow is optional)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading a Parquet manifest needs pyarrow: {PARQUET_EXTRA}") from None
    return pq


def _read_parquet(path: str) -> ManifestTable:
    """A Parquet manifest, the same columns as a CSV one: only path, text and the metadata are read, a
    batch of ``_Columns.CHUNK`` rows at a time; a clip's path and caption are read again when it loads."""
    pq = _parquet(path)  # first: a missing pyarrow is the line naming the extra
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        f = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0][:200]})") from None
    names = f.schema_arrow.names
    if "path" not in names:
        raise ValueError(
            f"{path}: a Parquet manifest needs a 'path' column (Open-Sora style: {','.join(COLUMNS)})"
        )
    records = _ParquetRecords(path, f)
    columns = _Columns(records.root, path)
    first = 1
    for batch in f.iter_batches(batch_size=_Columns.CHUNK, columns=[c for c in COLUMNS if c in names]):
        m = batch.num_rows
        values, has_info = np.full((m, 4), np.nan), np.ones(m, dtype=bool)
        for k, name in enumerate(COLUMNS[2:]):
            if name not in names:
                has_info[:] = False
                continue
            col = batch.column(name)
            try:
                values[:, k] = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValueError(
                    f"{path}: column {name!r} is not numeric ({str(e)[:120]}); fix it or rerun python -m data.scan"
                ) from None
            has_info &= ~col.is_null().to_numpy(zero_copy_only=False)
        values[~has_info] = np.nan
        if "text" in names:
            captioned = pc.fill_null(
                pc.greater(pc.utf8_length(batch.column("text").cast(pa.string())), 0), False
            )
            captioned = captioned.to_numpy(zero_copy_only=False)
        else:
            captioned = np.zeros(m, dtype=bool)
        column = pc.fill_null(batch.column("path").cast(pa.string()), "")
        columns.add_columns(Paths.of_arrow(column), values, has_info, captioned, first)
        first += m
    return columns.table(records)


class _ParquetRecords:
    """Path and caption of row j, read from its row group (those two columns only) when the clip loads;
    the last row group read is kept, so rows of one group cost one read. Opened per read, as
    ``_FileRecords``: DataLoader workers never share a file handle."""

    def __init__(self, path: str, f):
        self.file, self.root = path, os.path.dirname(os.path.abspath(path))
        sizes = [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)]
        self.starts = np.cumsum([0] + sizes)  # (groups + 1,) first row of each group
        self.has_text = "text" in f.schema_arrow.names
        self._group, self._cols = -1, None

    def __getstate__(self):  # a DataLoader worker gets the index, not a cached row group
        return {**self.__dict__, "_group": -1, "_cols": None}

    def get(self, j: int) -> tuple[str, str]:
        g = int(np.searchsorted(self.starts, j, side="right")) - 1
        if g != self._group:
            pq = _parquet(self.file)
            columns = ["path", "text"] if self.has_text else ["path"]
            t = pq.ParquetFile(self.file).read_row_group(g, columns=columns)
            self._group, self._cols = g, [t.column(c) for c in columns]
        k = j - int(self.starts[g])
        path = self._cols[0][k].as_py() or ""
        text = (self._cols[1][k].as_py() if self.has_text else None) or ""
        return os.path.normpath(path if os.path.isabs(path) else os.path.join(self.root, path)), str(text)


class _KeyCode:
    """(frames, height, width, fps) rows <-> one int64 key a row, bits side by side (fps by its rank
    among the distinct rates), where the values fit in 63 bits. The same code for every chunk of a
    table, so keys compare across chunks."""

    def __init__(self, rates: np.ndarray, maxima: list[int]):
        self.rates = rates  # (r,) sorted distinct fps
        self.bits = [max(1, m.bit_length()) for m in maxima + [len(rates) - 1]]

    @classmethod
    def fit(cls, frames, height, width, fps) -> _KeyCode | None:
        """A code for these columns (indexable by the same rows), None where a row does not fit."""
        columns = (frames, height, width)
        if not len(fps):
            return cls(np.zeros(0), [0, 0, 0])
        rates = np.unique(fps)
        if np.isnan(rates).any() or min(int(c.min()) for c in columns) < 0:
            return None
        code = cls(rates, [int(c.max()) for c in columns])
        return code if sum(code.bits) <= 63 else None

    def encode(self, frames, height, width, fps) -> np.ndarray:
        key = np.zeros(len(frames), dtype=np.int64)
        columns = (frames, height, width, np.searchsorted(self.rates, fps))
        for c, b in zip(columns, self.bits):
            key = (key << b) | c.astype(np.int64)
        return key

    def decode(self, keys: np.ndarray) -> np.ndarray:
        """(k,) keys -> (k, 4) float64 rows."""
        out = np.empty((len(keys), 4))
        for k in (3, 2, 1, 0):  # the last column is in the lowest bits
            out[:, k] = keys & ((1 << self.bits[k]) - 1)
            keys = keys >> self.bits[k]
        out[:, 3] = self.rates[out[:, 3].astype(np.int64)]
        return out


def _distinct_rows(frames, height, width, fps) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(rows of (frames, height, width, fps), axis=0, return_inverse=True), through one int64
    key a row where the values fit in 63 bits (a 1-D sort: several times faster than the rows' sort)."""
    code = _KeyCode.fit(frames, height, width, fps)
    if code is None:
        source = np.stack([frames, height, width, fps], axis=1)  # (m, 4)
        distinct, inverse = np.unique(source, axis=0, return_inverse=True)
        return distinct, inverse.reshape(-1)
    keys, inverse = np.unique(code.encode(frames, height, width, fps), return_inverse=True)
    return code.decode(keys), inverse.reshape(-1)


PLAN_CHUNK = 1 << 16  # rows of plan_rows' sorts: a few MB of transient keys, never a copy of every row


def plan_rows(table: ManifestTable, rows: np.ndarray, policy) -> tuple[np.ndarray, np.ndarray, list]:
    """The clip policy's shape of each of ``rows`` (table rows with metadata) -> (the rows it keeps,
    their (frames, height, width) as an (n, 3) int32 array, [(row, ClipSkip)] of the rows it rejects).

    The policy runs once per distinct source metadata (a million clips share far fewer (frames,
    height, width, fps)), in chunks, so the sort that finds the distinct rows never copies every row.
    One key code for the whole table, so a chunk's distinct rows planned before are found with a
    search, not a Python loop (a million rows of 1-40 s clips: ~230k loop turns became ~15k)."""
    from data.clip_policy import ClipSkip

    t, plans = table, {}  # (frames, height, width, fps) -> ClipMeta or ClipSkip

    def shapes(distinct: np.ndarray) -> np.ndarray:
        """(k, 4) source rows -> (k, 3) int32 planned shapes, (-1, -1, -1) where the policy skips."""
        out = np.zeros((len(distinct), 3), dtype=np.int32)
        for u, (n, h, w, fps) in enumerate(distinct.tolist()):
            if (n, h, w, fps) not in plans:
                try:
                    plans[n, h, w, fps] = policy.plan(VideoInfo(int(n), int(h), int(w), fps))
                except ClipSkip as e:
                    plans[n, h, w, fps] = e
            m = plans[n, h, w, fps]
            out[u] = (-1, -1, -1) if isinstance(m, ClipSkip) else (m.num_frames, m.height, m.width)
        return out

    chunks = [rows[s : s + PLAN_CHUNK] for s in range(0, len(rows), PLAN_CHUNK)]
    code = None
    if len(rows):  # the code of the whole table, from each chunk's distinct rates and maxima
        rates = np.unique(np.concatenate([np.unique(t.fps[r]) for r in chunks]))
        tops = [max(int(c[r].max()) for r in chunks) for c in (t.frames, t.height, t.width)]
        low = min(int(c[r].min()) for r in chunks for c in (t.frames, t.height, t.width))
        code = _KeyCode(rates, tops) if low >= 0 and not np.isnan(rates).any() else None
        code = code if code is not None and sum(code.bits) <= 63 else None
    known, known_shapes = np.zeros(0, dtype=np.int64), np.zeros((0, 3), dtype=np.int32)  # sorted keys
    metas = np.zeros((len(rows), 3), dtype=np.int32)  # -1: the policy skips the row
    start = 0
    for r in chunks:
        if code is None:  # metadata too wide for one key (or NaN): each chunk on its own
            distinct, inverse = _distinct_rows(t.frames[r], t.height[r], t.width[r], t.fps[r])
            planned = shapes(distinct)
        else:
            keys, inverse = np.unique(
                code.encode(t.frames[r], t.height[r], t.width[r], t.fps[r]), return_inverse=True
            )
            at = np.searchsorted(known, keys)
            seen = at < len(known)
            seen[seen] = known[at[seen]] == keys[seen]
            if not seen.all():
                new = keys[~seen]
                known = np.concatenate([known, new])
                known_shapes = np.concatenate([known_shapes, shapes(code.decode(new))])
                order = np.argsort(known, kind="stable")
                known, known_shapes = known[order], known_shapes[order]
            planned = known_shapes[np.searchsorted(known, keys)]
        metas[start : start + len(r)] = planned[inverse.reshape(-1)]
        start += len(r)
    ok = metas[:, 0] > 0
    skipped = [(j, plans[t.frames[j].item(), t.height[j].item(), t.width[j].item(), t.fps[j].item()])
               for j in rows[~ok].tolist()]  # fmt: skip
    return rows[ok], metas[ok], skipped


def read_manifest(path: str | os.PathLike) -> list[Row]:
    """Rows of a .csv, .jsonl or .parquet manifest; relative paths are resolved against the manifest folder."""
    return read_table(path).rows()


def read_table(path: str | os.PathLike):
    """The manifest as a ``data.manifest_table.ManifestTable``: columns, no object per row."""
    path = str(path)
    if not path.endswith(MANIFEST_EXTS):
        raise ValueError(f"{path}: a manifest must end in .csv, .jsonl or .parquet")
    try:
        return ManifestTable.read(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except csv.Error as e:
        raise ValueError(f"{path}: not a readable CSV file ({e})") from None
