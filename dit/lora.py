"""LoRA on VideoDiT through peft, saved and loaded in diffusers' Wan LoRA format.

No LoRA layer is written here: peft injects them (``PeftAdapterMixin.add_adapter``, the call diffusers'
training scripts use), reads them (``get_peft_model_state_dict``) and writes them
(``set_peft_model_state_dict``). Files go through diffusers' own ``WanLoraLoaderMixin``:
``save_lora_weights`` writes ``pytorch_lora_weights.safetensors`` (keys
``transformer.blocks.0.attn1.to_q.lora_A.weight``, the peft config as JSON metadata) and
``lora_state_dict`` reads it, converting the original-Wan / ComfyUI (``diffusion_model.``) and
musubi-tuner (``lora_unet_``) layouts on the way. DiffSynth-Studio's files (original Wan names with
peft's ``.default.`` infix) are renamed to the original-Wan layout first and then take that path.

Module names are Wan's (``dit/model.py``), so keys map one to one but for the patch embedding, a
Conv3d in Wan and a Linear here: its LoRA factors are reshaped with ``dit/wan_import.py``'s mapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from dit.model import cast_weights
from dit.model_config import LoraSettings
from dit.wan_import import PATCH_WEIGHT, ours_to_wan, wan_to_ours

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
PREFIX = "transformer"  # what WanPipeline.load_lora_weights strips before the transformer's names
ADAPTER = "default"
PATCH_A = "patch_embedding.lora_A.weight"
PATCH_B = "patch_embedding.lora_B.weight"


def peft_config(settings: LoraSettings) -> LoraConfig:
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha if settings.alpha is not None else settings.rank,
        target_modules=list(settings.target_modules),
        lora_dropout=settings.dropout,
        init_lora_weights=True,  # A Kaiming-uniform, B = 0: the adapted model starts as the base
    )


def freeze_base(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Base weights stop training and move to the compute dtype, except the modules diffusers keeps in
    fp32 (norms, time embedding, modulation tables); call before the adapters are added."""
    model.requires_grad_(False)
    cast_weights(model, dtype)


def add_lora(model, config: LoraConfig, adapter_name: str = ADAPTER) -> list[torch.nn.Parameter]:
    """Inject trainable fp32 adapters into ``model`` (base untouched); returns the adapter parameters.

    Raises a ValueError when ``target_modules`` matches no layer, or names a layer peft cannot adapt.
    """
    try:
        model.add_adapter(config, adapter_name)
    except ValueError as err:
        raise ValueError(
            f"model.lora.target_modules={sorted(config.target_modules)}: {err}. Valid names are layer "
            "suffixes such as to_q, to_k, to_v, to_out.0, ffn.net.0.proj, ffn.net.2, proj_out"
        ) from err
    params = adapter_parameters(model, adapter_name)
    for p in params:  # fp32 adapters on a bf16 base: AdamW updates of a few 1e-4 survive
        p.data = p.data.float()
        p.requires_grad_(True)
    return params


def adapter_parameters(model: torch.nn.Module, adapter_name: str = ADAPTER) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".lora_" in n and f".{adapter_name}." in n + "."]


# ----------------------------------------------------------------------------- key names


