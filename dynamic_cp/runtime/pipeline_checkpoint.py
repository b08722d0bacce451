"""Checkpoints of pipeline stages: each stage writes its own blocks, any pp_size reads them back.

Layout of ``<output_dir>/checkpoints/step_000100/`` under ``parallel.pp_size > 1``:
    stages/stage_{p}/model.safetensors   stage p's weights under their global names (``blocks.{i}``)
    stages/stage_{p}/ema.safetensors     its EMA (the adapters' under LoRA)
    stages/stage_{p}/optim.safetensors   its AdamW moments, ``{parameter name}/{state}`` (no pickle)
    trainer.pt, config.yaml, extras      rank 0's, as in replicated checkpoints
    model/, ema/ (LoRA)                  rank 0's merge of every stage's adapters, in diffusers'
                                         LoRA format: what the run exports (``dit.lora``)
Plan rank 0 of each stage writes its stage (under ZeRO-1 the stage's moments are gathered to it
first; under FSDP every tensor is gathered to it whole, one at a time, over the stage's ranks);
rank 0 renames the ``.tmp`` folder into place after a world barrier, so the commit is atomic as in
``dit/checkpoint.py``. Under LoRA a stage writes its adapters alone (the base is model.pretrained).
Names are global and tensors whole, so resuming reads every stage's files and keeps what this rank
holds (under FSDP: its shards): the run may resume at another ``pp_size``, 1 (no pipeline)
included, on any world, with replicated or FSDP-sharded weights either side.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dit.checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    kill_point_for_tests,
    load_trainer_state,
    rng_state,
    save_trainer_state,
    set_rng_state,
)
from dit.checkpoint_by_name import (
    EMA,
    MODEL,
    OPTIM,
    groups_by,
    load_by_name,
    ordered_params,
    read_by_name,
    read_stage_files,
    saved_names,
)
from dit.checkpoint_whole import STAGES, checkpoint_format


def _ema_state(ema) -> dict[str, torch.Tensor] | None:
    if ema is None:
        return None
    return dict(ema.state) if hasattr(ema, "state") else ema.model.state_dict()


def save_pipeline_checkpoint(trainer) -> Path | None:
    """Collective over the world; -> the step directory on rank 0, None elsewhere."""
    from safetensors.torch import save_file

    from dit.config import to_dict

    root, step = trainer.out / "checkpoints", trainer.step
    tmp = root / f"step_{step:06d}.tmp"
    pipe = trainer.pipeline
    sharded = trainer._zero_parts()
    for opt in sharded:
        opt.consolidate_state_dict(to=0)  # the stage's moments on its plan rank 0
    state = {"lr_schedule": trainer.lr_schedule.state_dict(), "bad_steps": trainer.bad_steps}
    if trainer.is_main:
        begin_checkpoint(root, step)
    dist.barrier(group=trainer.world)  # the fresh tmp directory exists before anyone writes into it
    # collective over the stage's ranks under FSDP; {} but on the stage's plan rank 0
    files = _stage_files(trainer, trainer.plan_rank == 0)
    folder = tmp / STAGES / f"stage_{pipe.stage}"
    for name, tensors in files.items():
        folder.mkdir(parents=True, exist_ok=True)
        if tensors is not None:
            save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(folder / name))
    for opt in sharded:
        opt._all_state_dicts = []  # see DistributedTrainer.save
    if not trainer.is_main:
        kill_point_for_tests(step, tmp)
    dist.barrier(group=trainer.world)  # every stage's files are on disk
    if not trainer.is_main:
        return None
    if trainer.lora:  # the run's LoRA, every stage's adapters in one diffusers file (model/, ema/)
        from dit.lora import save_stages_lora

        save_stages_lora(trainer.model, tmp / "model", read_stage_files(tmp, MODEL))
        if trainer.ema is not None:
            save_stages_lora(trainer.model, tmp / "ema", read_stage_files(tmp, EMA))
    save_trainer_state(tmp / "trainer.pt", {**state, "step": step, "rng": rng_state()})
    import yaml

    (tmp / "config.yaml").write_text(yaml.safe_dump(to_dict(trainer.cfg), sort_keys=False))
    for name, text in trainer.checkpoint_extras().items():
        (tmp / name).write_text(text)
    return commit_checkpoint(root, step, trainer.cfg.train.keep_checkpoints)


def _is_sharded(trainer) -> bool:
    return trainer.fsdp_mode != "none"  # FSDPTrainer: DTensor weights and moments


def _whole(tensors: dict, keep: bool) -> dict[str, torch.Tensor]:
    """Collective over the stage under FSDP: each tensor whole (a DTensor gathered over its mesh, one
    at a time), on the CPU where ``keep``; {} elsewhere."""
    out = {}
    for name, t in tensors.items():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = t.detach().cpu()
    return out


def _stage_files(trainer, keep: bool) -> dict[str, dict | None]:
    """{file name: tensors} of this stage (``keep``: plan rank 0, the others get {}); under FSDP every
    rank of the stage calls it, in one order."""
    model = trainer.model
    names = set(saved_names(trainer.model, trainer.lora))
    if not _is_sharded(trainer):
        if not keep:
            return {}
        weights = {n: t for n, t in model.state_dict().items() if n in names}
        return {MODEL: weights, EMA: _ema_state(trainer.ema), OPTIM: _optimizer_tensors(trainer)}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    weights = _whole({n: t for n, t in model.state_dict().items() if n in names}, keep)
    ema = trainer.ema.full_state_dict(keep) if trainer.ema is not None else None
    state = get_optimizer_state_dict(model, trainer.optimizer)["state"]  # keyed by parameter name
    moments = _whole({f"{n}/{k}": v for n, s in state.items() for k, v in s.items()}, keep)
    return {MODEL: weights, EMA: ema, OPTIM: moments} if keep else {}


def _optimizer_tensors(trainer) -> dict[str, torch.Tensor]:
    """{"{parameter name}/{state key}": tensor} of this stage's optimizer (plan rank 0)."""
    opt = trainer.optimizer
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    saved = opt.state_dict()["state"]
    out = {}
    for i, p in enumerate(ordered_params(opt)):
        for key, value in saved.get(i, {}).items():
            out[f"{names[id(p)]}/{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return out


def is_pipeline_checkpoint(step_dir: Path) -> bool:
    return checkpoint_format(step_dir).weights == "stages"


def resume_pipeline_checkpoint(trainer, step_dir: Path) -> None:
    """Load a stage checkpoint into this rank's model (its stage's part, or the whole model without a
    pipeline; its shards under FSDP), EMA and optimizer; restore the schedule, step and RNG."""
    fmt = checkpoint_format(step_dir)
    full_files = (
        fmt.weights == "replicated" and not (fmt.lora or fmt.experts) and (step_dir / "model").is_dir()
    )
    if fmt.weights != "stages" and not full_files:  # dit/resume_checks.py refuses it first, with the command
        raise ValueError(
            f"{step_dir} was written without pipeline stages; resume it with parallel.pp_size=1 (stages read "
            f"{fmt} only from a full run's replicated files), or start a pipeline run from its weights "
            f"with model.pretrained={step_dir / 'model'}"
        )
    model = trainer.model
    names = {id(p): n for n, p in model.named_parameters()}
    # trainer.pt is read once: a replicated checkpoint's optimizer is in it; stage files come first
    saved = load_trainer_state(step_dir) if full_files else None
    weights, ema, moments = read_by_name(step_dir, model, trainer.lora, trainer.ema is not None, saved)
    saved = saved or load_trainer_state(step_dir)
    held = {names[id(p)] for p in ordered_params(trainer.optimizer)}
    moments = {n: m for n, m in moments.items() if n in held}  # a stage's optimizer holds its blocks'
    if _is_sharded(trainer):
        _load_sharded(trainer, weights, ema, moments, names)
    else:
        load_by_name(model, trainer.ema, trainer.optimizer, weights, ema, moments, trainer.lora)
        for part in trainer._zero_parts():
            part.state.clear()  # the live moments are in its inner AdamW (DistributedTrainer.__init__)
    trainer.lr_schedule.load_state_dict(saved["lr_schedule"])
    # the groups' lr is the schedule's last (the fresh optimizer's is the schedule's step-0 value)
    for group, lr in zip(trainer.optimizer.param_groups, trainer.lr_schedule.get_last_lr()):
        group["lr"] = lr
    trainer.step, trainer.bad_steps = saved["step"], saved["bad_steps"]
    set_rng_state(saved["rng"])
    trainer._truncate_metrics(trainer.step)
    if trainer.is_main:
        print(f"resumed from {step_dir} at step {trainer.step} (pipeline stages, from {fmt.weights} files)")


def _load_sharded(trainer, weights: dict, ema: dict, moments: dict, names: dict) -> None:
    """FSDP: every rank holds the whole tensors and keeps its shards (``load_full_state``)."""
    from dynamic_cp.runtime.fsdp_checkpoint import load_full_state

    full_ema = None
    if trainer.ema is not None:  # saved without EMA: start at the weights
        full_ema = {n: ema.get(n, weights.get(n)) for n in trainer.ema.params}
    opt = trainer.optimizer
    by_name = {"state": moments, "param_groups": groups_by(opt, lambda p: names[id(p)])}
    load_full_state(trainer.model, opt, trainer.ema, weights, by_name, full_ema)  # no LoRA under FSDP
