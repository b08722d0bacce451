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

import contextlib
import errno
import os
import pickle
import random
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml

from data.cli import RunStopped
from dit.checkpoint_whole import newest_whole_checkpoint, step_dirs

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
    root: Path,
    step: int,
    model,
    ema_model,
    trainer_state: dict,
    config: dict,
    keep: int,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` (output_dir/checkpoints) and prune to ``keep`` newest.
    ``extra_files``: more {name: text} files for the folder."""
    tmp = begin_checkpoint(root, step)
    with stop_on_full_disk(tmp, lambda: nbytes(model) + nbytes(ema_model) + nbytes(trainer_state)):
        write_checkpoint_files(tmp, step, model, ema_model, trainer_state, config)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return commit_checkpoint(root, step, keep)


def export_pretrained(config, state: dict[str, torch.Tensor], directory: Path) -> None:
    """save_pretrained of full weights without a second full model in memory: the module is built
    on the meta device and its tensors are the given ones (gathered shards, or a staged copy)."""
    from dit.model import VideoDiT

    with torch.device("meta"):
        model = VideoDiT.from_config(config)
    model.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise RuntimeError(f"export lacks tensors {missing[:5]}")
    model.save_pretrained(directory)


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
    kill_point_for_tests(step)
    if ema_model is not None:
        ema_model.save_pretrained(tmp / "ema")
    # a state staged for a background write brings the RNG states of its step; else they are now's
    save_trainer_state(tmp / "trainer.pt", {"rng": rng_state(), **trainer_state, "step": step})
    (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def save_trainer_state(path: Path, state: dict) -> None:
    """``torch.save`` through a Python file: a full disk then raises OSError(ENOSPC) naming the file,
    where torch's own writer (given a path) says only "file write failed"."""
    with open(path, "wb") as f:
        torch.save(state, f)


# ----------------------------------------------------------------------------- test-only fault hook

KILL_IN_SAVE = "DYNAMIC_CP_TEST_KILL_IN_SAVE"


def kill_point_for_tests(step: int, writer_started: Path | None = None) -> None:
    """TEST-ONLY fault hook, off by default (and for every real run). With the environment variable
    ``DYNAMIC_CP_TEST_KILL_IN_SAVE=<step>[:<rank>]`` (rank 0 when not given), in the first attempt of
    a torchrun job only (TORCHELASTIC_RESTART_COUNT unset or 0, so that the restarted attempt runs
    through), the process of that ``RANK`` SIGKILLs itself at its kill point of checkpoint ``<step>``:
    partway through the save, its first files written, the folder still ``.tmp``.

    Every other rank that reaches a kill point of that checkpoint waits there until torchrun, which saw
    the death, stops it (as a slow disk would hold a writer there): the writer cannot finish the save
    first, so what the kill leaves does not depend on which process the scheduler runs first.
    ``writer_started``: the ``.tmp`` folder another rank writes; a rank that takes no part in writing
    (replicated weights: every rank but 0) waits for it to exist before dying, so that its death falls
    during the write. Called from the sync, the background and the FSDP save paths;
    tests/test_faults_torchrun.py kills rank 2 of 4 during a save with it."""
    wanted = os.environ.get(KILL_IN_SAVE)
    if wanted is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    at, _, victim = wanted.partition(":")
    if int(at) != step:
        return
    if int(os.environ.get("RANK", "0")) != int(victim or 0):
        time.sleep(600)  # torchrun stops this process long before
        return
    for _ in range(60000):  # 600 s at most
        if writer_started is None or writer_started.exists():
            break
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- full disk

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# safetensors (Rust) and DCP wrap the OS error in their own exceptions: their text still says it
DISK_FULL_TEXT = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "StorageFull", "QuotaExceeded")


def _wrapped(err: BaseException) -> list[BaseException]:
    """``err``, the exceptions it was raised from, and those DCP's CheckpointException gathered from
    every rank (its ``failures``: {rank: (exception, traceback)})."""
    found, todo, seen = [], [err], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in (getattr(e, "failures", None) or {}).values() if isinstance(pair, tuple)]
    return found


def is_disk_full(err: BaseException) -> bool:
    """Did ``err`` (or an exception it wraps) come from a full disk or an exhausted quota?"""
    for e in _wrapped(err):
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return True
        if any(text in str(e) for text in DISK_FULL_TEXT):
            return True
    return False


def _failed_path(err: BaseException) -> str | None:
    """The file a disk-full error names, wherever it is wrapped."""
    for e in _wrapped(err):
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
    return None


def nbytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a module, an object with ``.model``/``.state``, or nested
    dicts and lists): what a checkpoint of it writes, give or take headers."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, torch.nn.Module):
        return sum(nbytes(t) for t in obj.state_dict().values())
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    state = getattr(obj, "state", None)  # dit.lora.LoraFiles: the adapters alone
    if isinstance(state, dict):
        return nbytes(state)
    model = getattr(obj, "model", None)
    if isinstance(model, torch.nn.Module):
        return sum(nbytes(p) for p in model.parameters() if p.requires_grad)
    return 0


@contextlib.contextmanager
def stop_on_full_disk(tmp: Path, needed_bytes: Callable[[], int]):
    """Writes into ``tmp`` that fail on a full disk (ENOSPC, EDQUOT) stop the run with one line:
    the path, the bytes the checkpoint needs and the bytes free. The half-written ``tmp`` is
    removed; the previous checkpoint is untouched and is the one ``--resume auto`` takes."""
    try:
        yield
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if not is_disk_full(err):
            raise
        raise disk_full_stop(tmp, needed_bytes(), err) from None


def disk_full_stop(tmp: Path, needed: int, err: BaseException) -> RunStopped:
    """The one-line stop for a save into ``tmp`` that failed on a full disk; removes ``tmp``."""
    shutil.rmtree(tmp, ignore_errors=True)  # frees what the half-written checkpoint took
    free = shutil.disk_usage(tmp.parent).free
    where = _failed_path(err) or tmp
    previous = newest_whole_checkpoint(tmp.parent, report=lambda line: None)
    then = (
        f"rerun with --resume auto: it takes {previous.name}, which is whole"
        if previous
        else "rerun (there is no earlier checkpoint)"
    )
    return RunStopped(
        f"disk full while saving checkpoint {tmp.name.removesuffix('.tmp')} ({where}): it needs about "
        f"{needed:,} bytes and {free:,} are free. Free space or move output_dir to a larger "
        f"disk, then {then}"
    )


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


def resolve_checkpoint(path: str | Path, report: Callable[[str], None] = print, whole: bool = False) -> Path:
    """A run directory, its checkpoints/ directory or one step directory -> the step directory.

    A step directory named explicitly is taken as it is (its loaders say what is wrong with it). For
    a run (or its checkpoints/): with ``whole`` (resuming), its newest whole checkpoint, newer ones
    that are not whole (``dit/checkpoint_whole.py``) reported through ``report`` and skipped;
    otherwise (sampling, export) the one ``checkpoints/latest`` names."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint path {path} does not exist; pass a run directory or a step_* directory")
    if (path / "trainer.pt").is_file() or (path / "model").is_dir():
        if path.name.endswith(".tmp"):
            raise ValueError(f"{path} was left by a save that did not finish; resume from a step_* directory")
        return path
    for candidate in (path / "checkpoints", path):
        if whole and candidate.is_dir() and any(step_dirs(candidate)):
            found = newest_whole_checkpoint(candidate, report)
            if found is None:
                raise ValueError(
                    f"{candidate} holds no whole checkpoint (see the lines above); start a new run"
                )
            return found
        if (candidate / LATEST).is_file():
            return candidate / (candidate / LATEST).read_text().strip()
    raise ValueError(
        f"{path} holds no checkpoint (no checkpoints/latest, trainer.pt or model/); "
        "pass the output_dir of a run that saved one"
    )


def find_resume_checkpoint(output_dir: str | Path, report: Callable[[str], None] = print) -> Path | None:
    """``--resume auto``: the newest whole checkpoint of ``output_dir``, or None to start fresh (no
    checkpoint yet, or none whole). Safe as the argument of every restart of a job."""
    return newest_whole_checkpoint(Path(output_dir) / "checkpoints", report)


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


def read_folder(directory: Path) -> dict[str, torch.Tensor]:
    """{name: tensor} of a ``save_pretrained`` directory's safetensors (one file or shards)."""
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
    return state


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load a ``save_pretrained`` directory's safetensors (one file or shards) into ``model`` in place,
    without building a second model."""
    model.load_state_dict(read_folder(directory))
