"""Wan2.1 checkpoints in diffusers format <-> VideoDiT, by explicit name mapping with shape checks.

    model = load_pretrained("/ckpt/Wan2.1-T2V-1.3B-Diffusers")        # pipeline or transformer/ folder
    export_wan(model, "/out/wan-finetuned/transformer")                 # WanTransformer3DModel.from_pretrained loads it

    python -m dit.wan_import export --checkpoint runs/wan-1.3b --out DIR   # trained run -> diffusers
    python -m dit.wan_import import --wan DIR --out DIR                    # diffusers -> our format

VideoDiT carries diffusers' parameter names, so the mapping is the identity except one tensor: Wan
embeds patches with a strided Conv3d, weight (D, c, pt, ph, pw); ours is a Linear over patches laid
out (pt, ph, pw, c) (``dit/packing.py``), weight (D, pt*ph*pw*c). That permutation is exact, so
export followed by import is bitwise lossless.

Memory: a 14B checkpoint is ~57 GB in fp32. Import builds the model with parameters on the meta
device and then reads one tensor at a time from the (possibly sharded) safetensors files, so the
peak is the model plus one tensor; export writes one shard at a time.

Image conditioning (Wan2.1 I2V/FLF2V: ``image_dim``, ``added_kv_proj_dim``, ``pos_embed_seq_len``)
maps one to one as well. Wan2.2 TI2V-5B is a plain Wan transformer; its pipeline's ``expand_timesteps``
(``model_index.json``) becomes our ``expand_timesteps`` config field. Wan2.2 A14B pipelines hold two
Wan2.1-14B-shaped experts, ``transformer/`` (high noise) and ``transformer_2/`` (low noise); ``expert``
picks one (``dit/wan_pipeline_folders.py`` finds the folders).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from dit.model import VideoDiT
from dit.wan_pipeline_folders import DOWNLOAD_HINT, pipeline_expand_timesteps, transformer_folder

WAN_CLASS = "WanTransformer3DModel"
OUR_CLASS = VideoDiT.__name__
WAN_TEXT_LEN = 512  # every Wan pipeline zero-pads umT5 captions to this many tokens
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
PATCH_WEIGHT = "patch_embedding.weight"

# Wan config keys VideoDiT takes unchanged.
SHARED_KEYS = (
    "patch_size",
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    "cross_attn_norm",
    "eps",
    "rope_max_seq_len",
    # image conditioning (Wan2.1 I2V / FLF2V); None in text-to-video configs
    "image_dim",
    "added_kv_proj_dim",
    "pos_embed_seq_len",
)
# diffusers drops these on load too (``WanTransformer3DModel._keys_to_ignore_on_load_unexpected``).
IGNORED_KEY_PARTS = ("norm_added_q",)


# ----------------------------------------------------------------------------- configs


def _wan_defaults() -> dict:
    from diffusers import WanTransformer3DModel

    params = inspect.signature(WanTransformer3DModel.__init__).parameters
    return {k: p.default for k, p in params.items() if k != "self"}


def videodit_config(
    wan_config: Mapping, text_pad_len: int | None = WAN_TEXT_LEN, expand_timesteps: bool = False
) -> dict:
    """A diffusers WanTransformer3DModel config -> VideoDiT keyword arguments (ValueError if unsupported).

    ``expand_timesteps`` is the pipeline's (``model_index.json``; Wan2.2 TI2V), not the transformer's."""
    cls = wan_config.get("_class_name", WAN_CLASS)
    if cls != WAN_CLASS:
        raise ValueError(f"config _class_name is {cls!r}, not {WAN_CLASS!r}; pass a Wan transformer folder")
    defaults = _wan_defaults()
    unknown = sorted(k for k in wan_config if not k.startswith("_") and k not in defaults)
    if unknown:
        raise ValueError(
            f"Wan config key {unknown[0]!r} is unknown to diffusers' {WAN_CLASS} (known: "
            f"{', '.join(sorted(defaults))}); this checkpoint is a variant the importer does not map"
        )
    qk_norm = wan_config.get("qk_norm", defaults["qk_norm"])
    if qk_norm not in ("rms_norm_across_heads", None):
        raise ValueError(f"Wan config qk_norm={qk_norm!r}; only 'rms_norm_across_heads' is supported")
    kwargs = {k: wan_config.get(k, defaults[k]) for k in SHARED_KEYS}
    kwargs["patch_size"] = tuple(kwargs["patch_size"])
    # diffusers' WanAttention builds and applies norm_q/norm_k whatever qk_norm says, so both values
    # mean RMS norm across heads.
    return {
        **kwargs,
        "qk_norm": True,
        "adaln_zero_init": False,
        "text_pad_len": text_pad_len,
        "expand_timesteps": bool(expand_timesteps),
    }


def wan_config(model: VideoDiT) -> dict:
    """VideoDiT -> the config.json of the equivalent diffusers WanTransformer3DModel."""
    import diffusers

    cfg = model.config
    if not cfg.qk_norm:
        raise ValueError(
            "this model was built with qk_norm=False, but Wan always RMS-normalizes q and k; "
            "only qk_norm=True models can be exported to the Wan format"
        )
    if cfg.text_pad_len != WAN_TEXT_LEN:
        warnings.warn(
            f"model has text_pad_len={cfg.text_pad_len} but Wan pipelines pad captions to "
            f"max_sequence_length={WAN_TEXT_LEN}; call the pipeline with max_sequence_length="
            f"{cfg.text_pad_len} (or expect different outputs)",
            stacklevel=3,
        )
    out = {"_class_name": WAN_CLASS, "_diffusers_version": diffusers.__version__}
    out.update({k: cfg[k] for k in SHARED_KEYS})
    out["patch_size"] = list(cfg.patch_size)
    out["out_channels"] = cfg.out_channels or cfg.in_channels
    out["qk_norm"] = "rms_norm_across_heads"
    return out


# ----------------------------------------------------------------------------- tensor names


def wan_to_ours(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Wan tensor in our layout. Conv3d (D, c, pt, ph, pw) -> Linear (D, pt*ph*pw*c)."""
    if name == PATCH_WEIGHT:
        return tensor.permute(0, 2, 3, 4, 1).reshape(tensor.shape[0], -1).contiguous()
    return tensor


