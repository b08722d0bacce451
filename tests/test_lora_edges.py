"""dit/lora.py's smaller promises, on a tiny VideoDiT in one process (seconds): what ``add_lora``
hands the optimizer, ``lora_state`` of a named adapter, ``merge_lora``'s default strength, and a
file whose adapters carry a bias (peft's ``lora_bias``). Written from the survivors of
``tools/mutation.py dit/lora.py``; each test names the planted bug it fails on."""

from __future__ import annotations

import torch
from test_lora_files import LAYER
from test_lora_files import _base as base_model

from dit import lora
from dit.model_config import LoraSettings, ModelConfig
from dit.setup import build_model


def _base(seed: int = 0):
    return base_model(seed, torch.bfloat16)


def _randomize(params, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn_like(p))


def test_add_lora_returns_the_adapters_parameters_in_float32_for_the_optimizer():
    """The optimizer trains what ``add_lora`` returns: every adapter weight, float32 on a bf16 base,
    requiring grad. Planted: ``return None`` -> fails."""
    model = _base()
    params = lora.add_lora(model, lora.peft_config(LoraSettings(rank=2, target_modules=["to_q", "to_v"])))
    assert params is not None and len(params) == 8  # lora_A, lora_B of to_q, to_v in attn1 and attn2
    assert {id(p) for p in params} == {id(p) for p in lora.adapter_parameters(model)}
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)


def test_lora_state_writes_the_named_adapter_not_the_default_one():
    """A model holding two adapters saves the one asked for. Planted: ``adapter_name`` not passed to
    peft's ``get_peft_model_state_dict`` (so 'default' is written) -> fails."""
    model = _base()
    lora.add_lora(model, lora.peft_config(LoraSettings(rank=2, target_modules=["to_q"])))
    lora.add_lora(model, lora.peft_config(LoraSettings(rank=2, target_modules=["to_q"])), "other")
    _randomize(lora.adapter_parameters(model), 1)
    _randomize(lora.adapter_parameters(model, "other"), 2)
    layer = model.get_submodule(LAYER)
    state = lora.lora_state(model, "other")
    a = next(v for k, v in state.items() if k.endswith("attn1.to_q.lora_A.weight"))
    torch.testing.assert_close(a, layer.lora_A["other"].weight, rtol=0, atol=0)
    assert not torch.equal(a, layer.lora_A["default"].weight)


def test_merge_lora_folds_the_update_at_full_strength_by_default():
    """``merge_lora(model)`` gives the weights the adapted model computes with. Planted: default scale
    2.0 -> fails."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(size="tiny", overrides={"num_layers": 1, "ffn_dim": 32}))
    lora.freeze_base(model, torch.float32)
    lora.add_lora(model, lora.peft_config(LoraSettings(rank=2, alpha=4.0, target_modules=["to_q"])))
    _randomize(lora.adapter_parameters(model), 1)
    layer = model.get_submodule(LAYER)
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        want = layer(x)
        folded = (
            layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        ).abs()
        lora.merge_lora(model)
        got = model.get_submodule(LAYER)(x)
    # Both sides sum in_features float32 products of the same values, in other orders and with the
    # fold rounded once per weight: |difference| <= 2 * in_features * eps * (|W + s B A| |x|) to first
    # order (scale s = alpha / rank = 2). A default scale of 2 moves y by the whole update, far above.
    bound = 2 * layer.in_features * torch.finfo(torch.float32).eps * (x.abs() @ folded.T) + 1e-6
    assert ((got - want).abs() <= bound).all()


def test_a_file_whose_adapters_carry_a_bias_loads_back(tmp_path):
    """peft's ``lora_bias`` gives lora_B a 1-D bias; the loader takes ranks from 2-D lora_B weights
    only. Planted: ``v.ndim > 1`` -> ``>= 1`` (the bias's missing second dimension) -> fails."""
    from peft import LoraConfig

    model = _base()
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"], lora_bias=True)
    lora.add_lora(model, config)
    _randomize(lora.adapter_parameters(model), 1)
    path = lora.save_lora(model, tmp_path / "biased")
    other = _base()
    loaded = lora.load_lora(other, path)
    assert loaded.r == 2 and loaded.lora_bias
    layer, back = model.get_submodule(LAYER), other.get_submodule(LAYER)
    torch.testing.assert_close(back.lora_B["default"].bias, layer.lora_B["default"].bias, rtol=0, atol=0)
