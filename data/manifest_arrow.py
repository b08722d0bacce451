"""Manifests read through pyarrow (the optional ``[parquet]`` extra) into ``data.manifest_columns``' columns.

- Parquet: only the path, text and metadata columns are read, a batch at a time; a clip's path and
  caption come from its row group when it loads.
- JSONL: ``pyarrow.json`` parses a block of lines at a time into those columns (a schema of the six
  manifest keys, every other key ignored), so no Python dict per line; each line's byte offset comes
  from a numpy pass over the newlines, and a clip's line is parsed again when it loads. Anything the
  columnar read does not take as the line-by-line read would (a line that is not an object, a key of
  another type, a missing or empty path, bad metadata, a line longer than a block) gives None: the
  caller then reads line by line, which names the bad line. Without pyarrow JSONL is read line by line.
"""

from __future__ import annotations

import os

import numpy as np

from data.manifest import COLUMNS, PARQUET_EXTRA
from data.manifest_columns import BLOCK, ManifestTable, Paths, _Columns, _FileRecords, line_blocks


def _parquet(path: str):
    """pyarrow.parquet, or a one-line ValueError naming the extra (pyarrow is optional)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading a Parquet manifest needs pyarrow: {PARQUET_EXTRA}") from None
    return pq


def read_parquet(path: str) -> ManifestTable:
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
        values, has_info, captioned = _batch_columns(batch, path)
        column = pc.fill_null(batch.column("path").cast(pa.string()), "")
        columns.add_columns(Paths.of_arrow(column), values, has_info, captioned, first)
        first += batch.num_rows
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


def _batch_columns(batch, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An Arrow record batch -> (values (m, 4) float64 num_frames, height, width, fps, NaN where a row
    has no metadata; has_info (m,) bool; captioned (m,) bool), as ``_Columns.add_columns`` takes them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names, m = batch.schema.names, batch.num_rows
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
        captioned = pc.fill_null(pc.greater(pc.utf8_length(batch.column("text").cast(pa.string())), 0), False)
        captioned = captioned.to_numpy(zero_copy_only=False)
    else:
        captioned = np.zeros(m, dtype=bool)
    return values, has_info, captioned


def _valid(column) -> np.ndarray:
    """(m,) bool: not null, from the Arrow array's validity bitmap."""
    if column.null_count == 0:
        return np.ones(len(column), dtype=bool)
    bits = np.unpackbits(np.frombuffer(column.buffers()[0], dtype=np.uint8), bitorder="little")
    return bits[column.offset : column.offset + len(column)].astype(bool)


def _typed_columns(batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_batch_columns`` for a batch of read_jsonl's schema (float64 metadata, string text), from the
    arrays' buffers: no pyarrow.compute (its import and a cast per column and batch were 15% of a
    million-line read)."""
    m = batch.num_rows
    values, has_info = np.full((m, 4), np.nan), np.ones(m, dtype=bool)
    for k, name in enumerate(COLUMNS[2:]):
        col = batch.column(name)
        valid = _valid(col)
        if valid.any():
            values[:, k] = np.frombuffer(col.buffers()[1], dtype=np.float64)[col.offset : col.offset + m]
        has_info &= valid
    values[~has_info] = np.nan
    text = batch.column("text")
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32)[text.offset : text.offset + m + 1]
    return values, has_info, _valid(text) & (np.diff(offsets) > 0)


JSONL_BLOCK = 1 << 20  # bytes of lines pyarrow.json parses together (its threads share the blocks: 1 MB
# parsed 1M lines in 1.3 s, 4 MB in 2.0 s); a longer line: read line by line


def read_jsonl(path: str) -> ManifestTable | None:
    """A JSONL manifest through pyarrow.json, or None where it needs the line-by-line read (module
    docstring). Gives what the line-by-line read gives."""
    try:
        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        return None
    if not hasattr(pj, "open_json"):  # pyarrow < 18: no streaming JSON reader
        return None
    schema = pa.schema(
        [("path", pa.string()), ("text", pa.string())] + [(c, pa.float64()) for c in COLUMNS[2:]]
    )
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    with open(path, "rb") as f:
        head = f.read(JSONL_BLOCK).lstrip()
    if not head.startswith(b"{"):
        # pyarrow 26's open_json crashes the process (SIGSEGV) when the first value is null; anything
        # but an object first is the line-by-line read's to name
        return None
    records = _FileRecords(path)
    columns = _Columns(records.root, path)
    first = 1
    try:
        reader = pj.open_json(
            path, read_options=pj.ReadOptions(block_size=JSONL_BLOCK), parse_options=options
        )
        for batch in reader:
            if batch.column("path").null_count:
                return None  # no 'path' key, or null: the line-by-line read names the line
            values, has_info, captioned = _typed_columns(batch)
            columns.add_columns(Paths.of_arrow(batch.column("path")), values, has_info, captioned, first)
            first += batch.num_rows
    except (pa.ArrowException, ValueError):  # bad JSON or metadata: named by the line-by-line read
        return None
    records.offsets = _line_offsets(path)
    if len(records.offsets) != first - 1:
        return None  # pyarrow skipped or split lines otherwise than the line-by-line read
    return columns.table(records)


_SPACE = np.zeros(256, dtype=bool)
_SPACE[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.strip() strips: such a line is skipped


def _line_offsets(path: str) -> np.ndarray:
    """(rows,) int64 byte offset of each line of ``path`` that is not blank, in blocks of ``BLOCK``."""
    out = []
    with open(path, "rb") as f:
        for block in line_blocks(f, BLOCK):
            starts, ends = block.starts, block.ends
            # A line whose first byte is not blank is not blank; the few others are checked one by one.
            keep = (ends > starts) & ~_SPACE[block.buf[np.minimum(starts, len(block.buf) - 1)]]
            for k in np.flatnonzero(~keep).tolist():
                keep[k] = bool(block.data[starts[k] : ends[k]].strip())
            out.append(starts[keep] + block.base)
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)
