"""Wan2.1 image-to-video (I2V-14B, FLF2V-14B): architecture, import/export and parity with diffusers.

The official configs are built on the meta device and compared name by name with diffusers'. Small
random I2V and FLF2V models are imported; every clip of a packed batch, each with its own image
tokens, must match diffusers' WanTransformer3DModel on that clip alone, outputs and gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _wan_parity import assert_outputs_and_gradients_match
from accelerate import init_empty_weights
from diffusers import WanTransformer3DModel

from dit.attention import PackedAttention
from dit.model import VideoDiT
from dit.packing import pack, unpack
from dit.sizes import MODEL_SIZES, model_kwargs
from dit.wan_import import (
    _check_names,
    _empty_model,
    export_wan,
    import_wan_state_dict,
    load_pretrained,
    videodit_config,
    wan_config,
)

# transformer/config.json of Wan-AI/Wan2.1-I2V-14B-{480P,720P}-Diffusers and Wan2.1-FLF2V-14B-720P-Diffusers
# (diffusers' scripts/convert_wan_to_diffusers.py), with their parameter counts in billions.
I2V_14B = dict(
    patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=36, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280, added_kv_proj_dim=5120, rope_max_seq_len=1024,
)  # fmt: skip
OFFICIAL = {
    "wan-i2v-14b": (I2V_14B, 16.395),
    "wan-flf2v-14b": ({**I2V_14B, "pos_embed_seq_len": 2 * 257}, 16.396),
}

# Wan's text length: diffusers' I2V attention processor splits image from text tokens as "all but
# the last 512", so the reference must get captions padded to exactly 512.
TEXT_LEN = 512
TEXT_DIM = 16
IMAGE_DIM = 12
IMAGE_TOKENS = 5  # per image (CLIP ViT-H/14 gives 257)
SMALL = dict(
    patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=9, out_channels=4,
    text_dim=TEXT_DIM, freq_dim=32, ffn_dim=40, num_layers=2, image_dim=IMAGE_DIM, added_kv_proj_dim=36,
)  # fmt: skip
SMALL_CASES = {"i2v": SMALL, "flf2v": {**SMALL, "pos_embed_seq_len": 2 * IMAGE_TOKENS}}
CLIP_SHAPES = [(9, 3, 6, 10), (9, 1, 4, 2), (9, 5, 2, 6)]  # (c, f, h, w): odd frames, none square
CAPTION_LENS = [5, 8, 1]
TIMESTEPS = [999.0, 1.0, 437.5]


# ----------------------------------------------------------------------------- architecture


@pytest.mark.parametrize("size", OFFICIAL)
def test_official_configs_match_diffusers_on_meta_device(size):
    config, billions = OFFICIAL[size]
    with init_empty_weights():
        wan = WanTransformer3DModel(**config)
    shapes = {k: tuple(v.shape) for k, v in wan.state_dict().items()}
    model = _empty_model(model_kwargs(size))  # the named size, not the importer's mapping
    assert sorted(_check_names(model, shapes, size)) == sorted(shapes)  # same names, and shapes
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in wan.parameters())
    assert round(count / 1e9, 3) == billions
    # the importer maps the published config to the same model...
    imported = videodit_config(config)
    assert all(imported[k] == v for k, v in MODEL_SIZES[size].items())
    # ...and the exported config.json rebuilds the same WanTransformer3DModel
    exported = wan_config(model)
    with init_empty_weights():
        rebuilt = WanTransformer3DModel(**{k: v for k, v in exported.items() if not k.startswith("_")})
    assert {k: v for k, v in rebuilt.config.items() if not k.startswith("_")} == {
        k: v for k, v in wan.config.items() if not k.startswith("_")
    }


@pytest.mark.parametrize(
    "change, match",
    [
        ({"image_dim": 12, "added_kv_proj_dim": None}, "set both"),
        ({"added_kv_proj_dim": 24}, "must equal the width"),
        ({"pos_embed_seq_len": 9}, "even value"),
    ],
)
def test_bad_image_fields(change, match):
    with pytest.raises(ValueError, match=match):
        VideoDiT(**{**SMALL, **change})


# ----------------------------------------------------------------------------- parity


def make_wan(name: str) -> WanTransformer3DModel:
    torch.manual_seed(len(name))
    wan = WanTransformer3DModel(**SMALL_CASES[name]).eval()
    with torch.no_grad():  # diffusers starts pos_embed at zero: random values test how it is added
        for p in wan.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return wan


def make_batch(name: str):
    """Clips, captions, timesteps and (b, m, image_dim) image tokens; FLF2V's m holds two images."""
    gen = torch.Generator().manual_seed(7)
    clips = [torch.randn(*shape, generator=gen) for shape in CLIP_SHAPES]
    texts = [torch.randn(n, TEXT_DIM, generator=gen) for n in CAPTION_LENS]
    images = torch.randn(
        len(clips), SMALL_CASES[name].get("pos_embed_seq_len") or IMAGE_TOKENS, IMAGE_DIM, generator=gen
    )
    return clips, texts, torch.tensor(TIMESTEPS), images


