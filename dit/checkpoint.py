"""Checkpoints written atomically, and resumed exactly.

Layout of ``<output_dir>/checkpoints/step_000100/``:
    model/          save_pretrained of the trained weights (config.json + safetensors)
    ema/            save_pretrained of the EMA weights (what sample.py loads by default)
    trainer.pt      optimizer, LR schedule, step, counters and RNG states
    config.yaml     the full resolved config of the run
The directory is first written as ``step_000100.tmp`` and renamed when complete, and
``checkpoints/latest`` (a one-line file) is replaced by rename too, so a run killed at any instant
leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import yaml

LATEST = "latest"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    root: Path, step: int, model, ema_model, trainer_state: dict, config: dict, keep: int
) -> Path:
    """Write checkpoint ``step`` under ``root`` (output_dir/checkpoints) and prune to ``keep`` newest."""
    tmp = begin_checkpoint(root, step)
    write_checkpoint_files(tmp, step, model, ema_model, trainer_state, config)
    return commit_checkpoint(root, step, keep)


def begin_checkpoint(root: Path, step: int) -> Path:
    """A fresh ``step_XXXXXX.tmp`` directory to write checkpoint ``step`` into."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
    tmp.mkdir()
    return tmp


def write_checkpoint_files(tmp: Path, step: int, model, ema_model, trainer_state: dict, config: dict) -> None:
    """The consolidated weights (save_pretrained), the trainer state and the config, into ``tmp``."""
    model.save_pretrained(tmp / "model")
    if ema_model is not None:
        ema_model.save_pretrained(tmp / "ema")
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer.pt")
    (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def commit_checkpoint(root: Path, step: int, keep: int) -> Path:
    """Rename the complete ``.tmp`` directory into place, point ``latest`` at it, prune to ``keep``."""
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if final.exists():  # the same step saved by an earlier attempt: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(root / LATEST, final.name + "\n")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))[:-keep]:
        shutil.rmtree(old)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory, its checkpoints/ directory or one step directory -> the step directory."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint path {path} does not exist; pass a run directory or a step_* directory")
    for candidate in (path, path / "checkpoints"):
        if (candidate / LATEST).is_file():
            return candidate / (candidate / LATEST).read_text().strip()
    if (path / "trainer.pt").is_file() or (path / "model").is_dir():
        return path
    raise ValueError(
        f"{path} holds no checkpoint (no checkpoints/latest, trainer.pt or model/); "
        "pass the output_dir of a run that saved one"
    )


def load_trainer_state(step_dir: Path) -> dict:
    return torch.load(step_dir / "trainer.pt", map_location="cpu", weights_only=False)


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load a ``save_pretrained`` directory's safetensors (one file or shards) into ``model`` in place,
    without building a second model."""
    from safetensors.torch import load_file

    single = directory / "diffusion_pytorch_model.safetensors"
    index = directory / "diffusion_pytorch_model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        import json

        files = [
            directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))
        ]
    else:
        raise ValueError(f"{directory} holds no safetensors weights; the checkpoint is incomplete")
    state = {}
    for f in files:
        state.update(load_file(f))
    model.load_state_dict(state)
