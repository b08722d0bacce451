"""Which folder of a diffusers Wan pipeline holds the transformer to load: a transformer folder, a
pipeline's ``transformer/``, or one expert of a Wan2.2 A14B pipeline, and what the pipeline's
``model_index.json`` says (two experts, TI2V's ``expand_timesteps``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

DOWNLOAD_HINT = "download Wan-AI/Wan2.1-T2V-1.3B-Diffusers (or -14B-Diffusers) and pass model.pretrained=DIR"


# Wan2.2 A14B pipeline folders hold one expert per subfolder (``model.expert`` picks one).
EXPERT_FOLDERS = {"high": "transformer", "low": "transformer_2"}


def pipeline_index(path: str | Path) -> dict:
    """A pipeline folder's model_index.json ({} when it has none)."""
    index = Path(path) / "model_index.json"
    return json.loads(index.read_text()) if index.is_file() else {}


def is_two_expert(index: Mapping) -> bool:
    """A Wan2.2 A14B pipeline: a ``transformer_2`` component (high/low-noise experts)."""
    return (index.get("transformer_2") or [None])[0] is not None


def pipeline_expand_timesteps(path: str | Path) -> bool:
    """``expand_timesteps`` of the Wan pipeline that ``path`` (a pipeline or its transformer folder)
    belongs to: True for Wan2.2 TI2V (per-token timesteps); False without a ``model_index.json``."""
    path = Path(path)
    return any(bool(pipeline_index(folder).get("expand_timesteps")) for folder in (path, path.parent))


def transformer_folder(path: str | Path, expert: str | None = None) -> Path:
    """A transformer folder (config.json + weights), or a pipeline folder with ``transformer/`` (a
    Wan2.2 A14B pipeline: ``expert``'s folder, ``transformer/`` for high, ``transformer_2/`` for low)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model.pretrained={path} does not exist; {DOWNLOAD_HINT}")
    if (path / "config.json").is_file():
        return path
    if (path / "transformer" / "config.json").is_file():
        index = pipeline_index(path)
        if is_two_expert(index):
            if expert is None:
                raise ValueError(
                    f"{path} is a Wan2.2 two-expert pipeline; set model.expert=high (transformer/, high noise) "
                    "or model.expert=low (transformer_2/, low noise) to train one expert (--expert for "
                    "python -m dit.wan_import import)"
                )
            return path / EXPERT_FOLDERS[expert]
        if expert is not None:
            raise ValueError(
                f"model.expert={expert}: {path} has one transformer, not Wan2.2's two experts; drop "
                "model.expert or point model.pretrained at a Wan2.2 A14B pipeline folder"
            )
        return path / "transformer"
    if (path / "ema" / "config.json").is_file() or (path / "model" / "config.json").is_file():
        raise ValueError(f"{path} is a training checkpoint; pass {path / 'ema'} or {path / 'model'}")
    if (path / "checkpoints").is_dir():  # a run directory: named, not followed, since its newest
        from dit.checkpoint_whole import newest_whole_checkpoint  # checkpoint moves while it trains

        step = newest_whole_checkpoint(path / "checkpoints", lambda _: None)
        if step is not None:
            raise ValueError(
                f"model.pretrained={path} is a training run; pass one checkpoint's weights, e.g. its newest: "
                f"model.pretrained={step / 'ema'} (or {step / 'model'})"
            )
    raise ValueError(f"{path} has no config.json (nor transformer/config.json); {DOWNLOAD_HINT}")
