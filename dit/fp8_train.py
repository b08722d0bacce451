"""Float8 training on GPUs: ``train.fp8`` through torchao's ``convert_to_float8_training``.

Each ``nn.Linear`` inside the transformer blocks whose two dimensions are multiples of 16 becomes a
torchao ``Float8Linear``: its three matmuls (forward, the input's and the weight's gradients) run
``torch._scaled_mm`` on e4m3 operands with dynamic scales, while the weight, its gradient and the
AdamW moments keep their dtype (fp32 master weights). Embedders, the head (``proj_out``) and
everything outside ``blocks`` stay as they are: they are a sliver of the FLOPs and the most
sensitive to precision, as torchtitan leaves its output layer out.

Recipes (``train.fp8_recipe``, torchao's names): ``tensorwise`` (one scale per tensor; the fastest,
and under FSDP2 the weight is all-gathered in fp8, ``enable_fsdp_float8_all_gather``) or
``rowwise`` (one scale per row, power-of-two scales; more accurate, all-gathered in bf16).

fp8 matmuls need a GPU of compute capability 8.9 or above (H100, H200, L40S, RTX 4090): elsewhere
the run is refused before any weight is built. torchao is the optional extra ``.[fp8]``; it is
imported only when ``train.fp8`` is on (its import prints to stderr).
"""

from __future__ import annotations

import torch
import torch.nn as nn

FP8_RECIPES = ("tensorwise", "rowwise")
INSTALL = 'pip install -c constraints.txt -e ".[fp8]"'


def check_fp8_settings(fp8, recipe) -> None:
    """ValueError naming the fix for ``train.fp8`` / ``train.fp8_recipe`` values that mean nothing."""
    if not isinstance(fp8, bool):
        raise ValueError(f"train.fp8={fp8!r} must be true or false")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8_recipe={recipe!r}; choose one of {', '.join(FP8_RECIPES)}")


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's ``module_filter_fn``: a linear inside ``blocks`` (``blocks.N...``, or an expert's
    ``high.blocks.N...``) whose in and out features are multiples of 16 (``_scaled_mm``'s rule)."""
    return (
        type(module) is nn.Linear
        and "blocks" in fqn.split(".")[:-1]
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def fp8_targets(model: nn.Module) -> list[str]:
    """Names of the linears ``convert_to_fp8`` would convert, in module order."""
    return [name for name, m in model.named_modules() if fp8_filter(m, name)]


def check_fp8_runs(fp8: bool, lora: bool, device: torch.device) -> None:
    """ValueError, one line naming the fix, when ``train.fp8`` cannot run here: a LoRA run (its base
    is frozen), a device without fp8 matmuls, or torchao missing."""
    if not fp8:
        return
    if lora:
        raise ValueError(
            "train.fp8=true converts the trained linears; a LoRA base is frozen: set train.fp8=false "
            "and store the base in fp8 with model.base_dtype=fp8_scaled"
        )
    if device.type != "cuda":
        raise ValueError(
            f"train.fp8=true needs fp8 matmuls on a CUDA GPU of compute capability 8.9+ (H100, L40S, "
            f"RTX 4090); this run's device is {device.type}: set train.fp8=false"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"train.fp8=true: {torch.cuda.get_device_name(device)} has compute capability {major}.{minor}, "
            "fp8 matmuls need 8.9+ (H100, L40S, RTX 4090): set train.fp8=false"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ValueError(f"train.fp8=true needs torchao: {INSTALL}, or set train.fp8=false") from None


def convert_to_fp8(model: nn.Module, recipe: str, fsdp_all_gather: bool = False) -> list[str]:
    """Swap ``fp8_targets(model)`` for torchao ``Float8Linear``s in place -> their names.
    ``fsdp_all_gather``: the run shards with FSDP2; under ``tensorwise`` the weights are then
    all-gathered in fp8 (rowwise gathers bf16: torchao has no rowwise fp8 all-gather)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = fp8_targets(model)
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_filter)
    return names