def to_diffusers(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """peft's state dict of our model (``blocks.0.attn1.to_q.lora_A.weight``) -> diffusers Wan keys
    (``transformer.blocks.0.attn1.to_q.lora_A.weight``), the patch-embedding factors as Conv3d ones."""
    cfg = model.config
    out = {}
    for key, t in state.items():
        if key == PATCH_A:  # (r, pt*ph*pw*c) -> (r, c, pt, ph, pw), the base weight's mapping
            t = ours_to_wan(PATCH_WEIGHT, t, cfg.patch_size, cfg.in_channels)
        elif key == PATCH_B:  # a Linear (D, r) is Wan's 1x1x1 Conv3d (D, r, 1, 1, 1)
            t = t[:, :, None, None, None]
        out[f"{PREFIX}.{key}"] = t.detach().contiguous()
    return out


def from_diffusers(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The inverse of ``to_diffusers``; a key outside ``transformer.`` raises a ValueError."""
    out = {}
    for key, t in state.items():
        if not key.startswith(PREFIX + "."):
            raise ValueError(
                f"{where}: LoRA key {key} is not for the transformer (e.g. a text encoder's or a Wan2.2 "
                "transformer_2 LoRA); only transformer LoRAs can be loaded"
            )
        key = key[len(PREFIX) + 1 :]
        if key == PATCH_A:
            t = wan_to_ours(PATCH_WEIGHT, t)
        elif key == PATCH_B:
            t = t.flatten(1)
        out[key] = t
    return out


def _diffsynth_to_original_wan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DiffSynth-Studio: ``blocks.0.self_attn.q.lora_A.default.weight`` (peft's infix over the original
    Wan names) -> ``diffusion_model.blocks.0.self_attn.q.lora_A.weight``, which diffusers converts."""
    out = {}
    for key, t in state.items():
        key = key.replace(".default.", ".")
        out[key if key.startswith("diffusion_model.") else "diffusion_model." + key] = t
    return out


def read_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """A LoRA file (or a folder holding ``pytorch_lora_weights.safetensors``) -> (diffusers-format
    state dict with ``transformer.`` keys, the peft config saved with it or None)."""
    from diffusers.loaders import WanLoraLoaderMixin
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from safetensors import safe_open

    path = Path(path)
    file = path / WEIGHT_NAME if path.is_dir() else path
    if not file.is_file() or file.suffix != ".safetensors":
        raise ValueError(
            f"LoRA path {path} is not a .safetensors file nor a folder with {WEIGHT_NAME}; pass the file "
            "that diffusers' save_lora_weights (or finetrainers, DiffSynth-Studio) wrote"
        )
    with safe_open(file, framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        header = f.metadata() or {}
    if not state:
        raise ValueError(f"{file} holds no tensors")
    if any(".lora_A.default." in k or ".lora_B.default." in k for k in state):
        state = _diffsynth_to_original_wan(state)
    metadata = None
    if LORA_ADAPTER_METADATA_KEY in header:
        # the pipeline's save packs the peft config as {"transformer.r": 4, ...}; the model's own
        # save_lora_adapter writes it unprefixed
        packed = json.loads(header[LORA_ADAPTER_METADATA_KEY])
        prefixed = {k[len(PREFIX) + 1 :]: v for k, v in packed.items() if k.startswith(PREFIX + ".")}
        metadata = prefixed or (packed if "r" in packed else None)
    state = WanLoraLoaderMixin.lora_state_dict(state)
    if not any(k.startswith(PREFIX + ".") for k in state):  # a bare peft state dict of the transformer
        state = {f"{PREFIX}.{k}": v for k, v in state.items()}
    return state, metadata


# ----------------------------------------------------------------------------- save and load


def lora_state(model, adapter_name: str = ADAPTER, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapter in diffusers' format. ``state`` (our named parameters, e.g. EMA copies) replaces the
    live values."""
    return to_diffusers(get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter_name), model)


def save_lora(model, directory: str | Path, adapter_name: str = ADAPTER, state: dict | None = None) -> Path:
    """Write ``directory/pytorch_lora_weights.safetensors`` with diffusers' own ``save_lora_weights``:
    ``WanPipeline.load_lora_weights(directory)`` loads it unchanged."""
    return _write_lora(model, directory, lora_state(model, adapter_name, state), adapter_name)


def save_stages_lora(model, directory: str | Path, state: dict[str, torch.Tensor]) -> Path:
    """``save_lora`` of the adapters of every pipeline stage: ``state`` maps each stage's adapter
    parameters (our names, adapter infix included: what the stages' checkpoints hold) to values, and
    ``model`` is one stage, whose model and peft configs they share. peft's ``get_peft_model_state_dict``
    keeps only the modules ``model`` holds, so the infix is dropped here as it does."""
    layers = to_diffusers({k.replace(f".{ADAPTER}.", "."): v for k, v in state.items()}, model)
    return _write_lora(model, directory, layers, ADAPTER)


def _write_lora(model, directory: str | Path, layers: dict[str, torch.Tensor], adapter_name: str) -> Path:
    from diffusers.loaders import WanLoraLoaderMixin

    layers = {k[len(PREFIX) + 1 :]: v.cpu() for k, v in layers.items()}
    config = model.peft_config[adapter_name].to_dict()
    if not isinstance(config.get("target_modules"), (str, type(None))):  # a set: its order varies by run
        config["target_modules"] = sorted(config["target_modules"])
    WanLoraLoaderMixin.save_lora_weights(
        directory, transformer_lora_layers=layers, transformer_lora_adapter_metadata=config
    )
    return Path(directory) / WEIGHT_NAME


def load_lora(model, path: str | Path, adapter_name: str = ADAPTER) -> LoraConfig:
    """Add the adapter of a diffusers-format (or converted) Wan LoRA file to ``model``; returns its
    config. Every key must land on a layer and every adapter weight must be in the file."""
    from diffusers.loaders import WanLoraLoaderMixin
    from diffusers.utils.peft_utils import _create_lora_config

    state, metadata = read_lora(path)
    # A text-to-video LoRA on an image-to-video model: diffusers adds zero adapters on the image K/V
    # (add_k_proj/add_v_proj) beside each attn2.to_k one; doing the same keeps both sides' keys equal.
    num_keys = len(state)
    state = WanLoraLoaderMixin._maybe_expand_t2v_lora_for_i2v(model, state)
    expanded = {k.split(".lora_")[0] for k in list(state)[num_keys:]}  # (diffusers names) added modules
    state = from_diffusers(state, str(path))
    # as diffusers' load_lora_adapter: ranks from the lora_B shapes, alpha from the metadata (else rank)
    ranks = {f"^{k}": v.shape[1] for k, v in state.items() if "lora_B" in k and v.ndim > 1}
    config = _create_lora_config(
        state, None, metadata, ranks, model_state_dict=model.state_dict(), adapter_name=adapter_name
    )
    if expanded and not isinstance(config.target_modules, str):  # the file's config names only to_k etc.
        config.target_modules = set(config.target_modules) | {k[len(PREFIX) + 1 :] for k in expanded}
    add_lora(model, config, adapter_name)
    set_adapter_state(model, state, adapter_name, str(path))
    return config


def set_adapter_state(model, state: dict[str, torch.Tensor], adapter_name: str, where: str) -> None:
    """Load a peft-format adapter state dict (our names) into the live adapter, strictly."""
    wanted = {k.replace(f".{adapter_name}.", "."): k for k in dict(model.named_parameters()) if ".lora_" in k}
    wanted = {k: v for k, v in wanted.items() if f".{adapter_name}." in v}
    unexpected = sorted(set(state) - set(wanted))
    missing = sorted(set(wanted) - set(state))
    if unexpected or missing:
        raise ValueError(
            f"{where}: LoRA keys do not fit the model: "
            + (f"unexpected {unexpected[:3]} ({len(unexpected)}) " if unexpected else "")
            + (f"missing {missing[:3]} ({len(missing)})" if missing else "")
            + "; the LoRA was trained for another model size or other target_modules"
        )
    try:
        set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    except RuntimeError as err:  # shape mismatches
        raise ValueError(f"{where}: {err}") from err


def set_lora_scale(model, scale: float, adapter_name: str = ADAPTER) -> None:
    """Scale the adapter's update by ``scale`` (1 = as trained, 0 = the base), as
    ``pipe.set_adapters(..., adapter_weights=scale)`` does."""
    for module in model.modules():
        if isinstance(module, BaseTunerLayer) and adapter_name in getattr(module, "scaling", {}):
            module.set_scale(adapter_name, scale)


def merge_lora(model, scale: float = 1.0) -> None:
    """Fold the adapters into the base weights and remove the peft layers: a plain VideoDiT again
    (``dit.wan_import.export_wan`` then writes a full diffusers transformer folder)."""
    model.fuse_lora(lora_scale=scale)
    model.unload_lora()


def setup_lora(model, settings: LoraSettings, init: str | None, dtype: torch.dtype) -> None:
    """What a LoRA run does to its freshly built base: freeze it in ``dtype``, add the adapter (from
    ``init``, a LoRA file to continue from, else fresh)."""
    freeze_base(model, dtype)
    if init is None:
        add_lora(model, peft_config(settings))
        return
    config = load_lora(model, init)
    if config.r != settings.rank and not config.rank_pattern:
        raise ValueError(
            f"model.lora_init={init} has rank {config.r} but model.lora.rank={settings.rank}; set "
            f"model.lora.rank={config.r} (the file decides the adapter's shape)"
        )
    for module in model.modules():  # the file's config has no say on training-time dropout
        if isinstance(module, BaseTunerLayer) and ADAPTER in getattr(module, "lora_dropout", {}):
            if settings.dropout > 0:
                module.lora_dropout[ADAPTER] = torch.nn.Dropout(settings.dropout)


# ----------------------------------------------------------------------------- training state


def adapter_values(model, path: str | Path, adapter_name: str = ADAPTER) -> dict[str, torch.Tensor]:
    """A LoRA file -> {our parameter name (with the adapter infix): tensor}, for the live adapter or
    its EMA copy."""
    state = from_diffusers(read_lora(path)[0], str(path))
    names = {n.replace(f".{adapter_name}.", "."): n for n, _ in model.named_parameters() if ".lora_" in n}
    missing = sorted(set(names) - set(state))
    if missing or len(state) != len(names):
        raise ValueError(
            f"{path}: its LoRA does not match this run's adapter (missing {missing[:3]}, "
            f"{len(state)} tensors for {len(names)} parameters); resume with the config it was saved with"
        )
    return {names[k]: v for k, v in state.items()}


def _experts_of(model):
    """[(name, folder, expert)] of a model.expert=both ExpertPair, else None."""
    from dit.experts import ExpertPair

    if not isinstance(model, ExpertPair):
        return None
    from dit.wan_pipeline_folders import EXPERT_FOLDERS

    return [(name, folder, getattr(model, name)) for name, folder in EXPERT_FOLDERS.items()]


def save_model_lora(model, directory: str | Path, state: dict[str, torch.Tensor] | None = None) -> list[Path]:
    """``save_lora``; of a model.expert=both pair, one file per expert, in the pipeline's folder names:
    ``directory/transformer/`` (high: ``pipe.load_lora_weights(that folder)``) and
    ``directory/transformer_2/`` (low: ``load_lora_weights(that folder, load_into_transformer_2=True)``)."""
    experts = _experts_of(model)
    if experts is None:
        return [save_lora(model, directory, state=state)]
    paths = []
    for name, folder, expert in experts:
        prefix = f"{name}."
        sub = (
            None if state is None else {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        )
        paths.append(save_lora(expert, Path(directory) / folder, state=sub))
    return paths


def stage_export(model, out: str | Path, step: int, ema: bool) -> list[Path] | None:
    """A pipeline stage (``dit/stages.py``) holds its blocks' adapters alone: its run's LoRA is the one
    its checkpoint of ``step`` (under ``out``) merged from every stage's (``ema/``, else ``model/``;
    ``dynamic_cp/runtime/pipeline_checkpoint.py``), copied to ``out``. None for a whole model
    (``save_model_lora`` exports it)."""
    import shutil

    from dit.stages import NotOnThisStage

    if not any(isinstance(m, NotOnThisStage) for m in model.modules()):
        return None
    source = Path(out) / "checkpoints" / f"step_{step:06d}" / ("ema" if ema else "model") / WEIGHT_NAME
    if not source.is_file():
        raise ValueError(
            f"{source} is missing: a pipeline stage holds only its blocks' adapters, so the run's LoRA is "
            "the merge its checkpoint of this step wrote; save one (train() does at train.max_steps) first"
        )
    shutil.copyfile(source, Path(out) / WEIGHT_NAME)
    return [Path(out) / WEIGHT_NAME]


def model_adapter_values(model, path: str | Path) -> dict[str, torch.Tensor]:
    """``adapter_values``; of a model.expert=both pair, each expert's from its folder of ``path``."""
    experts = _experts_of(model)
    if experts is None:
        return adapter_values(model, path)
    return {
        f"{name}.{k}": v
        for name, folder, expert in experts
        for k, v in adapter_values(expert, Path(path) / folder).items()
    }


class LoraFiles:
    """What ``dit.checkpoint.save_checkpoint`` saves for a model under LoRA: only the adapter, as
    ``pytorch_lora_weights.safetensors`` (``state``: {parameter name: tensor} in place of the live
    values, e.g. the EMA's)."""

    def __init__(self, model, state: dict[str, torch.Tensor] | None = None):
        self.model, self.state = model, state

    def save_pretrained(self, directory: str | Path) -> None:
        save_model_lora(self.model, directory, state=self.state)


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m dit.lora merge --base BASE --lora FILE --out DIR``: base + LoRA folded into one full
    diffusers WanTransformer3DModel folder (for tools that take no LoRA)."""
    import argparse
    import sys

    from dit.wan_import import export_wan, load_pretrained

    parser = argparse.ArgumentParser(prog="python -m dit.lora", description=main.__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="base + LoRA -> full diffusers transformer folder")
    merge.add_argument("--base", required=True, help="diffusers Wan transformer/pipeline folder, or ours")
    merge.add_argument("--lora", required=True, help="pytorch_lora_weights.safetensors or its folder")
    merge.add_argument("--scale", type=float, default=1.0)
    merge.add_argument("--out", required=True, help="new folder to write")
    args = parser.parse_args(argv)
    try:
        model = load_pretrained(args.base)
        load_lora(model, args.lora)
        merge_lora(model, args.scale)
        export_wan(model, args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}; load it with WanTransformer3DModel.from_pretrained('{args.out}')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
