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
  here; DCP's load reads it;
- ``stages/stage_{p}/`` (pipeline stages): one folder for each of the run's ``parallel.pp_size``
  stages (read from the checkpoint's ``config.yaml``), each with its ``model.safetensors`` and
  ``optim.safetensors``.

``checkpoint_format`` says which format a folder is in, from its files: the one answer every launch
mode asks before it resumes (``dit/resume_checks.py``), and the one this check follows.
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

STEP_DIR = re.compile(r"step_(\d+)(\.tmp)?$")
STAGES, SHARDED = "stages", "sharded"
STAGE_FILES = ("model.safetensors", "optim.safetensors")  # ema.safetensors only where the run kept one


@dataclass(frozen=True)
class CheckpointFormat:
    """What a checkpoint folder holds, read from its files (never from the config that asks)."""

    weights: str  # 'replicated' (model/ + the optimizer in trainer.pt), 'dcp' (sharded/) or 'stages'
    lora: bool  # adapters alone, in diffusers' LoRA files (the base is model.pretrained)
    experts: bool  # model.expert=both: model/transformer/ and model/transformer_2/

    def __str__(self) -> str:
        where = {
            "replicated": "replicated weights (model/, the optimizer in trainer.pt)",
            "dcp": "FSDP shards (sharded/, parallel.fsdp=per_step or per_layer)",
            "stages": "pipeline stage files (stages/, parallel.pp_size > 1)",
        }[self.weights]
        return where + (", LoRA adapters" if self.lora else "") + (", both experts" if self.experts else "")


def checkpoint_format(step_dir: Path) -> CheckpointFormat:
    """The format of ``step_dir``: stage files, DCP shards or replicated files; LoRA and A14B's two
    experts on top of any of them."""
    if (step_dir / STAGES).is_dir():
        weights = "stages"
    elif (step_dir / SHARDED).is_dir():
        weights = "dcp"
    else:
        weights = "replicated"
    model = step_dir / "model"
    lora = any(model.rglob("pytorch_lora_weights.safetensors")) if model.is_dir() else False
    experts = model.is_dir() and any(p.is_dir() for p in model.glob("transformer*"))
    return CheckpointFormat(weights, lora, experts)


def saved_config(step_dir: Path) -> dict:
    """The checkpoint's ``config.yaml`` (the run's resolved config), {} where it has none or it is
    unreadable (safe_load: plain types only)."""
    try:
        saved = yaml.safe_load((step_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


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
    if checkpoint_format(step_dir).weights == "stages":
        problem = _stages_problem(step_dir)
    else:
        problem = _model_folder_problem(step_dir)
    if problem:
        return problem
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
    sharded = step_dir / SHARDED
    if sharded.is_dir() and not (sharded / ".metadata").is_file():
        return "sharded/.metadata is missing (DCP writes it last: the save did not finish)"
    return None


def _model_folder_problem(step_dir: Path) -> str | None:
    """Replicated and DCP checkpoints hold the run's weights in model/ (DCP: the consolidated export)."""
    model = step_dir / "model"
    if not model.is_dir():
        return "model/ holds no safetensors weights"
    # A14B's two experts (model.expert=both) save a diffusers folder: one subfolder per expert
    for part in sorted(p for p in model.glob("transformer*") if p.is_dir()) or [model]:
        if not any(part.glob("*.safetensors")):
            return f"{part.relative_to(step_dir)}/ holds no safetensors weights"
    return None


def _stages_problem(step_dir: Path) -> str | None:
    """Every stage of the run wrote its folder: the weights and moments of its blocks (a pipeline
    LoRA's model/ is rank 0's merge of them, so the stage files are what resumes)."""
    pp_size = saved_config(step_dir).get("parallel", {}).get("pp_size")
    found = sorted(p.name for p in (step_dir / STAGES).iterdir() if p.is_dir())
    wanted = [f"stage_{p}" for p in range(pp_size)] if isinstance(pp_size, int) else found
    if not wanted:
        return f"{STAGES}/ holds no stage folders"
    for name in wanted:
        for file in STAGE_FILES:
            if not (step_dir / STAGES / name / file).is_file():
                return f"{STAGES}/{name}/{file} is missing"
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
