"""Wan2.2 TI2V-5B: architecture, per-token timesteps and parity with diffusers.

The official TI2V-5B config is built on the meta device and compared name by name with diffusers'
WanTransformer3DModel (5.000B). A small random TI2V-like model (in = out channels, patch (1, 2, 2))
is imported; a packed batch of clips of different shapes, some in image-to-video mode (latent frame 0
at t = 0) and some not, must match diffusers on each clip alone with the (1, seq_len) timestep the
pipeline builds, outputs and gradients.

Planted and watched fail (then restored): the blocks gather one row for every token instead of each
token's own -> outputs off by 0.33; frame 0 given its clip's t in ``token_timesteps`` -> off by 1.2.
"""

from __future__ import annotations

import pytest
import torch
from _wan_parity import assert_outputs_and_gradients_match
from accelerate import init_empty_weights
from diffusers import WanTransformer3DModel

from dit.attention import PackedAttention
from dit.packing import pack, unpack
from dit.sizes import MODEL_SIZES, model_kwargs
from dit.ti2v import first_frame_tokens, token_timesteps
from dit.wan_import import _check_names, _empty_model, import_wan_state_dict, videodit_config, wan_config

# transformer/config.json of Wan-AI/Wan2.2-TI2V-5B-Diffusers (diffusers' scripts/convert_wan_to_diffusers.py)
TI2V_5B = dict(
    patch_size=[1, 2, 2], num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
    text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip

TEXT_LEN = 8  # stands in for Wan's 512
TEXT_DIM = 16
SMALL = dict(
    patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=6, out_channels=6,
    text_dim=TEXT_DIM, freq_dim=32, ffn_dim=40, num_layers=2,
)  # fmt: skip
CLIP_SHAPES = [(6, 3, 6, 10), (6, 1, 4, 2), (6, 5, 2, 6)]  # (c, f, h, w): odd frames, none square
CAPTION_LENS = [5, 8, 1]
TIMESTEPS = [999.0, 1.0, 437.5]
CLEAN_FIRST = [True, False, True]  # image-to-video clips (frame 0 clean at t = 0) and a text-to-video one


def test_official_config_matches_diffusers_on_meta_device():
    with init_empty_weights():
        wan = WanTransformer3DModel(**TI2V_5B)
    shapes = {k: tuple(v.shape) for k, v in wan.state_dict().items()}
    model = _empty_model(model_kwargs("wan2.2-ti2v-5b"))
    assert sorted(_check_names(model, shapes, "ti2v")) == sorted(shapes)  # same names and shapes
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in wan.parameters())
    assert round(count / 1e9, 3) == 5.000
    imported = videodit_config(TI2V_5B, expand_timesteps=True)
    assert all(imported[k] == v for k, v in MODEL_SIZES["wan2.2-ti2v-5b"].items())
    exported = wan_config(model)
    assert "expand_timesteps" not in exported  # the pipeline's field, not the transformer's
    with init_empty_weights():
        rebuilt = WanTransformer3DModel(**{k: v for k, v in exported.items() if not k.startswith("_")})
    assert {k: v for k, v in rebuilt.config.items() if not k.startswith("_")} == {
        k: v for k, v in wan.config.items() if not k.startswith("_")
    }


def make_wan() -> WanTransformer3DModel:
    torch.manual_seed(11)
    wan = WanTransformer3DModel(**SMALL).eval()
    with torch.no_grad():  # random modulation tables: the time path must matter
        for p in wan.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return wan


def make_batch():
    gen = torch.Generator().manual_seed(5)
    clips = [torch.randn(*shape, generator=gen) for shape in CLIP_SHAPES]
    texts = [torch.randn(n, TEXT_DIM, generator=gen) for n in CAPTION_LENS]
    return clips, texts


def pipeline_timestep(clip: torch.Tensor, t: float, clean_first: bool) -> torch.Tensor:
    """(1, seq_len) as WanImageToVideoPipeline builds it with expand_timesteps: (mask[:, ::2, ::2] * t)."""
    mask = torch.ones(clip.shape[1:])  # (f, h, w)
    if clean_first:
        mask[0] = 0
    return (mask[:, ::2, ::2] * t).flatten()[None]


def diffusers_per_clip(wan, clips, texts) -> list[torch.Tensor]:
    outs = []
    for clip, text, t, clean in zip(clips, texts, TIMESTEPS, CLEAN_FIRST):
        padded = torch.cat([text, text.new_zeros(TEXT_LEN - text.shape[0], TEXT_DIM)])
        outs.append(wan(clip[None], pipeline_timestep(clip, t, clean), padded[None]).sample[0])
    return outs


