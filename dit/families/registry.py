"""The model-family seam: a family's name -> what it declares, read instead of branching on it.

A family declares its packed transformer class, the diffusers transformer class it stands for (a
diffusers folder's ``config.json`` names it in ``_class_name``), how that config builds ours, and
which module list holds its repeated blocks (what checkpointing, offload and sharding act on).
Wan is declared as it already runs (``dit/wan_import.py`` maps its names); HunyuanVideo-1.5's
state dict is diffusers' own. Nothing reads this but the tests yet: the rest of the stack moves
onto it step by step (issue 56).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.nn as nn

from dit.families.hunyuan_video15.model import HunyuanVideo15DiT
from dit.model import VideoDiT
from dit.wan_import import WAN_CLASS, videodit_config


@dataclass(frozen=True)
class Family:
    name: str
    transformer: type[nn.Module]  # our packed transformer
    diffusers_class: str  # the ``_class_name`` of its diffusers transformer
    from_diffusers_config: Callable[[Mapping], nn.Module]  # that config -> ours, untrained weights
    blocks_attr: str  # attribute of the transformer holding the repeated blocks

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The model's repeated blocks, in order."""
        return getattr(model, self.blocks_attr)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("wan", VideoDiT, WAN_CLASS, lambda cfg: VideoDiT(**videodit_config(cfg)), "blocks"),
        Family(
            "hunyuan-video15",
            HunyuanVideo15DiT,
            "HunyuanVideo15Transformer3DModel",
            HunyuanVideo15DiT.from_config,
            "transformer_blocks",
        ),
    )
}


def get_family(name: str) -> Family:
    """The family called ``name``; ValueError listing the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def family_of_config(config: Mapping) -> Family:
    """The family whose diffusers transformer a ``config.json`` describes (its ``_class_name``)."""
    cls = config.get("_class_name")
    for family in FAMILIES.values():
        if family.diffusers_class == cls:
            return family
    known = ", ".join(sorted(f.diffusers_class for f in FAMILIES.values()))
    raise ValueError(f"config _class_name is {cls!r}; the model families know: {known}")
