"""HunyuanVideo15DiT (packed) against diffusers' HunyuanVideo15Transformer3DModel, clip by clip.

Small random models of diffusers' own class, its state dict loaded into ours with strict=True. Several
clips of different shapes, prompt lengths and glyph lengths run packed in one call; each must equal
that clip alone through diffusers, its MLLM and ByT5 states padded (with random rows, which the mask
must hide) under diffusers' attention masks. Gradients too: one backward of a weighted sum of the
packed output against the per-clip backward passes of diffusers, summed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from diffusers import HunyuanVideo15Transformer3DModel

from dit.attention import PackedAttention
from dit.families.hunyuan_video15.model import HunyuanVideo15DiT, joint_lens
from dit.packing import pack, unpack

CONFIG = dict(
    in_channels=5,
    out_channels=2,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_refiner_layers=2,
    text_embed_dim=12,
    text_embed_2_dim=10,
    image_embed_dim=6,
    rope_axes_dim=(2, 2, 4),
)
SHAPES = [(3, 4, 6), (1, 2, 2), (2, 6, 4)]  # (frames, height, width) latents of the three clips
TEXT_LENS, GLYPH_LENS = [5, 2, 7], [3, 0, 1]  # a clip without glyph text, as most prompts are
IMAGE_TOKENS = 4  # SigLIP tokens of an I2V clip (729 in the real model)
# which clips carry an image; patch (pt, ph, pw): the real model's 1 x 1 x 1, and 1 x 2 x 2 to pin
# the patch layout (diffusers orders a patch's values channels first, dit/packing.py channels last)
CASES = {"t2v": ([False] * 3, 1), "i2v": ([True] * 3, 2), "mixed": ([True, False, True], 1)}

U = 2.0**-24  # fp32 unit roundoff


def reduction_budget(cfg: dict, segment: int, prompt: int) -> int:
    """Sum of the lengths of every reduction the output depends on, in one forward.

    Higham (Accuracy and Stability of Numerical Algorithms, eq. 3.5): a length-K sum, in any order,
    is within gamma_K = K u / (1 - K u) of exact, relative to the sum of the terms' magnitudes. Errors of
    dependent reductions add to first order when no layer amplifies much (a LayerNorm or RMSNorm
    renormalizes every two or three linears of gain ~1.4, see _sensitive), so the whole forward is
    within gamma of this total, times the activations' scale. The RoPE tables differ too (diffusers
    computes its angles in fp32, ours in fp64 rounded once): by (largest angle + 1) u, a few u here,
    inside the budget. Counted per kind (K = the reduced length; a LayerNorm: mean and variance):
    """
    D, d = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["attention_head_dim"]
    t2, ffn = cfg["text_embed_2_dim"], 4 * D
    time = 256 + D  # timestep embedder: linear_1 over 256 sinusoids, linear_2
    byt5 = 2 * t2 + t2 + 2048 + 2048  # LayerNorm, linear_1, linear_2 and linear_3 (2,048 wide: diffusers')
    # LN, q/k/v, scores, PV, out, LN, MLP in and out, gates
    refiner_block = 2 * D + D + d + prompt + D + 2 * D + D + ffn + D
    refiner = prompt + 2 * cfg["text_embed_dim"] + D + time + cfg["num_refiner_layers"] * refiner_block
    # modulation, LN, q/k/v, RMS norm, scores, PV over the joint segment, out, LN, MLP in and out
    block = D + 2 * D + D + d + d + segment + D + 2 * D + D + ffn
    head = D + 2 * D + D  # norm_out's linear, LayerNorm, proj_out
    return time + byt5 + refiner + cfg["num_layers"] * block + head


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


@torch.no_grad()
def _sensitive(model: nn.Module) -> nn.Module:
    """diffusers' default init, its linear maps scaled by 2.5 and its norms' unit weights jittered.

    The default init (uniform +-1/sqrt(fan_in): gain ~0.6 per linear) damps the conditioning paths so
    much that a wrong pooled prompt or condition kind moved the output by only ~2e-3, about the derived
    bound; at gain ~1.4 (still renormalized by a norm every two or three linears) such bugs move it by
    4e-2 to 1.3e-1, and the rounding stays ~2e-6. Norm weights of exactly 1 would hide a missing affine."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv3d)):
            module.weight.mul_(2.5)
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight") and p.ndim == 1:
            p.add_(0.1 * torch.randn_like(p))
    return model


def _models(patch: int):
    torch.manual_seed(0)
    ref = _sensitive(HunyuanVideo15Transformer3DModel(**CONFIG, patch_size=patch))
    ours = HunyuanVideo15DiT.from_config(ref.config)
    ours.load_state_dict(ref.state_dict(), strict=True)  # a plain load: names and shapes are diffusers'
    return ref, ours


