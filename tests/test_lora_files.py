"""dit/lora.py's files and command line on a tiny VideoDiT, in one process and seconds: the diffusers
key names (and the patch embedding's Conv3d shapes), what ``read_lora`` accepts and refuses, strict
loading, the scale, continuing a run from a LoRA file, the EMA's values in a saved adapter, and
``python -m dit.lora merge``. The round trips through diffusers' own pipeline are in test_lora.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dit import lora
from dit.model_config import LoraSettings, ModelConfig
from dit.setup import build_model
from dit.wan_import import PATCH_WEIGHT, ours_to_wan

LAYER = "blocks.0.attn1.to_q"


def _base(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A one-block tiny model, its base frozen in ``dtype``."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(size="tiny", overrides={"num_layers": 1, "ffn_dim": 32}))
    lora.freeze_base(model, dtype)
    return model


def _adapted(rank=2, alpha=None, targets=("to_q", "patch_embedding"), seed=1):
    model = _base()
    lora.add_lora(model, lora.peft_config(LoraSettings(rank=rank, alpha=alpha, target_modules=list(targets))))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in lora.adapter_parameters(model):
            p.copy_(torch.randn_like(p))
    return model


def _update(model, name=LAYER):
    layer = model.get_submodule(name)
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return layer(x) - layer.base_layer(x)


def test_diffusers_names_and_the_patch_embeddings_conv3d_shapes():
    model = _adapted()
    state = lora.lora_state(model)
    assert sorted(state) == [
        "transformer.blocks.0.attn1.to_q.lora_A.weight", "transformer.blocks.0.attn1.to_q.lora_B.weight",
        "transformer.blocks.0.attn2.to_q.lora_A.weight", "transformer.blocks.0.attn2.to_q.lora_B.weight",
        "transformer.patch_embedding.lora_A.weight", "transformer.patch_embedding.lora_B.weight",
    ]  # fmt: skip
    live = dict(model.named_parameters())
    a = live["patch_embedding.lora_A.default.weight"]  # (r, pt*ph*pw*c)
    b = live["patch_embedding.lora_B.default.weight"]  # (D, r)
    cfg = model.config
    torch.testing.assert_close(
        state["transformer.patch_embedding.lora_A.weight"], ours_to_wan(PATCH_WEIGHT, a, cfg.patch_size, cfg.in_channels)
    )  # fmt: skip
    assert state["transformer.patch_embedding.lora_A.weight"].shape == (2, cfg.in_channels, *cfg.patch_size)
    torch.testing.assert_close(state["transformer.patch_embedding.lora_B.weight"], b[:, :, None, None, None])
    torch.testing.assert_close(state["transformer.blocks.0.attn1.to_q.lora_A.weight"], live[f"{LAYER}.lora_A.default.weight"])  # fmt: skip
    assert all(t.is_contiguous() and not t.requires_grad for t in state.values())
    back = lora.from_diffusers(state, "x")
    torch.testing.assert_close(back["patch_embedding.lora_A.weight"], a.detach())
    torch.testing.assert_close(back["patch_embedding.lora_B.weight"], b.detach())
    assert sorted(back) == sorted(k[len("transformer.") :] for k in state)


def test_a_key_outside_the_transformer_is_refused_by_name():
    with pytest.raises(ValueError, match="my.safetensors: LoRA key text_encoder.x.lora_A.weight is not for the transformer"):  # fmt: skip
        lora.from_diffusers({"text_encoder.x.lora_A.weight": torch.zeros(1)}, "my.safetensors")
    with pytest.raises(ValueError, match="transformer_2"):
        lora.from_diffusers({"transformer_2.blocks.0.lora_A.weight": torch.zeros(1)}, "f")


def test_saved_lora_keeps_its_config_and_loads_back_exactly(tmp_path):
    model = _adapted(rank=2, alpha=6.0)
    path = lora.save_lora(model, tmp_path / "a")
    state, metadata = lora.read_lora(tmp_path / "a")  # the folder
    assert metadata["r"] == 2 and metadata["lora_alpha"] == 6.0
    assert sorted(state) == sorted(lora.lora_state(model))
    other = _base()
    config = lora.load_lora(other, path)
    assert (config.r, config.lora_alpha) == (2, 6.0)
    for name in (LAYER, "patch_embedding"):
        torch.testing.assert_close(_update(other, name), _update(model, name))


def test_read_lora_takes_peft_and_unprefixed_files_and_refuses_others(tmp_path):
    model = _adapted(targets=("to_q",))
    peft_names = {k[len("transformer.") :]: v for k, v in lora.lora_state(model).items()}
    save_file(peft_names, tmp_path / "bare.safetensors")  # a bare peft state dict, no metadata
    state, metadata = lora.read_lora(tmp_path / "bare.safetensors")
    assert metadata is None and sorted(state) == sorted(lora.lora_state(model))
    meta = {"lora_adapter_metadata": json.dumps({"r": 2, "lora_alpha": 3.0})}  # save_lora_adapter's
    save_file(peft_names, tmp_path / "own.safetensors", metadata=meta)
    assert lora.read_lora(tmp_path / "own.safetensors")[1] == {"r": 2, "lora_alpha": 3.0}
    meta = {"lora_adapter_metadata": json.dumps({"alpha": 1})}  # neither prefixed nor peft's
    save_file(peft_names, tmp_path / "odd.safetensors", metadata=meta)
    assert lora.read_lora(tmp_path / "odd.safetensors")[1] is None
    (tmp_path / "w.pt").write_bytes(b"")
    for bad in (tmp_path / "w.pt", tmp_path / "missing.safetensors", tmp_path):
        with pytest.raises(
            ValueError, match="is not a .safetensors file nor a folder with pytorch_lora_weights"
        ):
            lora.read_lora(bad)
    save_file({}, tmp_path / "empty.safetensors")
    with pytest.raises(ValueError, match="empty.safetensors holds no tensors"):
        lora.read_lora(tmp_path / "empty.safetensors")


def test_diffsynth_names_become_original_wan_names():
    t = torch.zeros(1)
    out = lora._diffsynth_to_original_wan(
        {
            "blocks.0.self_attn.q.lora_A.default.weight": t,
            "diffusion_model.head.head.lora_B.default.weight": t,
        }
    )
    assert sorted(out) == [
        "diffusion_model.blocks.0.self_attn.q.lora_A.weight",
        "diffusion_model.head.head.lora_B.weight",
    ]


def test_a_file_without_config_takes_its_rank_from_lora_b_and_scale_1(tmp_path):
    model = _adapted(rank=2, alpha=6.0, targets=("to_q",))  # trained at scale 3
    bare = {k[len("transformer.") :]: v for k, v in lora.lora_state(model).items()}
    save_file(bare, tmp_path / "bare.safetensors")  # no peft config saved with it
    other = _base()
    config = lora.load_lora(other, tmp_path / "bare.safetensors")
    assert (config.r, config.lora_alpha) == (2, 2)  # alpha = rank: diffusers' convention without one
    layer = model.get_submodule(LAYER)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_update(other), x @ a.T @ b.T)


def test_a_diffsynth_file_reads_as_diffusers_names(tmp_path):
    model = _adapted(targets=("to_q",))
    ours = lora.lora_state(model)
    diffsynth = {  # original Wan module names with peft's .default. infix, no prefix
        k[len("transformer.") :].replace("attn1.", "self_attn.").replace("attn2.", "cross_attn.")
        .replace("to_q.", "q.").replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
        for k, v in ours.items()
    }  # fmt: skip
    save_file(diffsynth, tmp_path / "ds.safetensors")
    state, metadata = lora.read_lora(tmp_path / "ds.safetensors")
    assert metadata is None and sorted(state) == sorted(ours)
    for k, v in ours.items():
        torch.testing.assert_close(state[k], v)


def test_keys_that_do_not_fit_name_what_is_unexpected_and_missing(tmp_path):
    model = _adapted(targets=("to_q",))
    state = lora.from_diffusers(lora.lora_state(model), "f")
    other = _adapted(targets=("to_q", "to_k"))
    with pytest.raises(ValueError) as err:
        lora.set_adapter_state(other, state, "default", "f.safetensors")
    assert "f.safetensors: LoRA keys do not fit the model: missing" in str(err.value)
    assert "(4)" in str(err.value) and "unexpected" not in str(err.value)
    small = _adapted(targets=("to_q",))
    with pytest.raises(ValueError, match=r"unexpected \['blocks.0.attn1.to_k.lora_A.weight'"):
        lora.set_adapter_state(small, lora.from_diffusers(lora.lora_state(other), "f"), "default", "f")
    wide = _adapted(rank=3, targets=("to_q",))
    with pytest.raises(ValueError, match="(?s)^f: .*size mismatch"):
        lora.set_adapter_state(wide, state, "default", "f")


def test_lora_scale_scales_only_the_named_adapter():
    model = _adapted(targets=("to_q",))
    full = _update(model)
    lora.set_lora_scale(model, 0.5)
    torch.testing.assert_close(_update(model), 0.5 * full)
    lora.set_lora_scale(model, 0.0, adapter_name="other")  # no such adapter: nothing changes
    torch.testing.assert_close(_update(model), 0.5 * full)


def test_setup_lora_continues_from_a_file_of_the_same_rank_with_the_runs_dropout(tmp_path):
    trained = _adapted(rank=2, targets=("to_q",))
    path = lora.save_lora(trained, tmp_path / "init")
    model = build_model(ModelConfig(size="tiny", overrides={"num_layers": 1, "ffn_dim": 32}))
    lora.setup_lora(
        model, LoraSettings(rank=2, target_modules=["to_q"], dropout=0.25), str(path), torch.bfloat16
    )
    layer = model.get_submodule(LAYER)
    assert layer.base_layer.weight.dtype == torch.bfloat16 and not layer.base_layer.weight.requires_grad
    assert (
        isinstance(layer.lora_dropout["default"], torch.nn.Dropout)
        and layer.lora_dropout["default"].p == 0.25
    )
    a = layer.lora_A["default"].weight
    torch.testing.assert_close(a, trained.get_submodule(LAYER).lora_A["default"].weight)
    assert a.requires_grad and a.dtype == torch.float32
    fresh = build_model(ModelConfig(size="tiny", overrides={"num_layers": 1, "ffn_dim": 32}))
    lora.setup_lora(fresh, LoraSettings(rank=4, target_modules=["to_q"]), None, torch.float32)
    assert fresh.get_submodule(LAYER).lora_A["default"].weight.shape[0] == 4
    assert not fresh.get_submodule(LAYER).lora_B["default"].weight.any()  # B = 0: starts as the base
    with pytest.raises(ValueError, match="has rank 2 but model.lora.rank=4; set model.lora.rank=2"):
        lora.setup_lora(_base(), LoraSettings(rank=4, target_modules=["to_q"]), str(path), torch.float32)


def test_ema_values_saved_in_place_of_the_live_adapter_and_read_back(tmp_path):
    model = _adapted(targets=("to_q",))
    ema = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters() if ".lora_" in n}
    lora.LoraFiles(model, ema).save_pretrained(tmp_path / "ema")
    values = lora.adapter_values(model, tmp_path / "ema")
    assert sorted(values) == sorted(ema) and all((v == 0.5).all() for v in values.values())
    lora.LoraFiles(model).save_pretrained(tmp_path / "live")
    live = lora.adapter_values(model, tmp_path / "live")
    torch.testing.assert_close(live[f"{LAYER}.lora_A.default.weight"], model.get_submodule(LAYER).lora_A["default"].weight)  # fmt: skip
    wider = _adapted(targets=("to_q", "to_k"))
    with pytest.raises(ValueError, match="does not match this run's adapter .missing .'blocks.0.attn1.to_k"):
        lora.adapter_values(wider, tmp_path / "live")
    narrow = _adapted(targets=("to_q", "to_k"))
    lora.save_lora(narrow, tmp_path / "more")
    with pytest.raises(ValueError, match=r"missing \[\], 8 tensors for 4 parameters"):
        lora.adapter_values(model, tmp_path / "more")


def test_merge_command_folds_base_and_lora_into_one_transformer(tmp_path, capsys):
    from dit.wan_import import load_pretrained

    base = _base()
    base.save_pretrained(tmp_path / "base")
    trained = _adapted(targets=("to_q",))
    path = lora.save_lora(trained, tmp_path / "adapter")
    a = trained.get_submodule(LAYER).lora_A["default"].weight
    b = trained.get_submodule(LAYER).lora_B["default"].weight
    argv = ["merge", "--base", str(tmp_path / "base"), "--lora", str(path)]
    assert lora.main([*argv, "--out", str(tmp_path / "m1")]) == 0
    assert f"wrote {tmp_path / 'm1'}; load it with WanTransformer3DModel" in capsys.readouterr().out
    want = base.get_submodule(LAYER).weight + b @ a  # alpha unset: scale 1
    merged = load_pretrained(tmp_path / "m1")
    torch.testing.assert_close(merged.get_submodule(LAYER).weight, want, rtol=1e-5, atol=1e-6)
    assert lora.main([*argv, "--out", str(tmp_path / "m2"), "--scale", "0.5"]) == 0
    half = base.get_submodule(LAYER).weight + 0.5 * b @ a
    torch.testing.assert_close(load_pretrained(tmp_path / "m2").get_submodule(LAYER).weight, half, rtol=1e-5, atol=1e-6)  # fmt: skip
    assert lora.main([*argv, "--out", str(tmp_path / "m2")]) == 2  # not empty: a one-line error
    assert capsys.readouterr().err.startswith("error: ")
    for missing in ("--base", "--lora", "--out"):
        args = [*argv, "--out", "o"]
        i = args.index(missing)
        with pytest.raises(SystemExit) as exit_:
            lora.main(args[:i] + args[i + 2 :])
        assert exit_.value.code == 2 and missing in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lora.main(["merge", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("diffusers Wan transformer/pipeline folder, or ours", "pytorch_lora_weights.safetensors or its folder", "new folder to write"):  # fmt: skip
        assert words in text
    with pytest.raises(SystemExit):
        lora.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "usage: python -m dit.lora" in text and "base + LoRA -> full diffusers transformer folder" in text
    assert "merge --base BASE --lora FILE --out DIR``: base + LoRA folded into one full" in text
    with pytest.raises(SystemExit) as exit_:
        lora.main([])
    assert exit_.value.code == 2
