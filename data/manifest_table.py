"""Manifest files -> ``ManifestTable`` columns (data/manifest_columns.py), and the clip policy over them.

- ``read`` / ``read_table``: a .csv manifest parsed with numpy a block at a time (``_read_csv_fast``;
  the csv module row by row where it must), .jsonl and .parquet through pyarrow
  (data/manifest_arrow.py; JSONL line by line without pyarrow).
- ``plan_rows``: the clip policy's shape of every row, once per distinct source metadata.
"""

from __future__ import annotations

import csv
import os

import numpy as np

from data.manifest import COLUMNS, MANIFEST_EXTS, Row
from data.manifest_columns import (
    BLOCK,
    LineBlock,
    ManifestTable,
    Paths,
    _Columns,
    _FileRecords,
    _outside,
    line_blocks,
)
from data.readers import VideoInfo

__all__ = ["BLOCK", "ManifestTable", "plan_rows", "read", "read_manifest", "read_table"]


def read(path: str, fast: bool = True) -> ManifestTable:
    """Stream a .csv, .jsonl or .parquet manifest (bad rows raise ``ValueError`` naming the line).
    fast=False reads a CSV row by row with the csv module (what the numpy parse falls back to) and
    a JSONL file line by line with the json module (what the pyarrow.json read falls back to)."""
    from data import manifest_arrow  # Parquet and columnar JSONL: pyarrow, an optional extra

    if path.endswith(".parquet"):
        return manifest_arrow.read_parquet(path)
    if fast and path.endswith((".csv", ".jsonl")):
        table = _read_csv_fast(path) if path.endswith(".csv") else manifest_arrow.read_jsonl(path)
        if table is not None:
            return table
    records = _FileRecords(path)
    columns = _Columns(records.root, path)
    for offset, line, p, text, meta in records.scan():
        columns.add(p, text, meta, line)
        records.offsets.append(offset)
    records.offsets = np.frombuffer(records.offsets, dtype=np.int64)
    return columns.table(records)


def _read_csv_fast(path: str) -> ManifestTable | None:
    """A CSV manifest parsed with numpy, a block of records at a time, no Python per field: quotes are
    found by the parity of the quote characters before each byte, so a comma or newline outside quotes
    is a delimiter. None where the file needs the csv module (rows of another width, quoted paths or
    numbers, numbers numpy does not parse, bad metadata, a byte that is not UTF-8): ``read``
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
        offsets = []
        for block in line_blocks(f, BLOCK, quoted=True):
            if len(block.quotes) % 2:
                return None  # a quote left open at the end of the file
            part = _csv_block(block, fields, width)
            if part is None:
                return None
            paths, values, has_info, captioned, starts = part
            columns._append(paths, values, has_info, captioned)
            offsets.append(starts + block.base)
    records.offsets = np.concatenate(offsets) if offsets else np.zeros(0, dtype=np.int64)
    return columns.table(records)


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


def _csv_block(block: LineBlock, fields, width):
    """A block of whole records -> (paths, values, has_info, captioned, record starts) as
    _Columns._append takes them, or None (see _read_csv_fast)."""
    buf, quotes, starts, ends = block.buf, block.quotes, block.starts, block.ends
    try:
        block.data[: len(buf)].decode("utf-8")
    except UnicodeDecodeError:
        return None
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


def read_table(path: str | os.PathLike, fast: bool = True) -> ManifestTable:
    """The manifest as a ``ManifestTable``: columns, no object per row (``fast``: as ``read``)."""
    path = str(path)
    if not path.endswith(MANIFEST_EXTS):
        raise ValueError(f"{path}: a manifest must end in .csv, .jsonl or .parquet")
    try:
        return read(path, fast)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except csv.Error as e:
        raise ValueError(f"{path}: not a readable CSV file ({e})") from None
