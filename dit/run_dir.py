"""One run per ``output_dir``: a new run never appends to an earlier run's metrics or checkpoints.

A directory that holds ``metrics.jsonl`` or ``checkpoints/`` belongs to a run. Training into it is
refused unless the new run continues it (``--resume``) or ``--overwrite`` moves the old run aside to
a numbered sibling (``runs/tiny`` -> ``runs/tiny.old-1``). Nothing is ever deleted, except the
metric lines of a run that died before its first checkpoint, when ``--resume auto`` starts it again
from step 0 (it logs the same steps anew).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

RUN_FILES = ("metrics.jsonl", "checkpoints")


def _inside(path: Path, root: Path) -> bool:
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def prepare_output_dir(output_dir: str, resume: str | None, overwrite: bool, is_main: bool) -> Path | None:
    """Refuse or move aside a used ``output_dir``. Returns where the old run went, if it was moved.

    Only the main rank moves anything; under torchrun the other ranks write nothing to output_dir,
    so they need not wait for it."""
    out = Path(output_dir)
    found = [name for name in RUN_FILES if (out / name).exists()]
    resumes_here = resume is not None and _inside(Path(resume), out)
    if overwrite and resumes_here:
        raise ValueError(
            f"--overwrite would move aside the run in {out} that --resume continues; drop one of the two"
        )
    if not found or resumes_here:
        return None
    if not overwrite:
        raise ValueError(
            f"output_dir {out} already holds a run ({' and '.join(found)}); continue it with --resume, "
            f"choose a new output_dir=..., or pass --overwrite to move the old run aside"
        )
    if not is_main:
        return None
    n = 1
    while (aside := out.with_name(f"{out.name}.old-{n}")).exists():
        n += 1
    os.replace(out, aside)  # a rename: the old run stays whole, next to the new one
    print(f"moved the earlier run in {out} to {aside}")
    return aside


def drop_metrics_of_unsaved_run(output_dir: str) -> None:
    """``--resume auto`` found no checkpoint: the run starts again at step 0, so the lines a run that
    died before its first checkpoint logged would appear twice. They go (atomically: temp + rename)."""
    path = Path(output_dir) / "metrics.jsonl"
    if path.is_file() and path.stat().st_size:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("")
        os.replace(tmp, path)
        print(f"dropped the metrics in {path} of the run that stopped before its first checkpoint")


def _step_of(line: str) -> float:
    """The step of one metrics.jsonl line; infinity for a line cut short (it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return math.inf


def truncate_metrics(out: Path, step: int) -> None:
    """A resumed run rewrites history after its checkpoint, so the log reads like one clean run."""
    path = out / "metrics.jsonl"
    if path.exists():
        # a line cut by the kill (no closing brace) is dropped with the later ones
        kept = [line for line in path.read_text().splitlines() if _step_of(line) <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)  # a kill while truncating leaves the old or the new log, whole
