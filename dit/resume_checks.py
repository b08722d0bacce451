"""Before a resume builds anything: can this launch load the checkpoint, and does it train what the
checkpoint trained? Either answer "no" stops the run with one line naming the checkpoint and the
command that resumes it, before any file of the run is touched (config.yaml, metrics.jsonl).

Which layouts read which format (``dit/checkpoint_whole.py``'s ``checkpoint_format``):

| checkpoint            | one process | replicated ranks | FSDP (per_step, per_layer) | pipeline stages    |
|-----------------------|-------------|------------------|----------------------------|--------------------|
| replicated files      | yes         | yes              | yes (not both experts)     | full weights only  |
| FSDP shards (DCP)     | no          | fsdp=auto only   | yes                        | no                 |
| pipeline stage files  | yes         | yes              | yes                        | yes, any pp_size   |

DCP's shards need a process group to be read, which a one-process run has not; a stage reads its
blocks by parameter name (``dit/checkpoint_by_name.py``) from stage files or a full run's replicated
files, but not from a LoRA file (diffusers' names) or an expert pair (no pipeline runs two experts).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from dit.checkpoint_whole import CheckpointFormat, checkpoint_format, saved_config
from dit.config import Config, to_dict

# Sections whose keys decide what is learned: a resume that changes one trains something else than
# the run it continues (other clips, another network, another objective).
LEARNED = ("data", "model", "flow")
# ...except these, which say where files are or how the same computation runs, not what it computes.
FREE = {
    "data.num_workers", "data.reader", "data.vae_path", "data.text_encoder_path", "data.image_encoder_path",
    "model.pretrained", "model.lora_init", "model.gradient_checkpointing", "model.compile",
    "model.idle_expert", "model.base_dtype", "model.offload", "model.offload_blocks",
    "flow.val_sigmas",
}  # fmt: skip
ALLOW_FLAG = "--allow-config-change"


def changed_keys(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(section.key, saved value, new value) of every learned key that differs (a dict value, such as
    model.overrides or model.lora, compared whole); keys the saved config lacks (written by an older
    version) are not compared."""
    differ = []
    for section in LEARNED:
        old, new = saved.get(section) or {}, now[section]
        for key in new:
            name = f"{section}.{key}"
            if name not in FREE and key in old and old[key] != new[key]:
                differ.append((name, old[key], new[key]))
    return differ


def _layout(cfg: Config) -> str:
    p = cfg.parallel
    if p.mode == "none":
        return "a one-process run (parallel.mode=none)"
    if p.pp_size > 1:
        return f"a pipeline run (parallel.pp_size={p.pp_size})"
    return f"a run with parallel.fsdp={p.fsdp}"


def reads(fmt: CheckpointFormat, cfg: Config) -> bool:
    """Does the launch ``cfg`` describes load a checkpoint of format ``fmt`` (the table above)?"""
    p = cfg.parallel
    if fmt.weights == "stages":
        return True
    if p.mode != "none" and p.pp_size > 1:
        return fmt.weights == "replicated" and not (fmt.lora or fmt.experts)
    if fmt.weights == "dcp":
        return p.mode != "none" and p.fsdp != "none"
    return True


def resume_command(step_dir: Path, fmt: CheckpointFormat) -> str:
    """The command that resumes ``step_dir`` as it was written: its own config, and torchrun for
    what only a process group reads (shards) or a run that had one."""
    mode = saved_config(step_dir).get("parallel", {}).get("mode", "none")
    one = mode == "none" and fmt.weights == "replicated"
    launcher = "python" if one else "torchrun --nproc_per_node=N"
    return f"{launcher} train.py --config {step_dir / 'config.yaml'} --resume {step_dir}"


def check_resume(cfg: Config, step_dir: Path, allow_config_change: bool = False) -> None:
    """ValueError (one line) where ``cfg``'s launch cannot load ``step_dir`` or would train other data,
    another model or another objective than it did (``allow_config_change``: the user said so)."""
    fmt = checkpoint_format(step_dir)
    if not reads(fmt, cfg):
        raise ValueError(
            f"--resume: {step_dir} holds {fmt}, which {_layout(cfg)} cannot load; resume it with "
            f"`{resume_command(step_dir, fmt)}`"
        )
    saved = saved_config(step_dir)
    now = yaml.safe_load(yaml.safe_dump(to_dict(cfg)))  # the types config.yaml holds (lists, not tuples)
    differ = changed_keys(saved, now) if saved else []
    if differ and not allow_config_change:
        shown = ", ".join(f"{k}={new!r} (was {old!r})" for k, old, new in differ[:3])
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ValueError(
            f"--resume: {step_dir} was trained with other settings: {shown}{more}. Resume with the run's "
            f"own config (`--config {step_dir / 'config.yaml'}`), or pass {ALLOW_FLAG} to continue with "
            "the new values"
        )
