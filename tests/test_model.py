import math

import pytest
import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from dit.attention import PackedAttention, varlen_attention
from dit.blocks import apply_rotary
from dit.model import VideoDiT
from dit.packing import grid_positions, pack, unpack

SMALL = dict(
    patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=4,
    text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2,
)  # fmt: skip


def test_packed_attention_equals_per_clip_attention():
    torch.manual_seed(0)
    lens = [7, 1, 13, 4]
    q, k, v = (torch.randn(sum(lens), 3, 8, dtype=torch.float64) for _ in range(3))
    out = PackedAttention(lens)(q, k, v)
    start = 0
    for n in lens:
        s = slice(start, start + n)
        ref = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1))
        torch.testing.assert_close(out[s], ref.transpose(0, 1), rtol=0, atol=1e-12)
        start += n


def test_varlen_attention_empty_segments():
    q = torch.randn(5, 2, 4)
    kv = torch.randn(6, 2, 4)
    # clip 0 has no queries here, clip 2 has no keys (an empty caption): its queries get zeros
    out = varlen_attention(q, kv, kv, torch.tensor([0, 0, 3, 5]), torch.tensor([0, 2, 6, 6]))
    assert out.shape == q.shape
    assert torch.equal(out[3:], torch.zeros(2, 2, 4))
    ref = F.scaled_dot_product_attention(
        q[:3].transpose(0, 1), kv[2:6].transpose(0, 1), kv[2:6].transpose(0, 1)
    )
    torch.testing.assert_close(out[:3], ref.transpose(0, 1))


def test_rope_by_position_matches_wan_dense_grid():
    model = VideoDiT(**SMALL)
    grid = (3, 4, 5)
    wan_rope = WanRotaryPosEmbed(12, (1, 2, 2), 1024)
    cos_ref, sin_ref = wan_rope(torch.zeros(1, 4, 3, 8, 10))  # (1, n, 1, d)
    cos, sin = model.rope(grid_positions(grid))
    torch.testing.assert_close(cos, cos_ref[0].float())
    torch.testing.assert_close(sin, sin_ref[0].float())
    # a rotation keeps norms, and position (0, 0, 0) is the identity
    x = torch.randn(60, 3, 12)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[0], x[0])


def test_rope_rejects_positions_beyond_table():
    model = VideoDiT(**SMALL, rope_max_seq_len=8)
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        model.rope(torch.tensor([[0, 9, 0]]))


def _inputs(clips, texts, patch=(1, 2, 2)):
    packed = pack(clips, patch)
    text = torch.cat(texts)
    text_lens = torch.tensor([t.shape[0] for t in texts])
    return packed, text, text_lens


def test_packed_forward_equals_each_clip_alone():
    """Attention never crosses clips: a clip's output does not depend on its batch mates."""
    torch.manual_seed(0)
    model = VideoDiT(**SMALL, adaln_zero_init=False).eval()
    clips = [torch.randn(4, 3, 6, 10), torch.randn(4, 1, 4, 4), torch.randn(4, 5, 2, 6)]
    texts = [torch.randn(5, 16), torch.randn(0, 16), torch.randn(9, 16)]
    t = torch.tensor([900.0, 10.0, 500.0])
    packed, text, text_lens = _inputs(clips, texts)
    out = model(
        packed.tokens, packed.positions, packed.seq_lens, t, text, text_lens, PackedAttention(packed.seq_lens)
    )
    for i, (clip, txt) in enumerate(zip(clips, texts)):
        p1, text1, lens1 = _inputs([clip], [txt])
        alone = model(
            p1.tokens, p1.positions, p1.seq_lens, t[i : i + 1], text1, lens1, PackedAttention(p1.seq_lens)
        )
        torch.testing.assert_close(packed.split(out)[i], alone, rtol=1e-5, atol=1e-6)


def test_matches_diffusers_wan_on_copied_weights():
    torch.manual_seed(0)
    wan = WanTransformer3DModel(**{**SMALL, "out_channels": 4, "qk_norm": "rms_norm_across_heads"}).eval()
    ours = VideoDiT(**SMALL, adaln_zero_init=False).eval()
    state = wan.state_dict()
    w = state.pop("patch_embedding.weight")  # (D, c, pt, ph, pw) -> (D, pt*ph*pw*c)
    state["patch_embedding.weight"] = w.permute(0, 2, 3, 4, 1).reshape(w.shape[0], -1)
    ours.load_state_dict(state)
    clips = [torch.randn(4, 3, 6, 10), torch.randn(4, 2, 4, 4)]
    texts = [torch.randn(7, 16), torch.randn(5, 16)]
    t = torch.tensor([500.0, 100.0])
    packed, text, text_lens = _inputs(clips, texts)
    out = ours(
        packed.tokens, packed.positions, packed.seq_lens, t, text, text_lens, PackedAttention(packed.seq_lens)
    )
    for i, clip in enumerate(unpack(packed, out, (1, 2, 2))):
        ref = wan(clips[i][None], t[i : i + 1], texts[i][None]).sample[0]
        torch.testing.assert_close(clip, ref, rtol=0, atol=1e-5)


def test_adaln_zero_init_starts_at_zero_output():
    model = VideoDiT(**SMALL)
    packed, text, text_lens = _inputs([torch.randn(4, 2, 4, 4)], [torch.randn(3, 16)])
    out = model(packed.tokens, packed.positions, packed.seq_lens, torch.tensor([300.0]), text, text_lens,
                PackedAttention(packed.seq_lens))  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = VideoDiT(**SMALL, adaln_zero_init=False).eval()
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "diffusion_pytorch_model.safetensors").is_file()
    loaded = VideoDiT.from_pretrained(tmp_path / "m").eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    packed, text, text_lens = _inputs([torch.randn(4, 3, 4, 6)], [torch.randn(2, 16)])
    args = (packed.tokens, packed.positions, packed.seq_lens, torch.tensor([250.0]), text, text_lens)
    # Weights are bitwise equal (above), but safetensors may hand back tensors at unaligned
    # addresses, and CPU GEMMs then take another SIMD path: outputs agree to fp32 rounding only.
    torch.testing.assert_close(
        model(*args, PackedAttention(packed.seq_lens)),
        loaded(*args, PackedAttention(packed.seq_lens)),
        rtol=0,
        atol=1e-6,
    )


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = VideoDiT(**SMALL, adaln_zero_init=False)
    packed, text, text_lens = _inputs(
        [torch.randn(4, 3, 4, 6), torch.randn(4, 1, 2, 2)], [torch.randn(2, 16)] * 2
    )
    args = (packed.tokens, packed.positions, packed.seq_lens, torch.tensor([250.0, 3.0]), text, text_lens)
    grads = []
    for flag in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = flag
        model(*args, PackedAttention(packed.seq_lens)).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert math.isfinite(sum(float(g.abs().sum()) for g in grads[0]))