def ours_to_wan(name: str, tensor: torch.Tensor, patch_size, in_channels: int) -> torch.Tensor:
    """The inverse of ``wan_to_ours``."""
    if name == PATCH_WEIGHT:
        return tensor.reshape(tensor.shape[0], *patch_size, in_channels).permute(0, 4, 1, 2, 3).contiguous()
    return tensor


def _wan_shape(name: str, shape: tuple, patch_size, in_channels: int) -> tuple:
    return (shape[0], in_channels, *patch_size) if name == PATCH_WEIGHT else tuple(shape)


def _check_names(model: VideoDiT, shapes: Mapping[str, tuple], where: str) -> list[str]:
    """Check checkpoint names and shapes against the model; returns the names to load, in file order.

    Raises a ValueError naming the first unexpected, mismatching or missing tensor.
    """
    cfg = model.config
    expected = {
        name: _wan_shape(name, tuple(p.shape), cfg.patch_size, cfg.in_channels)
        for name, p in model.named_parameters()
    }
    if any(k.startswith(("blocks.0.self_attn.", "head.head.")) for k in shapes):
        raise ValueError(
            f"{where} holds the original Wan format (names like blocks.0.self_attn.q.weight), not the "
            f"diffusers one; {DOWNLOAD_HINT}"
        )
    names = []
    for name, shape in shapes.items():
        if any(part in name.split(".") for part in IGNORED_KEY_PARTS):
            continue
        if name not in expected:
            raise ValueError(
                f"{where}: unexpected tensor {name} {list(shape)}; the model built from its config.json "
                "has no such parameter (an I2V or other Wan variant, or a config that does not match)"
            )
        if tuple(shape) != expected[name]:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(shape)} but the model built from its config.json "
                f"expects {list(expected[name])}; the config does not describe these weights"
            )
        names.append(name)
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise ValueError(
            f"{where}: tensor {missing[0]} {list(expected[missing[0]])} is missing ({len(missing)} "
            "missing in all); the checkpoint is incomplete or its config.json has more layers"
        )
    return names


