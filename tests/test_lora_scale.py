"""The LoRA update a user configures: scale alpha / rank (alpha unset: 1), --lora-scale, merge, dropout.

Each adapted layer computes base(x) + scale * B A x (peft's LoRA). The tests set A and B to known
values on a tiny VideoDiT and read the update off one adapted layer: an exact float32 check of the
scale (the update is compared with (alpha / r) * B A x computed the same way, to a few ulps).
"""

from __future__ import annotations

import pytest
import torch

from dit import lora
from dit.model_config import LoraSettings, ModelConfig
from dit.setup import build_model

LAYER = "blocks.0.attn1.to_q"


def _adapted(settings: LoraSettings):
    torch.manual_seed(0)
    model = build_model(ModelConfig(size="tiny", overrides={"num_layers": 1, "ffn_dim": 32}))
    lora.freeze_base(model, torch.float32)
    lora.add_lora(model, lora.peft_config(settings))
    layer = model.get_submodule(LAYER)
    with torch.no_grad():  # B = 0 at init (the identity); give the update a known non-zero value
        for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
            p.copy_(torch.randn_like(p))
    return model, layer


def _update(layer, x):
    """(what the layer adds to its base, B A x)."""
    with torch.no_grad():
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        return layer(x) - layer.base_layer(x), x @ a.T @ b.T


@pytest.mark.parametrize("alpha, scale", [(None, 1.0), (8.0, 4.0), (1.0, 0.5)])
def test_update_is_scaled_by_alpha_over_rank_and_unset_alpha_means_rank(alpha, scale):
    _, layer = _adapted(LoraSettings(rank=2, alpha=alpha, target_modules=["to_q"]))
    x = torch.randn(5, layer.in_features)
    got, ba = _update(layer, x)
    torch.testing.assert_close(got, scale * ba, rtol=1e-5, atol=1e-6)  # float32 sums of a few terms


def test_lora_scale_and_merge_scale_the_update():
    model, layer = _adapted(LoraSettings(rank=2, target_modules=["to_q"]))
    x = torch.randn(5, layer.in_features)
    _, ba = _update(layer, x)
    base = layer.base_layer(x).detach()
    lora.set_lora_scale(model, 0.25)
    torch.testing.assert_close(_update(layer, x)[0], 0.25 * ba, rtol=1e-5, atol=1e-6)
    lora.set_lora_scale(model, 1.0)
    lora.merge_lora(model, scale=0.5)  # folded into the base weight at half strength
    with torch.no_grad():
        merged = torch.nn.functional.linear(x, layer.base_layer.weight, layer.base_layer.bias)
    torch.testing.assert_close(merged, base + 0.5 * ba, rtol=1e-5, atol=1e-5)


def test_only_the_target_modules_are_adapted_with_the_configured_dropout():
    model, _ = _adapted(LoraSettings(rank=2, target_modules=["to_q", "to_v"], dropout=0.25))
    adapted = sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A"))
    assert adapted == [
        "blocks.0.attn1.to_q",
        "blocks.0.attn1.to_v",
        "blocks.0.attn2.to_q",
        "blocks.0.attn2.to_v",
    ]
    assert model.get_submodule(LAYER).lora_dropout["default"].p == 0.25
    assert model.get_submodule(LAYER).lora_A["default"].weight.shape[0] == 2  # the rank
    params = lora.adapter_parameters(model)
    assert len(params) == 8 and all(p.requires_grad and p.dtype == torch.float32 for p in params)


def test_frozen_base_moves_to_the_compute_dtype_except_diffusers_fp32_modules():
    torch.manual_seed(0)
    model = build_model(ModelConfig(size="tiny", overrides={"num_layers": 1, "ffn_dim": 32}))
    lora.freeze_base(model, torch.bfloat16)
    keep = set(model._keep_in_fp32_modules)  # norms, time embedding, modulation tables
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert not any(p.requires_grad for p in model.parameters())
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["blocks.0.scale_shift_table"] == torch.float32
    for n, dtype in dtypes.items():
        assert dtype == (torch.float32 if keep & set(n.split(".")) else torch.bfloat16), n


def test_saved_file_loads_back_under_a_chosen_adapter_name(tmp_path):
    model, layer = _adapted(LoraSettings(rank=2, alpha=4.0, target_modules=["to_q"]))
    path = lora.save_lora(model, tmp_path / "adapter")
    assert path == tmp_path / "adapter" / lora.WEIGHT_NAME and path.is_file()
    x = torch.randn(5, layer.in_features)
    want = layer(x).detach()
    torch.manual_seed(0)  # the same base weights as _adapted's model
    other = build_model(ModelConfig(size="tiny", overrides={"num_layers": 1, "ffn_dim": 32}))
    lora.freeze_base(other, torch.float32)
    config = lora.load_lora(other, path, adapter_name="trained")  # what sample.py does for a LoRA run
    assert (config.r, config.lora_alpha) == (2, 4.0)
    assert lora.adapter_parameters(other, "trained") and not lora.adapter_parameters(other)
    torch.testing.assert_close(other.get_submodule(LAYER)(x), want, rtol=1e-6, atol=1e-7)