def diffusers_per_clip(wan, clips, texts, timesteps, images) -> list[torch.Tensor]:
    """diffusers on each clip alone, its caption zero-padded to 512 as the Wan pipeline pads it."""
    outs = []
    for clip, text, t, image in zip(clips, texts, timesteps, images):
        padded = torch.cat([text, text.new_zeros(TEXT_LEN - text.shape[0], TEXT_DIM)])
        if wan.config.pos_embed_seq_len:  # the pipeline passes FLF2V's two images as two rows
            image = image.unflatten(0, (2, -1))
        else:
            image = image[None]
        outs.append(wan(clip[None], t[None], padded[None], encoder_hidden_states_image=image).sample[0])
    return outs


def ours_packed(model, clips, texts, timesteps, images) -> list[torch.Tensor]:
    packed = pack(clips, model.patch_size)
    text, text_lens = torch.cat(texts), torch.tensor([t.shape[0] for t in texts])
    out = model(packed.tokens, packed.positions, packed.seq_lens, timesteps, text, text_lens,
                PackedAttention(packed.seq_lens), image=images)  # fmt: skip
    return unpack(packed, out, model.patch_size)


@pytest.mark.parametrize("name", SMALL_CASES)
def test_packed_clips_match_diffusers_outputs_and_gradients(name):
    wan = make_wan(name)
    model = import_wan_state_dict(wan.config, {k: v.clone() for k, v in wan.state_dict().items()})
    model.train(), wan.train()  # dropout is 0 in both; train() only to mirror fine-tuning
    clips, texts, timesteps, images = make_batch(name)
    weights = [
        torch.randn(4, *c.shape[1:], generator=torch.Generator().manual_seed(i)) for i, c in enumerate(clips)
    ]

    ours = ours_packed(model, clips, texts, timesteps, images)
    refs = diffusers_per_clip(wan, clips, texts, timesteps, images)
    grads = assert_outputs_and_gradients_match(
        model, wan, ours, refs, weights
    )  # tolerances: tests/_wan_parity.py
    assert grads["blocks.1.attn2.add_k_proj.weight"][1].abs().max() > 0  # the image path is trained


def test_image_is_required_and_checked():
    model = VideoDiT(**SMALL)
    clips, texts, timesteps, images = make_batch("i2v")
    with pytest.raises(ValueError, match="image-conditioned.*--image PATH"):
        ours_packed(model, clips, texts, timesteps, None)
    with pytest.raises(ValueError, match=r"expected \(3, tokens, 12\)"):
        ours_packed(model, clips, texts, timesteps, images[:2])
    flf2v = VideoDiT(**SMALL_CASES["flf2v"])
    with pytest.raises(ValueError, match=r"expected \(3, 10, 12\).*first and last"):
        ours_packed(flf2v, clips, texts, timesteps, images)
    t2v = VideoDiT(**{k: v for k, v in SMALL.items() if k not in ("image_dim", "added_kv_proj_dim")})
    with pytest.raises(ValueError, match="text-to-video model"):
        ours_packed(t2v, [c[:4] for c in clips], texts, timesteps, images)


# ----------------------------------------------------------------------------- import / export


@pytest.mark.parametrize("name", SMALL_CASES)
def test_sharded_export_loads_in_diffusers_and_reimports_bitwise(tmp_path, name):
    wan = make_wan(name)
    wan.save_pretrained(tmp_path / "pipe" / "transformer", max_shard_size="20KB")  # sharded
    model = load_pretrained(tmp_path / "pipe")
    export_wan(model, tmp_path / "out", max_shard_bytes=30_000)
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    back = WanTransformer3DModel.from_pretrained(tmp_path / "out")
    assert back.config.image_dim == IMAGE_DIM and back.config.pos_embed_seq_len == SMALL_CASES[name].get(
        "pos_embed_seq_len"
    )
    for (k, a), (k2, b) in zip(sorted(back.state_dict().items()), sorted(wan.state_dict().items())):
        assert k == k2 and torch.equal(a, b), k
    again = load_pretrained(tmp_path / "out")
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


# ----------------------------------------------------------------------------- LoRA