# ----------------------------------------------------------------------------- import


def _empty_model(kwargs: dict) -> VideoDiT:
    """VideoDiT with parameters on the meta device (no memory, no init) and real RoPE buffers."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return VideoDiT(**kwargs)


def _fill(model: VideoDiT, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> VideoDiT:
    """Replace meta parameters by (name, Wan-layout tensor) pairs, one at a time."""
    keep_fp32 = set(model._keep_in_fp32_modules or ())
    for name, tensor in tensors:
        module_name, _, leaf = name.rpartition(".")
        # As diffusers does: norms, time embedding and modulation tables stay fp32 in a bf16 model.
        target = torch.float32 if keep_fp32 & set(name.split(".")) else dtype
        value = wan_to_ours(name, tensor).to(target)
        model.get_submodule(module_name)._parameters[leaf] = nn.Parameter(value, requires_grad=True)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"parameters not loaded: {left[:3]}"  # _check_names guarantees this
    return model.eval()


def import_wan_state_dict(
    wan_config: Mapping,
    state_dict: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    text_pad_len: int | None = WAN_TEXT_LEN,
) -> VideoDiT:
    """A diffusers WanTransformer3DModel config + state dict -> VideoDiT computing the same function.

    Tensors that need no conversion are used in place (no copy). ``text_pad_len`` pads captions as the
    Wan pipeline does (see ``dit.model.pad_text``); None feeds them as given.
    """
    model = _empty_model(videodit_config(wan_config, text_pad_len))
    names = _check_names(model, {k: tuple(v.shape) for k, v in state_dict.items()}, "state dict")
    return _fill(model, ((n, state_dict[n]) for n in names), dtype)


class SafetensorsCheckpoint:
    """One safetensors file or a sharded set with an index: names and shapes from the headers, then
    tensors one at a time, shard by shard."""

    def __init__(self, folder: Path):
        if (folder / INDEX_NAME).is_file():
            weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
            self.files = [folder / f for f in dict.fromkeys(weight_map.values())]
        elif (folder / WEIGHTS_NAME).is_file():
            self.files = [folder / WEIGHTS_NAME]
        else:
            found = sorted(p.name for p in folder.iterdir())
            raise ValueError(
                f"{folder} has neither {WEIGHTS_NAME} nor {INDEX_NAME} (found: {', '.join(found) or 'nothing'}); "
                "point at a diffusers transformer folder with safetensors weights"
            )
        for file in self.files:
            if not file.is_file():
                raise ValueError(f"shard {file.name} listed in {INDEX_NAME} is missing from {folder}")
        self.shapes: dict[str, tuple] = {}
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = set(names)
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in wanted:
                        yield key, f.get_tensor(key)


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    text_pad_len: int | None = WAN_TEXT_LEN,
    expert: str | None = None,
) -> VideoDiT:
    """VideoDiT from a folder holding our save_pretrained output or a diffusers Wan transformer.

    A Wan pipeline folder (with ``transformer/``) works too; of a Wan2.2 A14B one, ``expert``'s
    transformer. Our own format keeps its saved config (``text_pad_len`` included); ``text_pad_len``
    here applies to Wan checkpoints.
    """
    folder = transformer_folder(path, expert)
    config = json.loads((folder / "config.json").read_text())
    cls = config.get("_class_name")
    if cls == OUR_CLASS:
        return VideoDiT.from_pretrained(folder, torch_dtype=dtype)
    if cls != WAN_CLASS:
        raise ValueError(
            f"{folder}/config.json is a {cls!r}; expected {WAN_CLASS} (diffusers Wan) or {OUR_CLASS} (ours)"
        )
    model = _empty_model(videodit_config(config, text_pad_len, pipeline_expand_timesteps(path)))
    checkpoint = SafetensorsCheckpoint(folder)
    names = _check_names(model, checkpoint.shapes, str(folder))
    return _fill(model, checkpoint.tensors(names), dtype)


# ----------------------------------------------------------------------------- export


def export_wan(
    model: VideoDiT, out_dir: str | Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 10 * 2**30
) -> Path:
    """Write ``model`` as a diffusers WanTransformer3DModel folder (config.json + safetensors).

    dtype None keeps each tensor's dtype (a cast keeps diffusers' fp32 modules in fp32). Checkpoints over ``max_shard_bytes`` are sharded with an index,
    as diffusers writes them; one shard is converted and written at a time.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new output folder or delete it")
    config = wan_config(model)
    cfg = model.config
    state = model.state_dict()  # references, not copies
    # Norms, time embedding and modulation tables stay fp32 in a bf16 export, as diffusers keeps them.
    keep_fp32 = set(model._keep_in_fp32_modules or ()) if dtype is not None else set()
    sizes = {n: t.numel() * (dtype or t.dtype).itemsize for n, t in state.items()}
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards):
        file = (
            WEIGHTS_NAME
            if len(shards) == 1
            else f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name in names:
            t = ours_to_wan(name, state[name].detach(), cfg.patch_size, cfg.in_channels)
            target = torch.float32 if keep_fp32 & set(name.split(".")) else dtype
            tensors[name] = (t if target is None else t.to(target)).contiguous().cpu()
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------- command line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _load_trained(path: Path, weights: str) -> VideoDiT:
    """A save_pretrained folder, or a run / step checkpoint whose ``ema`` or ``model`` weights to take."""
    if (path / "config.json").is_file():
        return load_pretrained(path)
    from dit.checkpoint import resolve_checkpoint

    step = resolve_checkpoint(path)
    folder = step / weights
    if not (folder / "config.json").is_file():
        raise ValueError(f"{step} has no {weights}/ weights; pass --weights model or another checkpoint")
    return load_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dit.wan_import", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="our checkpoint -> diffusers WanTransformer3DModel folder")
    exp.add_argument("--checkpoint", required=True, help="run dir, step dir, or save_pretrained folder")
    exp.add_argument("--weights", choices=("ema", "model"), default="ema", help="which weights of a run")
    exp.add_argument("--out", required=True, help="new folder to write (e.g. PIPELINE/transformer)")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast on export (default: keep)")
    exp.add_argument("--max-shard-gb", type=float, default=10.0)
    imp = sub.add_parser("import", help="diffusers Wan transformer (or pipeline) folder -> our format")
    imp.add_argument("--wan", required=True, help="Wan pipeline or transformer folder")
    imp.add_argument("--out", required=True, help="new folder for VideoDiT.save_pretrained")
    imp.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    imp.add_argument(
        "--expert", choices=("high", "low"), default=None, help="of a Wan2.2 A14B folder: which expert"
    )
    args = parser.parse_args(argv)
    try:
        _run(args)
    except ValueError as err:  # a user's mistake: the message says how to fix it, no traceback needed
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> None:
    if args.command == "export":
        model = _load_trained(Path(args.checkpoint), args.weights)
        dtype = DTYPES[args.dtype] if args.dtype else None
        out = export_wan(model, args.out, dtype, int(args.max_shard_gb * 2**30))
        print(f"wrote {out} ({WAN_CLASS}); load it with WanTransformer3DModel.from_pretrained('{out}')")
    else:
        model = load_pretrained(args.wan, DTYPES[args.dtype], expert=args.expert)
        model.save_pretrained(args.out)
        print(f"wrote {args.out} ({OUR_CLASS}); fine-tune with model.pretrained={args.out}")


if __name__ == "__main__":
    sys.exit(main())
