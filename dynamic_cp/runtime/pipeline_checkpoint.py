"""Checkpoints of pipeline stages: each stage writes its own blocks, any pp_size reads them back.

Layout of ``<output_dir>/checkpoints/step_000100/`` under ``parallel.pp_size > 1``:
    stages/stage_{p}/model.safetensors   stage p's weights under their global names (``blocks.{i}``)
    stages/stage_{p}/ema.safetensors     its EMA (the adapters' under LoRA)
    stages/stage_{p}/optim.safetensors   its AdamW moments, ``{parameter name}/{state}`` (no pickle)
    trainer.pt, config.yaml, learner     rank 0's, as in replicated checkpoints
Plan rank 0 of each stage writes its stage (under ZeRO-1 the stage's moments are gathered to it
first); rank 0 renames the ``.tmp`` folder into place after a world barrier, so the commit is atomic
as in ``dit/checkpoint.py``. Names are global, so resuming reads every stage's files and keeps what
this rank holds: the run may resume at another ``pp_size``, 1 (no pipeline) included, on any world.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dit.checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    kill_point_for_tests,
    load_trainer_state,
    rng_state,
    save_trainer_state,
    set_rng_state,
)

STAGES = "stages"


def _ordered_params(optimizer) -> list[torch.nn.Parameter]:
    """The optimizer's parameters in its state dict's index order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


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
    if trainer.plan_rank == 0:
        folder = tmp / STAGES / f"stage_{pipe.stage}"
        folder.mkdir(parents=True)
        weights = {n: t.detach().cpu().contiguous() for n, t in trainer.model.state_dict().items()}
        save_file(weights, str(folder / "model.safetensors"))
        ema = _ema_state(trainer.ema)
        if ema is not None:
            save_file(
                {n: t.detach().cpu().contiguous() for n, t in ema.items()}, str(folder / "ema.safetensors")
            )
        save_file(_optimizer_tensors(trainer), str(folder / "optim.safetensors"))
    for opt in sharded:
        opt._all_state_dicts = []  # see DistributedTrainer.save
    if not trainer.is_main:
        kill_point_for_tests(step, tmp)
    dist.barrier(group=trainer.world)  # every stage's files are on disk
    if not trainer.is_main:
        return None
    save_trainer_state(tmp / "trainer.pt", {**state, "step": step, "rng": rng_state()})
    import yaml

    (tmp / "config.yaml").write_text(yaml.safe_dump(to_dict(trainer.cfg), sort_keys=False))
    for name, text in trainer.checkpoint_extras().items():
        (tmp / name).write_text(text)
    trainer.learner.save(trainer.out, step)
    return commit_checkpoint(root, step, trainer.cfg.train.keep_checkpoints)


def _optimizer_tensors(trainer) -> dict[str, torch.Tensor]:
    """{"{parameter name}/{state key}": tensor} of this stage's optimizer (plan rank 0)."""
    opt = trainer.optimizer
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    saved = opt.state_dict()["state"]
    out = {}
    for i, p in enumerate(_ordered_params(opt)):
        for key, value in saved.get(i, {}).items():
            out[f"{names[id(p)]}/{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return out


def is_pipeline_checkpoint(step_dir: Path) -> bool:
    return (step_dir / STAGES).is_dir()


def _read(step_dir: Path, file: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for folder in sorted((step_dir / STAGES).iterdir()):
        if (folder / file).is_file():
            out.update(load_file(str(folder / file)))
    return out


def resume_pipeline_checkpoint(trainer, step_dir: Path) -> None:
    """Load a stage checkpoint into this rank's model (its stage's part, or the whole model without a
    pipeline), EMA and optimizer; restore the schedule, step and RNG."""
    model = trainer.model
    weights = _read(step_dir, "model.safetensors")
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    if missing:
        raise ValueError(
            f"{step_dir} holds no {missing[0]} (and {len(missing) - 1} more): its stages do not add up to "
            "this model; resume with the model config it was written with"
        )
    model.load_state_dict({n: weights[n] for n in own})
    if trainer.ema is not None:
        ema = _read(step_dir, "ema.safetensors")
        target = trainer.ema.state if hasattr(trainer.ema, "state") else trainer.ema.model.state_dict()
        with torch.no_grad():
            for name, t in target.items():
                t.copy_(ema.get(name, weights.get(name, t)))  # saved without EMA: start at the weights
    moments = _read(step_dir, "optim.safetensors")
    opt = trainer.optimizer
    params = _ordered_params(opt)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for i, p in enumerate(params):
        mine = {k.rsplit("/", 1)[1]: v for k, v in moments.items() if k.rsplit("/", 1)[0] == names[id(p)]}
        if mine:
            state[i] = mine
    index = {id(p): i for i, p in enumerate(params)}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
        for g in opt.param_groups
    ]
    opt.load_state_dict({"state": state, "param_groups": groups})
    for part in trainer._zero_parts():
        part.state.clear()  # the live moments are in its inner AdamW (DistributedTrainer.__init__)
    saved = load_trainer_state(step_dir)
    trainer.lr_schedule.load_state_dict(saved["lr_schedule"])
    # the groups' lr is the schedule's last (the fresh optimizer's is the schedule's step-0 value)
    for group, lr in zip(opt.param_groups, trainer.lr_schedule.get_last_lr()):
        group["lr"] = lr
    trainer.step, trainer.bad_steps = saved["step"], saved["bad_steps"]
    set_rng_state(saved["rng"])
    trainer._truncate_metrics(trainer.step)
    if trainer.is_main:
        print(f"resumed from {step_dir} at step {trainer.step} (pipeline stages)")
