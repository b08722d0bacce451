"""A checkpoint's tensors keyed by parameter name: how a layout resumes what another one wrote.

Each stage of a ``parallel.pp_size > 1`` run writes ``stages/stage_{p}/{model,ema,optim}.safetensors``
under global names (``dynamic_cp/runtime/pipeline_checkpoint.py``). Names are global and tensors
whole, so reading every stage's files gives the whole model's weights, EMA and AdamW moments keyed
by parameter name, with no process group: one process takes them all, a stage or a rank keeps what
it holds. A replicated checkpoint (``model/``, ``ema/``, the optimizer in ``trainer.pt``) reads the
same way, its moments named by the whole model's parameter order (``read_by_name``), which is how a
pipeline stage resumes it. ``load_by_name`` puts them into a replicated model, its EMA and its
optimizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dit.checkpoint import load_trainer_state, read_folder
from dit.checkpoint_whole import STAGES, checkpoint_format

MODEL, EMA, OPTIM = "model.safetensors", "ema.safetensors", "optim.safetensors"


def read_stage_files(step_dir: Path, file: str) -> dict[str, torch.Tensor]:
    """{global name: tensor} of ``file`` over every stage of ``step_dir``."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for folder in sorted((step_dir / STAGES).iterdir()):
        if (folder / file).is_file():
            out.update(load_file(str(folder / file)))
    return out


def read_stage_moments(step_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: its AdamW state} of every parameter the stages saved."""
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in read_stage_files(step_dir, OPTIM).items():
        name, _, state_key = key.rpartition("/")  # "{parameter name}/{state key}"
        moments.setdefault(name, {})[state_key] = t
    return moments


def saved_names(model: torch.nn.Module, lora: bool) -> list[str]:
    """What a stage saves of its model: every tensor, or under LoRA the adapters alone."""
    if lora:
        return [n for n, p in model.named_parameters() if p.requires_grad]
    return list(model.state_dict())


def read_stage_weights(step_dir: Path, model: torch.nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """The saved tensors this model holds ({name: tensor}); ValueError where the stages lack one."""
    weights = read_stage_files(step_dir, MODEL)
    own = saved_names(model, lora)
    missing = sorted(set(own) - set(weights))
    if missing:
        raise ValueError(
            f"{step_dir} holds no {missing[0]} (and {len(missing) - 1} more): its stages do not add up to "
            "this model; resume with the model config it was written with"
        )
    return {n: weights[n] for n in own}


def read_by_name(
    step_dir: Path, model: torch.nn.Module, lora: bool, ema: bool, trainer_state: dict | None = None
) -> tuple:
    """(weights, EMA, moments) of ``step_dir`` keyed by parameter name, for ``model`` (a stage holds
    part of the whole: its weights and EMA are kept, the moments of every saved parameter come back;
    ``ema``: whether it keeps one; ``trainer_state``: its trainer.pt where the caller has read it, as
    a replicated one holds the optimizer and is not read twice).
    Stage files of any run, or the replicated files of a full (not LoRA, one-expert) run."""
    fmt = checkpoint_format(step_dir)
    if fmt.weights == "stages":
        ema_state = read_stage_files(step_dir, EMA) if ema else {}
        return read_stage_weights(step_dir, model, lora), ema_state, read_stage_moments(step_dir)
    assert fmt.weights == "replicated" and not (fmt.lora or fmt.experts or lora), fmt  # resume_checks
    from dit.model import VideoDiT

    whole = read_folder(step_dir / "model")
    own = saved_names(model, lora)
    weights = {n: whole[n] for n in own}
    ema_state = {}
    if ema and (step_dir / "ema").is_dir():
        ema_state = {n: t for n, t in read_folder(step_dir / "ema").items() if n in own}
    with torch.device("meta"):  # the whole model's parameter order, which indexes the saved optimizer
        order = [n for n, p in VideoDiT.from_config(model.config).named_parameters() if p.requires_grad]
    saved = (trainer_state or load_trainer_state(step_dir))["optimizer"]["state"]
    moments = {order[i]: state for i, state in saved.items()}
    return weights, ema_state, moments


def ordered_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The optimizer's parameters in its state dict's index order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def groups_by(optimizer: torch.optim.Optimizer, key) -> list[dict]:
    """The optimizer's param groups with ``key(parameter)`` in place of each parameter."""
    return [{**g, "params": [key(p) for p in g["params"]]} for g in optimizer.param_groups]


def load_by_name(model, ema, optimizer, weights: dict, ema_state: dict, moments: dict, lora: bool) -> None:
    """Weights, EMA and AdamW moments keyed by parameter name into a replicated ``model``, its
    ``ema`` (an ``EMA``, an ``AdapterEMA`` or None) and ``optimizer`` (its groups' hyperparameters
    are the live ones; the caller sets the LR from the restored schedule)."""
    model.load_state_dict(weights, strict=not lora)  # LoRA: the adapters alone
    if ema is not None:
        target = ema.state if hasattr(ema, "state") else ema.model.state_dict()
        with torch.no_grad():
            for name, t in target.items():
                t.copy_(ema_state.get(name, weights.get(name, t)))  # saved without EMA: start at the weights
    names = {id(p): n for n, p in model.named_parameters()}
    params = ordered_params(optimizer)
    index = {id(p): i for i, p in enumerate(params)}
    state = {index[id(p)]: moments[names[id(p)]] for p in params if names[id(p)] in moments}
    optimizer.load_state_dict({"state": state, "param_groups": groups_by(optimizer, lambda p: index[id(p)])})
