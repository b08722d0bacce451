"""Is a checkpoint whole? A cheap check (file headers and sizes, no tensor is loaded), and the newest
whole checkpoint of a run, skipping the ones that are not.

Checkpoints are committed by rename (``dit/checkpoint.py``), so a crash leaves at most a
``step_X.tmp`` folder. What else makes one unusable comes from outside: a disk or network file
system that lost the tail of a file, a copy cut short, a file edited by hand. The checks, per file:

- ``*.safetensors``: the 8-byte header length, the JSON header, and a file size equal to header +
  the end of the last tensor (a truncated file is shorter);
- ``trainer.pt`` (a zip written by ``torch.save``): the zip's central directory, which sits at the
  end of the file, and every member inside the file's size;
- ``sharded/`` (DCP): its ``.metadata``, which DCP writes last, after every rank's shards (as
  torchtitan does, a folder without it is ignored). The metadata is a pickle, so it is not opened
  here; DCP's load reads it.
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

STEP_DIR = re.compile(r"step_(\d+)(\.tmp)?$")


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or None."""
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is truncated ({size} bytes)"
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            return f"{path.name} is truncated (header of {header_len} bytes, file of {size})"
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return f"{path.name} has an unreadable header"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return f"{path.name} is truncated ({size:,} bytes of {expected:,})"
    return None


def torch_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole ``torch.save`` zip, or None (the zip directory, no unpickling)."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError) as err:
        return f"{path.name} is unreadable ({err})"
    for info in infos:
        if info.header_offset + info.compress_size > size:
            return f"{path.name} is truncated (member {info.filename} ends past the file)"
    if not any(info.filename.endswith("data.pkl") for info in infos):
        return f"{path.name} is not a torch file (no data.pkl)"
    return None


def checkpoint_problem(step_dir: Path) -> str | None:
    """Why ``step_dir`` cannot be resumed from, or None when it is whole."""
    if step_dir.name.endswith(".tmp"):
        return "left by a save that did not finish (a crash or a full disk)"
    problem = torch_file_problem(step_dir / "trainer.pt")
    if problem:
        return problem
    model = step_dir / "model"
    if not model.is_dir():
        return "model/ holds no safetensors weights"
    # A14B's two experts (model.expert=both) save a diffusers folder: one subfolder per expert
    for part in sorted(p for p in model.glob("transformer*") if p.is_dir()) or [model]:
        if not any(part.glob("*.safetensors")):
            return f"{part.relative_to(step_dir)}/ holds no safetensors weights"
    for path in sorted(step_dir.rglob("*.safetensors")):  # model/, ema/ (and their experts' folders)
        problem = safetensors_problem(path)
        if problem:
            return f"{path.parent.relative_to(step_dir)}/{problem}"
    for index in sorted(step_dir.rglob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError):
            return f"{index.parent.relative_to(step_dir)}/{index.name} is unreadable"
        missing = sorted(s for s in shards if not (index.parent / s).is_file())
        if missing:
            return f"{index.parent.relative_to(step_dir)}/{missing[0]} is missing"
    sharded = step_dir / "sharded"
    if sharded.is_dir() and not (sharded / ".metadata").is_file():
        return "sharded/.metadata is missing (DCP writes it last: the save did not finish)"
    return None


def step_dirs(root: Path) -> list[Path]:
    """``step_*`` folders under ``root`` (output_dir/checkpoints), newest step first; a ``.tmp``
    folder sorts before the finished folder of the same step."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, key=lambda sp: (sp[0], sp[1].name.endswith(".tmp")), reverse=True)]


def newest_whole_checkpoint(root: Path, report: Callable[[str], None] = print) -> Path | None:
    """The newest whole ``step_*`` folder under ``root``, or None; each newer folder that is not
    whole is reported (one line, with the reason) and skipped."""
    if not root.is_dir():
        return None
    for step_dir in step_dirs(root):
        problem = checkpoint_problem(step_dir)
        if problem is None:
            return step_dir
        report(f"skipping checkpoint {step_dir}: {problem}")
    return None
