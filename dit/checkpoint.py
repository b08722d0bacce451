"""Checkpoints written atomically, and resumed exactly.

Layout of ``<output_dir>/checkpoints/step_000100/``:
    model/          save_pretrained of the trained weights (config.json + safetensors)
    ema/            save_pretrained of the EMA weights (what sample.py loads by default)
    trainer.pt      optimizer, LR schedule, step, counters and RNG states: tensors and plain Python
                    types only, so it loads with ``torch.load(weights_only=True)`` and never runs code
    config.yaml     the full resolved config of the run
The directory is first written as ``step_000100.tmp`` and renamed when complete, and
``checkpoints/latest`` (a one-line file) is replaced by rename too, so a run killed at any instant
leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import os
import pickle
import random
import re
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
    """The three generators a step draws from, as tensors, ints and floats: numpy's state holds an
    ndarray, which ``weights_only`` loading refuses, so its key travels as an int64 tensor."""
    version, py_key, gauss = random.getstate()  # (3, 625 ints, None or float)
    kind, np_key, pos, has_gauss, cached = np.random.get_state()  # ('MT19937', (624,) uint32, ...)
    return {
        "python": {"version": version, "key": torch.tensor(py_key, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(np_key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),  # (5056,) uint8
    }


def set_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["key"].tolist()), py["gauss"]))
    np_key = npy["key"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], np_key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
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
    """``trainer.pt`` with ``weights_only=True``: a shared checkpoint may hold any pickle, and loading
    one with full unpickling runs whatever code it names. Anything but tensors and plain types is refused."""
    path = step_dir / "trainer.pt"
    if not path.is_file():
        raise ValueError(f"{path} does not exist; the checkpoint is incomplete, resume from another step")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message is a page long; the name of the refused global is what the user needs.
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        raise ValueError(
            f"{path} holds a pickled Python object ({found.group(1) if found else 'not a tensor or plain value'}); "
            "refusing to unpickle it, as that could run code. Resume only from checkpoints that this "
            "version of train.py wrote"
        ) from None
    except RuntimeError as err:  # not a torch file at all: truncated, or another format
        raise ValueError(f"{path} is not a readable torch file ({str(err).splitlines()[0][:200]})") from None
    # the optimizer is in trainer.pt for replicated runs and in the sharded checkpoint under FSDP
    if not isinstance(state, dict) or not {"lr_schedule", "step", "rng"} <= state.keys():
        raise ValueError(f"{path} is not a trainer state (expected lr_schedule, step and rng)")
    return state


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
