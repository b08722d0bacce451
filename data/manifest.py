"""Manifests and folders -> rows of (path, caption, optional metadata).

Manifest format (Open-Sora compatible), CSV with a header or JSONL with one object per line:

    path,text,num_frames,height,width,fps
    clips/a.mp4,"a dog runs on a beach",120,720,1280,30

Only ``path`` is required. Relative paths resolve against the manifest's folder. Rows without
the metadata columns are probed when the dataset is built (``python -m data.scan`` fills them once).
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass

from data.readers import IMAGE_EXTS, VideoInfo

VIDEO_EXTS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v")
MEDIA_EXTS = VIDEO_EXTS + IMAGE_EXTS
COLUMNS = ("path", "text", "num_frames", "height", "width", "fps")
MANIFEST_EXTS = (".csv", ".jsonl", ".parquet")  # .parquet needs pyarrow (the [parquet] extra)
PARQUET_EXTRA = "pip install 'dynamic-cp-video[parquet]'"
PARQUET_ROW_GROUP = 65536  # rows: loading one random clip decodes one group's path and text
# the detail of a manifest row whose file is not there (its one warning line names the fix)
MISSING_FIX = "listed in the manifest but not on disk: fix its path, or rerun python -m data.scan to drop it"


@dataclass
class Row:
    path: str
    """Absolute path of the video."""
    text: str = ""
    info: VideoInfo | None = None
    """Source metadata; None until probed."""


def info_from(record: dict, where: str) -> VideoInfo | None:
    values = [record.get(k) for k in ("num_frames", "height", "width", "fps")]
    if any(v in (None, "") for v in values):
        return None  # not scanned yet: probe later
    try:
        n, h, w, fps = (float(v) for v in values)
        if not (math.isfinite(n + h + w + fps) and min(n, h, w) >= 1 and fps > 0):
            raise ValueError("frames, height and width must be >= 1 and fps > 0, all finite")
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{where}: bad metadata {dict(zip(COLUMNS[2:], values))} ({e}); fix the row or rerun python -m data.scan"
        ) from None
    return VideoInfo(int(n), int(h), int(w), fps)


def list_folder(folder: str | os.PathLike) -> list[Row]:
    """Every video and image under ``folder`` (recursive, sorted); the caption is the sidecar ``<name>.txt``."""
    folder = str(folder)
    rows = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            if os.path.splitext(name)[1].lower() not in MEDIA_EXTS:
                continue
            p = os.path.join(dirpath, name)
            rows.append(Row(os.path.abspath(p), _sidecar_caption(p)))
    return rows


def _sidecar_caption(video_path: str) -> str:
    txt = os.path.splitext(video_path)[0] + ".txt"
    try:
        with open(txt, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""  # no caption: trained unconditionally; the dataset reports how many


def check_manifest_out(out: str) -> None:
    """A one-line ValueError, before anything is probed or written, where ``out`` cannot be written."""
    if not out.endswith(MANIFEST_EXTS):
        raise ValueError(f"{out}: the output manifest must end in .csv, .jsonl or .parquet")
    if out.endswith(".parquet"):
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ValueError(f"{out}: writing a Parquet manifest needs pyarrow: {PARQUET_EXTRA}") from None


def write_manifest(rows: list[Row], out: str | os.PathLike, relative: bool = True) -> None:
    """Write rows as .csv, .jsonl or .parquet (the same columns; Parquet: nulls where a row has no
    metadata, row groups of ``PARQUET_ROW_GROUP`` rows). With ``relative`` paths are stored relative
    to the manifest."""
    out = str(out)
    check_manifest_out(out)
    root = os.path.dirname(os.path.abspath(out))
    records = []
    for r in rows:
        rec = {"path": os.path.relpath(r.path, root) if relative else r.path, "text": r.text}
        i = r.info
        if i is not None:
            rec.update(num_frames=i.num_frames, height=i.height, width=i.width, fps=round(i.fps, 6))
        records.append(rec)
    os.makedirs(root, exist_ok=True)
    if out.endswith(".jsonl"):
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    elif out.endswith(".csv"):
        with open(out, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(records)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        types = (pa.string(), pa.string(), pa.int64(), pa.int64(), pa.int64(), pa.float64())
        schema = pa.schema(list(zip(COLUMNS, types)))
        table = pa.table({c: [rec.get(c) for rec in records] for c in COLUMNS}, schema=schema)
        pq.write_table(table, out, row_group_size=PARQUET_ROW_GROUP)
