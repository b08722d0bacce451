"""The model-family registry: each family's classes, its diffusers name and its blocks."""

from __future__ import annotations

import pytest
from diffusers import HunyuanVideo15Transformer3DModel, WanTransformer3DModel

from dit.families.hunyuan_video15.model import HunyuanVideo15DiT
from dit.families.registry import FAMILIES, family_of_config, get_family
from dit.model import VideoDiT

HY = dict(
    num_attention_heads=2, attention_head_dim=6, num_layers=3, num_refiner_layers=1, rope_axes_dim=(2, 2, 2)
)
HY_DIMS = dict(text_embed_dim=6, text_embed_2_dim=5, image_embed_dim=4, in_channels=3, out_channels=2)


def _config_json(model) -> dict:
    """What a diffusers folder's config.json holds (the class name included)."""
    import json

    return json.loads(model.to_json_string())


def test_a_hunyuan_folder_config_builds_our_model_and_names_its_blocks():
    config = _config_json(HunyuanVideo15Transformer3DModel(**HY, **HY_DIMS))
    family = family_of_config(config)
    assert family is get_family("hunyuan-video15")
    model = family.from_diffusers_config(config)
    assert type(model) is family.transformer is HunyuanVideo15DiT
    assert model.config.num_layers == 3 and model.config.text_embed_dim == 6
    blocks = family.blocks(model)
    assert len(blocks) == 3 and blocks is model.transformer_blocks


def test_a_wan_folder_config_builds_a_videodit():
    config = _config_json(
        WanTransformer3DModel(
            num_attention_heads=2, attention_head_dim=6, num_layers=2, ffn_dim=8, text_dim=4
        )
    )
    family = family_of_config(config)
    assert family.name == "wan"
    model = family.from_diffusers_config(config)
    assert type(model) is family.transformer is VideoDiT
    assert family.blocks(model) is model.blocks and len(model.blocks) == 2


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown model family 'ltx'; known: hunyuan-video15, wan"):
        get_family("ltx")
    with pytest.raises(ValueError, match="'FluxTransformer2DModel'; the model families know: Hunyuan"):
        family_of_config({"_class_name": "FluxTransformer2DModel"})
    assert sorted(FAMILIES) == ["hunyuan-video15", "wan"]


def test_families_are_read_only_declarations():
    """One Family object is shared by every reader: none may change it for the others."""
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        get_family("wan").blocks_attr = "layers"