def _diffusers_i2v_with_lora(wan, folder) -> set[str]:
    """What WanImageToVideoPipeline.load_lora_weights(folder) does; returns the adapter's keys."""
    from diffusers import WanImageToVideoPipeline
    from peft.utils import get_peft_model_state_dict

    state, metadata = WanImageToVideoPipeline.lora_state_dict(str(folder), return_lora_metadata=True)
    state = WanImageToVideoPipeline._maybe_expand_t2v_lora_for_i2v(wan, state)
    WanImageToVideoPipeline.load_lora_into_transformer(state, transformer=wan, metadata=metadata)
    (adapter,) = wan.peft_config  # diffusers names it default_0
    return set(get_peft_model_state_dict(wan, adapter_name=adapter)), {
        k.removeprefix("transformer.") for k in state
    }


def _random_lora(model, targets, seed=3):
    from dit import lora
    from dit.model_config import LoraSettings

    lora.add_lora(model, lora.peft_config(LoraSettings(rank=2, alpha=4, target_modules=targets)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.adapter_parameters(model):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("kind", ["i2v-lora", "t2v-lora"])
def test_lora_loads_into_diffusers_i2v_without_missing_keys(tmp_path, kind):
    """An I2V LoRA trained here (image K/V targeted too), and a T2V LoRA (no image K/V: diffusers adds
    zero ones), load here and into diffusers' I2V model with the same keys and the same outputs."""
    from dit import lora

    wan = make_wan("i2v")
    clips, texts, timesteps, images = make_batch("i2v")
    if kind == "i2v-lora":
        source = import_wan_state_dict(wan.config, {k: v.clone() for k, v in wan.state_dict().items()})
        _random_lora(source, ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.2"])
    else:  # the same widths without image conditioning: a Wan2.1-T2V-14B LoRA on I2V-14B in miniature
        t2v = {k: v for k, v in SMALL.items() if k not in ("image_dim", "added_kv_proj_dim")}
        source = VideoDiT(**{**t2v, "in_channels": 4})
        _random_lora(source, ["to_q", "to_k", "to_v", "to_out.0"])
    lora.save_lora(source, tmp_path / "lora")

    ours = import_wan_state_dict(wan.config, {k: v.clone() for k, v in wan.state_dict().items()}).eval()
    with torch.no_grad():
        base = ours_packed(ours, clips, texts, timesteps, images)
    lora.load_lora(ours, tmp_path / "lora")
    live, file = _diffusers_i2v_with_lora(wan, tmp_path / "lora")
    assert live == file  # no missing, no unexpected keys
    ours_keys = {k.replace(".default", "") for k, _ in ours.named_parameters() if ".lora_" in k}
    assert ours_keys == live
    assert any("add_k_proj" in k for k in live)  # the image K/V carry adapters (zero ones for T2V)
    with torch.no_grad():
        got = ours_packed(ours, clips, texts, timesteps, images)
        want = diffusers_per_clip(wan, clips, texts, timesteps, images)
    for g, w, b in zip(got, want, base):
        assert float((g - w).abs().max()) <= 1e-5  # the output tolerance derived above
        assert float((g - b).abs().max()) > 1e-3  # the LoRA changes the output


# ----------------------------------------------------------------------------- config and bad input


def test_i2v_config_dry_run_prints_parameters_and_memory(capsys):
    import train

    config = Path(__file__).resolve().parents[1] / "configs" / "wan2.1-i2v-14b-lora.yaml"
    assert train.main(["--config", str(config), "--dry-run"]) == 1  # the /path/to placeholders are missing
    out = capsys.readouterr().out
    assert "model: 16.39B parameters" in out and "memory per GPU" in out
    assert "data.image_encoder_path=/path/to/Wan2.1-I2V-14B-480P-Diffusers does not exist" in out


def test_t2v_checkpoint_under_i2v_config_is_refused(tmp_path):
    from dit.model_config import ModelConfig
    from dit.setup import build_model

    t2v = {k: v for k, v in SMALL.items() if k not in ("image_dim", "added_kv_proj_dim")}
    WanTransformer3DModel(**{**t2v, "in_channels": 4}).save_pretrained(tmp_path / "t2v")
    with pytest.raises(
        ValueError, match=r"text-to-video checkpoint .* model.size=wan-i2v-14b is image-to-video"
    ):
        build_model(ModelConfig(size="wan-i2v-14b", pretrained=str(tmp_path / "t2v")))
    make_wan("i2v").save_pretrained(tmp_path / "i2v")
    with pytest.raises(ValueError, match=r"image-to-video checkpoint .* model.size=wan-14b is text-to-video"):
        build_model(ModelConfig(size="wan-14b", pretrained=str(tmp_path / "i2v")))
    assert (
        build_model(ModelConfig(size="wan-i2v-14b", pretrained=str(tmp_path / "i2v"))).config.image_dim == 12
    )
