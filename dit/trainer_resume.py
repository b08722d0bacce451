"""Loading a training checkpoint's tensors back into a live replicated model: full weights or LoRA
adapters, the EMA and the optimizer's moments, from replicated files or a pipeline run's stage files.

``Trainer._resume`` (dit/trainer.py) reads the trainer state and calls ``load_checkpoint_tensors``;
the FSDP runtime loads its DCP shards instead (dynamic_cp/runtime/fsdp_checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dit.checkpoint import load_weights
from dit.checkpoint_by_name import load_by_name, read_by_name
from dit.checkpoint_whole import checkpoint_format


def load_checkpoint_tensors(model, ema, optimizer, step_dir: Path, state: dict, lora: bool) -> None:
    """``step_dir``'s weights (the adapters under LoRA), EMA and AdamW moments into ``model``, ``ema``
    and ``optimizer``; ``state``: its trainer.pt (a replicated checkpoint's optimizer is there)."""
    weights = checkpoint_format(step_dir).weights
    if weights == "dcp":  # dit/resume_checks.py refuses this before the model is built; kept as a guard
        raise ValueError(
            f"{step_dir} was written under parallel.fsdp=per_step or per_layer: its optimizer state is "
            "in sharded/. Resume it under torchrun with parallel.fsdp=auto, per_step or per_layer (any "
            f"number of ranks), or start a new run from its weights with model.pretrained={step_dir / 'model'}"
        )
    if weights == "stages":  # every stage's files, by parameter name
        load_by_name(model, ema, optimizer, *read_by_name(step_dir, model, lora, ema is not None), lora)
        return
    if lora:
        load_adapters(model, ema, step_dir)
    else:
        load_model_weights(model, step_dir / "model")
        if ema is not None:  # a checkpoint saved without EMA starts the EMA at the resumed weights
            load_model_weights(ema.model, ema_folder(step_dir))
    optimizer.load_state_dict(state["optimizer"])


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