def _inputs(with_image: list[bool]):
    gen = torch.Generator().manual_seed(1)
    c = CONFIG
    clips = [torch.randn(c["in_channels"], *s, generator=gen) for s in SHAPES]
    texts = [torch.randn(n, c["text_embed_dim"], generator=gen) for n in TEXT_LENS]
    glyphs = [torch.randn(n, c["text_embed_2_dim"], generator=gen) for n in GLYPH_LENS]
    images = [
        torch.randn(IMAGE_TOKENS if i2v else 0, c["image_embed_dim"], generator=gen) for i2v in with_image
    ]
    timesteps = torch.tensor([999.0, 500.0, 37.5])
    weights = [torch.randn(c["out_channels"], *s, generator=gen) for s in SHAPES]  # of the loss
    return clips, texts, glyphs, images, timesteps, weights


def _padded(rows: torch.Tensor, length: int, gen: torch.Generator):
    """(k, dim) -> (1, length, dim) with random padding rows, and its (1, length) mask."""
    pad = torch.randn(length - rows.shape[0], rows.shape[1], generator=gen)
    return torch.cat([rows, pad])[None], (torch.arange(length) < rows.shape[0]).long()[None]


def run_diffusers(ref, clip, timestep, text, glyph, image):
    """One clip alone through diffusers, as its pipelines call it: prompts padded to a fixed length
    under a mask, a T2V clip's image an all-zero (masked) one."""
    gen = torch.Generator().manual_seed(2)
    text, text_mask = _padded(text, max(TEXT_LENS) + 2, gen)
    glyph, glyph_mask = _padded(glyph, max(GLYPH_LENS) + 2, gen)
    if image.shape[0] == 0:
        image = torch.zeros(IMAGE_TOKENS, CONFIG["image_embed_dim"])
    return ref(
        clip[None],
        timestep[None],
        text,
        text_mask,
        encoder_hidden_states_2=glyph,
        encoder_attention_mask_2=glyph_mask,
        image_embeds=image[None],
        return_dict=False,
    )[0][0]


def run_packed(ours, clips, texts, glyphs, images, timesteps):
    packed = pack(clips, ours.patch_size)
    lens = [torch.tensor([x.shape[0] for x in rows]) for rows in (texts, glyphs, images)]
    attention = PackedAttention(joint_lens(packed.seq_lens, *lens))
    out = ours(
        packed.tokens,
        packed.positions,
        packed.seq_lens,
        timesteps,
        torch.cat(texts),
        lens[0],
        attention,
        torch.cat(glyphs),
        lens[1],
        torch.cat(images),
        lens[2],
    )
    return unpack(packed, out, ours.patch_size), packed


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_clips_match_each_clip_through_diffusers(case):
    with_image, patch = CASES[case]
    ref, ours = _models(patch)
    clips, texts, glyphs, images, timesteps, weights = _inputs(with_image)
    outs, packed = run_packed(ours, clips, texts, glyphs, images, timesteps)
    refs = [run_diffusers(ref, *args) for args in zip(clips, timesteps, texts, glyphs, images)]

    # The longest joint segment and prompt set the attention reductions' lengths.
    segment = (
        int(joint_lens(packed.seq_lens, torch.tensor(TEXT_LENS), torch.tensor(GLYPH_LENS)).max())
        + IMAGE_TOKENS
    )
    k = reduction_budget(CONFIG, segment, max(TEXT_LENS))
    # Both sides are within gamma_k of the exact forward, so within 2 gamma_k of each other, relative
    # to the activations' scale (the largest output entry; ~6 here). k ~ 5,800 (the ByT5 projection's
    # two 2,048-long sums dominate) makes it ~4e-3; observed ~2e-6. The bound holds for any summation
    # order, so for AVX2, AVX-512 and any thread split of the GEMMs. Text padding in a segment, a
    # foreign context row, a wrong condition kind, pooled prompt, RoPE theta or q norm moves the
    # output by 3e-2 to 1.6: 6x to 350x the bound.
    scale = max(float(r.abs().max()) for r in refs)
    for got, want in zip(outs, refs):
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 2 * gamma(k) * scale

    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    for r, w in zip(refs, weights):  # one backward per clip: diffusers accumulates the sum
        (r * w).sum().backward()
    # Backward runs the forward chain again and adds two reductions of its own: a weight's gradient
    # sums over every packed token (n), and diffusers' per-clip gradients are summed (b). It rounds at
    # the size of the signals, not of each entry, so relative to the largest gradient entry G.
    k_grad = 2 * k + int(packed.seq_lens.sum()) + len(clips)
    ours_params = dict(ours.named_parameters())
    grads = {
        name: (
            torch.zeros_like(p) if ours_params[name].grad is None else ours_params[name].grad,
            torch.zeros_like(p) if p.grad is None else p.grad,
        )
        for name, p in ref.named_parameters()
    }
    assert set(grads) == set(ours_params)
    largest = max(float(want.abs().max()) for _, want in grads.values())
    for name, (got, want) in grads.items():
        assert float((got - want).abs().max()) <= 2 * gamma(k_grad) * largest, name
    # every context kind the case has reached the loss: a dropped stream would leave its grads at zero
    assert float(ours.context_embedder_2.linear_3.weight.grad.abs().max()) > 0
    assert float(ours.context_embedder.proj_in.weight.grad.abs().max()) > 0
    image_grad = ours.image_embedder.linear_2.weight.grad
    assert (image_grad is not None and float(image_grad.abs().max()) > 0) == any(with_image)
