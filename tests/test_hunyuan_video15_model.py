"""HunyuanVideo15DiT beyond parity: its state dict goes back into diffusers, its inputs and config are
checked, gradient checkpointing changes nothing, and the joint layout is each clip's video then context."""

from __future__ import annotations

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from dit.attention import PackedAttention
from dit.blocks import RotaryEmbedding3D
from dit.families.hunyuan_video15.layers import JointLayout
from dit.families.hunyuan_video15.model import HunyuanVideo15DiT, joint_lens
from dit.packing import pack

TINY = dict(
    in_channels=3,
    out_channels=2,
    num_attention_heads=2,
    attention_head_dim=6,
    num_layers=2,
    num_refiner_layers=1,
    text_embed_dim=6,
    text_embed_2_dim=5,
    image_embed_dim=4,
    rope_axes_dim=(2, 2, 2),
    mlp_ratio=2.0,  # not the default 4: the MLP widths must follow the config
)


def _batch(model: HunyuanVideo15DiT, seed: int = 0):
    """Two clips: one I2V with glyph text, one T2V without. Returns the forward's args but attention."""
    gen = torch.Generator().manual_seed(seed)
    packed = pack(
        [torch.randn(3, 2, 2, 4, generator=gen), torch.randn(3, 1, 2, 2, generator=gen)], model.patch_size
    )
    text_lens, glyph_lens, image_lens = torch.tensor([3, 2]), torch.tensor([2, 0]), torch.tensor([2, 0])
    return dict(
        tokens=packed.tokens,
        positions=packed.positions,
        seq_lens=packed.seq_lens,
        timesteps=torch.tensor([900.0, 100.0]),
        text=torch.randn(5, 6, generator=gen),
        text_lens=text_lens,
        glyph=torch.randn(2, 5, generator=gen),
        glyph_lens=glyph_lens,
        image=torch.randn(2, 4, generator=gen),
        image_lens=image_lens,
    )


def _attention(b) -> PackedAttention:
    return PackedAttention(joint_lens(b["seq_lens"], b["text_lens"], b["glyph_lens"], b["image_lens"]))


def test_state_dict_loads_back_into_diffusers_unchanged():
    torch.manual_seed(0)
    ours = HunyuanVideo15DiT(**TINY)
    ref = HunyuanVideo15Transformer3DModel(**TINY)
    assert ref.load_state_dict(ours.state_dict(), strict=True)  # export is a plain save of ours
    for name, tensor in ref.state_dict().items():
        assert torch.equal(tensor, ours.state_dict()[name]), name
    assert dict(ours.config) == {**dict(ref.config)}  # the same fields and values: config.json maps 1:1


def test_defaults_and_norm_epsilons_are_diffusers():
    """The default config is the released model's, and every norm has diffusers' epsilon (1e-6; the
    torch defaults, 1e-5 for LayerNorm and fp32 epsilon for RMSNorm, would differ by ~1e-6 only)."""
    import inspect

    def defaults(cls):
        return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}

    assert defaults(HunyuanVideo15DiT) == defaults(HunyuanVideo15Transformer3DModel)
    torch.manual_seed(0)
    ours, ref = HunyuanVideo15DiT(**TINY), HunyuanVideo15Transformer3DModel(**TINY)
    ref_modules = dict(ref.named_modules())
    norms = [(n, m) for n, m in ours.named_modules() if hasattr(m, "eps") and not hasattr(m, "linear")]
    assert len(norms) > 10
    for name, module in norms:
        assert module.eps == ref_modules[name].eps, name


def test_joint_layout_puts_each_clips_context_after_its_video():
    layout = JointLayout.build(torch.tensor([2, 1]), torch.tensor([1, 3]))
    # cat([video (3 rows), context (4 rows)]) -> [v0 v0 c0 | v1 c1 c1 c1]
    assert layout.order.tolist() == [0, 1, 3, 2, 4, 5, 6]
    assert layout.segment_lens().tolist() == [3, 4]
    assert torch.equal(layout.order[layout.inverse], torch.arange(7))
    assert joint_lens(torch.tensor([2, 1]), torch.tensor([1, 1])).tolist() == [3, 2]  # None counts 0
    assert joint_lens(
        torch.tensor([2]), torch.tensor([1]), torch.tensor([4]), torch.tensor([5])
    ).tolist() == [12]


