"""Loading a training checkpoint's weights back into a live model: full weights, or LoRA adapters.

``Trainer._resume`` (dit/trainer.py) reads the trainer state and calls these for the weights; the
FSDP runtime loads its DCP shards instead (dynamic_cp/runtime/fsdp_checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dit.checkpoint import load_weights


def ema_folder(step_dir: Path) -> Path:
    """Where a checkpoint's EMA is: ``ema/``, or ``model/`` for one saved without EMA (the EMA then
    starts at the resumed weights)."""
    return step_dir / "ema" if (step_dir / "ema").is_dir() else step_dir / "model"


def load_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """``load_weights`` of one VideoDiT, or of both experts of an ExpertPair (its save_pretrained
    folders: transformer/ and transformer_2/)."""
    from dit.experts import ExpertPair

    if not isinstance(model, ExpertPair):
        load_weights(model, directory)
        return
    from dit.wan_pipeline_folders import EXPERT_FOLDERS

    for name, folder in EXPERT_FOLDERS.items():
        if not (directory / folder).is_dir():
            raise ValueError(
                f"model.expert=both: {directory} holds no {folder}/ (one expert's checkpoint); resume "
                "it with model.expert=high or low, or start both from a Wan2.2 A14B folder"
            )
        load_weights(getattr(model, name), directory / folder)


def load_adapters(model: torch.nn.Module, ema, step_dir: Path) -> None:
    """A LoRA checkpoint's adapters (diffusers' format) into ``model``, and its EMA's into ``ema``
    (an ``AdapterEMA``, or None)."""
    from dit.lora import model_adapter_values

    live = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in model_adapter_values(model, step_dir / "model").items():
            live[name].copy_(value)
        if ema is not None:
            for name, value in model_adapter_values(model, ema_folder(step_dir)).items():
                ema.state[name].copy_(value)