def ours_packed(model, clips, texts) -> list[torch.Tensor]:
    packed = pack(clips, model.patch_size)
    text, text_lens = torch.cat(texts), torch.tensor([t.shape[0] for t in texts])
    timesteps = torch.tensor(TIMESTEPS)
    clean = first_frame_tokens(packed.positions, packed.seq_lens, torch.tensor(CLEAN_FIRST))
    out = model(packed.tokens, packed.positions, packed.seq_lens, timesteps, text, text_lens,
                PackedAttention(packed.seq_lens),
                token_timesteps=token_timesteps(timesteps, packed.seq_lens, clean))  # fmt: skip
    return unpack(packed, out, model.patch_size)


def test_per_token_timesteps_match_diffusers_outputs_and_gradients():
    wan = make_wan()
    model = import_wan_state_dict(
        wan.config, {k: v.clone() for k, v in wan.state_dict().items()}, text_pad_len=TEXT_LEN
    )
    clips, texts = make_batch()
    weights = [torch.randn(c.shape, generator=torch.Generator().manual_seed(i)) for i, c in enumerate(clips)]
    ours = ours_packed(model, clips, texts)
    refs = diffusers_per_clip(wan, clips, texts)
    assert_outputs_and_gradients_match(model, wan, ours, refs, weights)  # tolerances: tests/_wan_parity.py


def test_per_token_path_equals_per_clip_when_all_tokens_share_the_clip_t():
    """Off by default: without token_timesteps nothing changes; with every token at its clip's t the
    per-token path computes the same function (rows gathered instead of repeated)."""
    wan = make_wan()
    model = import_wan_state_dict(wan.config, wan.state_dict(), text_pad_len=TEXT_LEN)
    clips, texts = make_batch()
    packed = pack(clips, model.patch_size)
    text, text_lens = torch.cat(texts), torch.tensor([t.shape[0] for t in texts])
    timesteps = torch.tensor(TIMESTEPS)
    args = (packed.tokens, packed.positions, packed.seq_lens, timesteps, text, text_lens,
            PackedAttention(packed.seq_lens))  # fmt: skip
    with torch.no_grad():
        per_clip = model(*args)
        none_clean = torch.zeros(packed.tokens.shape[0], dtype=torch.bool)
        per_token = model(*args, token_timesteps=token_timesteps(timesteps, packed.seq_lens, none_clean))
    # one time embedding per distinct value either way: the same rows, so equal to fp32 rounding of
    # the unique/gather order (exactly equal in practice; 1e-6 allows a different GEMM blocking)
    assert float((per_clip - per_token).abs().max()) <= 1e-6
    with pytest.raises(ValueError, match="one timestep per token"):
        model(*args, token_timesteps=timesteps)


def test_lora_loads_into_diffusers_without_missing_keys(tmp_path):
    """A TI2V LoRA trained here (patch embedding and FFN targeted too) loads into diffusers' model as
    WanPipeline.load_lora_weights does, with the same keys and the same per-token-timestep outputs.
    Planted: the patch embedding's lora_A reshaped to Conv3d without the (pt, ph, pw, c) -> (c, pt, ph,
    pw) permutation (48 channels make it a real permutation) -> outputs off by 3.3."""
    from diffusers import WanPipeline
    from peft.utils import get_peft_model_state_dict

    from dit import lora
    from dit.model_config import LoraSettings

    wan = make_wan()
    source = import_wan_state_dict(
        wan.config, {k: v.clone() for k, v in wan.state_dict().items()}, text_pad_len=TEXT_LEN
    )
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2", "proj_out", "patch_embedding"]
    lora.add_lora(source, lora.peft_config(LoraSettings(rank=2, alpha=4, target_modules=targets)))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lora.adapter_parameters(source):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    lora.save_lora(source, tmp_path / "lora")

    state, metadata = WanPipeline.lora_state_dict(str(tmp_path / "lora"), return_lora_metadata=True)
    WanPipeline.load_lora_into_transformer(state, transformer=wan, metadata=metadata)
    (adapter,) = wan.peft_config
    live = set(get_peft_model_state_dict(wan, adapter_name=adapter))
    assert live == {k.removeprefix("transformer.") for k in state}  # no missing, no unexpected keys
    clips, texts = make_batch()
    with torch.no_grad():
        got = ours_packed(source, clips, texts)
        want = diffusers_per_clip(wan, clips, texts)
    for g, w in zip(got, want):
        assert float((g - w).abs().max()) <= 1e-5  # the output tolerance derived above