def test_gradient_checkpointing_gives_the_same_output_and_gradients():
    torch.manual_seed(0)
    model = HunyuanVideo15DiT(**TINY)
    b = _batch(model)
    calls = []

    def counting(block, *args):
        calls.append(block)
        return model_checkpoint(block, *args)

    from dit.model import checkpoint_block as model_checkpoint

    results = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        model.checkpoint_fn = counting
        out = model(**b, attention=_attention(b))
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert len(calls) == TINY["num_layers"]  # every block, only when checkpointing is on
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    with torch.no_grad():  # nothing to recompute without grad: blocks run plainly
        model(**b, attention=_attention(b))
    assert len(calls) == TINY["num_layers"]


def test_output_layout_is_channels_last_per_patch():
    """Patch 1 x 2 x 2: a token's p_out values are (pt, ph, pw, c) as dit/packing.py lays them out."""
    torch.manual_seed(0)
    model = HunyuanVideo15DiT(**{**TINY, "patch_size": 2})
    b = _batch(model)
    with torch.no_grad():
        model.proj_out.weight.zero_()
        model.proj_out.bias.copy_(torch.arange(8.0))  # diffusers' row order: (c, pt, ph, pw)
        out = model(**b, attention=_attention(b))
    assert out[0].tolist() == [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]  # (ph, pw, c)


def test_each_clip_sees_only_its_own_context():
    """Changing clip 1's prompt changes clip 1's output and leaves clip 0's bit for bit."""
    torch.manual_seed(0)
    model = HunyuanVideo15DiT(**TINY)
    b = _batch(model)
    with torch.no_grad():
        before = model(**b, attention=_attention(b))
        b["text"][3:] += 1.0  # clip 1's MLLM rows
        after = model(**b, attention=_attention(b))
    n0 = int(b["seq_lens"][0])
    assert torch.equal(before[:n0], after[:n0])
    assert float((before[n0:] - after[n0:]).abs().max()) > 1e-3


def test_inputs_that_disagree_with_their_lengths_are_refused():
    torch.manual_seed(0)
    model = HunyuanVideo15DiT(**TINY)
    b = _batch(model)
    with pytest.raises(ValueError, match="segments are not the joint"):
        model(**b, attention=PackedAttention(b["seq_lens"]))  # the video lengths alone
    for name in ("tokens", "text", "glyph", "image"):
        bad = {**b, name: b[name][1:]}
        with pytest.raises(ValueError, match=f"^{name} has {b[name].shape[0] - 1} rows"):
            model(**bad, attention=_attention(b))
    with pytest.raises(ValueError, match="glyph has 0 rows but its lengths sum to 2"):
        model(**{**b, "glyph": None}, attention=_attention(b))
    # a T2V batch needs no glyph or image at all: None and no lengths
    t2v = {**b, "glyph": None, "glyph_lens": None, "image": None, "image_lens": None}
    out = model(**t2v, attention=PackedAttention(joint_lens(b["seq_lens"], b["text_lens"])))
    assert out.shape == (int(b["seq_lens"].sum()), 2)


def test_unsupported_variants_are_refused():
    for bad in ({"use_meanflow": True}, {"qk_norm": "layer_norm"}):
        with pytest.raises(ValueError, match="only HunyuanVideo-1.5's rms_norm without meanflow"):
            HunyuanVideo15DiT(**{**TINY, **bad})


def test_rope_axes_must_split_the_head_dim_in_even_parts():
    assert RotaryEmbedding3D(8, axes=(2, 2, 4)).split == (2, 2, 4)
    assert RotaryEmbedding3D(12).split == (4, 4, 4)  # Wan's split when no axes are given
    for axes in ((2, 2, 2), (3, 3, 2)):
        with pytest.raises(ValueError, match="must be even and sum to the head dim 8"):
            RotaryEmbedding3D(8, axes=axes)
