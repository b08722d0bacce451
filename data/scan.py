"""Probe videos in parallel and write a manifest with the metadata columns filled in.

    python -m data.scan VIDEO_FOLDER_OR_MANIFEST --out manifest.csv [--workers 8] [--reader auto]
    python -m data.scan VIDEO_FOLDER_OR_MANIFEST --out manifest.parquet   # the same columns (pyarrow)

Files that fail to probe are left out of the manifest and listed, with reasons, in
``<out>.failures.csv`` and in the printed summary. Nothing is dropped silently.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from data.cli import add_debug_flag, run_cli
from data.failures import FailureLog, warnings_above_bars
from data.manifest import MANIFEST_EXTS, MISSING_FIX, Row, check_manifest_out, list_folder, write_manifest
from data.manifest_table import read_manifest
from data.readers import BACKENDS, VideoReadError, check_backend, probe


def read_rows(source: str) -> list[Row]:
    if os.path.isdir(source):
        return list_folder(source)
    if source.endswith(MANIFEST_EXTS):
        if not os.path.isfile(source):
            raise ValueError(f"manifest {source} does not exist")
        return read_manifest(source)
    raise ValueError(f"{source}: give a folder of videos or a .csv/.jsonl/.parquet manifest")


def probe_rows(
    rows: list[Row], failures: FailureLog, num_workers: int = 8, backend: str = "auto", progress: bool = True
) -> list[Row]:
    """Fill ``row.info`` for rows that lack it. Returns the rows that probed; failures are recorded.

    Threads are enough: decord and PyAV release the GIL inside the demuxer and decoder.
    """
    for r in rows:
        if r.info is not None and not os.path.isfile(r.path):
            # Rows that carry metadata are trusted without probing, but a missing file is cheap to catch.
            failures.fail(r.path, "missing_file", MISSING_FIX, check=False)
    rows = [r for r in rows if r.path not in failures.failed]
    todo = [r for r in rows if r.info is None]

    def one(row: Row):
        try:
            return probe(row.path, backend), None
        except VideoReadError as e:
            return None, e

    with ThreadPoolExecutor(max(1, num_workers)) as pool, warnings_above_bars():
        results = pool.map(one, todo)
        for row, (info, err) in tqdm(
            zip(todo, results), total=len(todo), desc="probing videos", disable=not progress or not todo
        ):
            row.info = info
            if err is not None:
                failures.fail(row.path, err.reason, err.detail, check=False)
    return [r for r in rows if r.info is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.scan", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "source", help="folder of videos (captions from sidecar .txt) or a .csv/.jsonl/.parquet manifest"
    )
    ap.add_argument("--out", required=True, help="output manifest, .csv, .jsonl or .parquet (pyarrow)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument(
        "--reader", "--backend", dest="reader", default="auto", choices=BACKENDS,
        help="video reader, as data.reader: auto (the first that loads: torchcodec, decord, PyAV), "
        "torchcodec, decord or pyav (--backend: its old name)",
    )  # fmt: skip
    ap.add_argument("--rescan", action="store_true", help="probe rows that already have metadata too")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    return run_cli(lambda: run(args), args.debug)


def run(args) -> int:
    check_manifest_out(args.out)  # a bad --out (or Parquet without pyarrow): one line before any probe
    rows = read_rows(args.source)
    if args.rescan:
        for r in rows:
            r.info = None
    failures = FailureLog(total=len(rows), max_failure_share=1.0)
    check_backend(args.reader)  # one that is not installed: one line before any file is probed
    good = probe_rows(rows, failures, args.workers, args.reader)
    write_manifest(good, args.out)
    fail_path = args.out + ".failures.csv"
    if failures.failed:
        with open(fail_path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["path", "reason"])
            w.writerows(failures.failed.items())
    print(failures.summary())
    print(
        f"wrote {len(good)} rows to {args.out}"
        + (f"; failures listed in {fail_path}" if failures.failed else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
