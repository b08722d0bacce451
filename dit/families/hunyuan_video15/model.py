"""HunyuanVideo15DiT: diffusers' ``HunyuanVideo15Transformer3DModel`` on packed variable-length clips.

The config fields and the state dict are diffusers' own, so a diffusers checkpoint loads with
``load_state_dict(strict=True)`` and nothing renamed. The input is the packed layout of
``dit/packing.py`` (video tokens of clips of different shapes, no padding) plus each clip's context,
packed the same way: its MLLM (Qwen2.5-VL) states, its ByT5 glyph states and, for an I2V clip, its
SigLIP image tokens, the valid rows only. diffusers pads each of those to the batch's longest and
masks the padding; here a clip's joint segment is its video tokens followed by exactly its valid
context tokens (``layers.JointLayout``), so the attention function never sees a padded row.

T2V and I2V differ only in the image tokens: a T2V clip has none (``image_lens`` 0), where diffusers
embeds an all-zero image and masks it out. ``task_type`` is kept in the config for the pipelines.

Attention is injected, as for ``VideoDiT``: ``attention(q, k, v)`` over the joint sequence, built for
the segment lengths ``joint_lens(...)`` returns (``PackedAttention(joint_lens(...))`` in one
process). The model never talks to other processes.

Legend: n = packed video tokens, l = packed context tokens, t = MLLM tokens, g = ByT5 tokens,
m = image tokens (all clips), b = clips, p = patch values (pt*ph*pw*c), D = hidden width.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNormContinuous
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15ByT5TextProjection,
    HunyuanVideo15ImageProjection,
    HunyuanVideo15PatchEmbed,
    HunyuanVideo15TimeEmbedding,
)

from dit.attention import AttentionFn, PackedAttention
from dit.blocks import RotaryEmbedding3D, per_token
from dit.families.hunyuan_video15.layers import EPS, DualStreamBlock, JointLayout, TokenRefiner
from dit.model import checkpoint_block
from dit.packing import interleave_index

BYT5_HIDDEN = 2048  # diffusers hard-codes the ByT5 projection's hidden width
MLLM, BYT5, IMAGE = 0, 1, 2  # rows of cond_type_embed: the kind of each context token


def joint_lens(
    seq_lens: torch.Tensor, text_lens: torch.Tensor, glyph_lens=None, image_lens=None
) -> torch.Tensor:
    """(b,) joint segment of each clip: video + image + ByT5 + MLLM tokens (None counts 0)."""
    return seq_lens + text_lens + _lens(glyph_lens, text_lens) + _lens(image_lens, text_lens)


def _lens(lens: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if lens is None else torch.as_tensor(lens, dtype=like.dtype)


class HunyuanVideo15DiT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Packed HunyuanVideo-1.5 transformer; ``__init__`` takes diffusers' config fields."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        in_channels: int = 65,
        out_channels: int = 32,
        num_attention_heads: int = 16,
        attention_head_dim: int = 128,
        num_layers: int = 54,
        num_refiner_layers: int = 2,
        mlp_ratio: float = 4.0,
        patch_size: int = 1,
        patch_size_t: int = 1,
        qk_norm: str = "rms_norm",
        text_embed_dim: int = 3584,
        text_embed_2_dim: int = 1472,
        image_embed_dim: int = 1152,
        rope_theta: float = 256.0,
        rope_axes_dim: tuple[int, ...] = (16, 56, 56),
        target_size: int = 640,
        task_type: str = "i2v",
        use_meanflow: bool = False,
    ):
        super().__init__()
        if qk_norm != "rms_norm" or use_meanflow:
            raise ValueError(
                f"qk_norm={qk_norm!r}, use_meanflow={use_meanflow}: only HunyuanVideo-1.5's rms_norm without "
                "meanflow (the T2V/I2V models, not the super-resolution ones) is supported"
            )
        dim = num_attention_heads * attention_head_dim
        self.out_channels = out_channels or in_channels
        self.patch_size = (patch_size_t, patch_size, patch_size)  # (pt, ph, pw), dit/packing.py's order
        self.x_embedder = HunyuanVideo15PatchEmbed(self.patch_size, in_channels, dim)
        self.image_embedder = HunyuanVideo15ImageProjection(image_embed_dim, dim)
        self.context_embedder = TokenRefiner(text_embed_dim, dim, num_attention_heads, num_refiner_layers)
        self.context_embedder_2 = HunyuanVideo15ByT5TextProjection(text_embed_2_dim, BYT5_HIDDEN, dim)
        self.time_embed = HunyuanVideo15TimeEmbedding(dim)
        self.cond_type_embed = nn.Embedding(3, dim)
        self.rope = RotaryEmbedding3D(attention_head_dim, theta=rope_theta, axes=tuple(rope_axes_dim))
        self.transformer_blocks = nn.ModuleList(
            DualStreamBlock(dim, num_attention_heads, mlp_ratio) for _ in range(num_layers)
        )
        self.norm_out = AdaLayerNormContinuous(dim, dim, elementwise_affine=False, eps=EPS)
        self.proj_out = nn.Linear(dim, self.out_channels * math.prod(self.patch_size))
        self.gradient_checkpointing = False
        self.checkpoint_fn = checkpoint_block  # (block, *args) -> output recomputed in backward

    def forward(
        self,
        tokens: torch.Tensor,  # (n, p) patches, channels last within a patch (dit/packing.py)
        positions: torch.Tensor,  # (n, 3) (t, h, w) patch index inside each token's clip
        seq_lens: torch.Tensor,  # (b,) video tokens of each clip
        timesteps: torch.Tensor,  # (b,) in [0, 1000]
        text: torch.Tensor,  # (t, text_embed_dim) valid Qwen2.5-VL states of every clip, concatenated
        text_lens: torch.Tensor,  # (b,)
        attention: AttentionFn,  # over the joint segments, joint_lens(...)
        glyph: torch.Tensor | None = None,  # (g, text_embed_2_dim) valid ByT5 states
        glyph_lens: torch.Tensor | None = None,  # (b,)
        image: torch.Tensor | None = None,  # (m, image_embed_dim) SigLIP tokens of the I2V clips
        image_lens: torch.Tensor | None = None,  # (b,): 0 for a T2V clip
    ) -> torch.Tensor:
        """The predicted velocity of each video token, (n, p_out), patch layout as ``tokens``."""
        glyph_lens, image_lens = _lens(glyph_lens, text_lens), _lens(image_lens, text_lens)
        layout = JointLayout.build(seq_lens, image_lens + glyph_lens + text_lens)
        _check_inputs(tokens, text, text_lens, glyph, glyph_lens, image, image_lens, layout, attention)
        temb = self.time_embed(timesteps)  # (b, D)
        proj = self.x_embedder.proj  # diffusers' Conv3d, read as a linear map on channels-last patches
        x = F.linear(tokens, proj.weight.permute(0, 2, 3, 4, 1).flatten(1), proj.bias)  # (n, D)
        c = self.embed_context(x, timesteps, text, text_lens, glyph, glyph_lens, image, image_lens)  # (l, D)
        rope = self.rope(positions)  # cos, sin (n, 1, d)
        for block in self.transformer_blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, c = self.checkpoint_fn(block, x, c, temb, rope, layout, attention)
            else:
                x, c = block(x, c, temb, rope, layout, attention)
        return self.head(x, temb, seq_lens)

    def embed_context(
        self, x, timesteps, text, text_lens, glyph, glyph_lens, image, image_lens
    ) -> torch.Tensor:
        """Each clip's context rows, embedded and tagged with their kind -> (l, D), clip-major in
        diffusers' order: image, ByT5, MLLM."""
        kinds = self.cond_type_embed.weight  # (3, D)
        empty = x.new_zeros(0, x.shape[1])
        parts = [
            empty if image is None else self.image_embedder(image.to(x.dtype)) + kinds[IMAGE],
            empty if glyph is None else self.context_embedder_2(glyph.to(x.dtype)) + kinds[BYT5],
            self.context_embedder(text.to(x.dtype), text_lens, timesteps) + kinds[MLLM],
        ]
        order = interleave_index(torch.stack([image_lens, glyph_lens, text_lens])).to(x.device)
        return torch.cat(parts).index_select(0, order)

    def head(self, x: torch.Tensor, temb: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """x (n, D) -> (n, p_out): the output norm, modulated per clip, and projection."""
        n = self.norm_out
        scale, shift = n.linear(n.silu(temb).to(x.dtype)).chunk(2, dim=1)  # (b, D) each: scale first
        x = n.norm(x) * (1 + per_token(scale, seq_lens, x.shape[0])) + per_token(shift, seq_lens, x.shape[0])
        out = self.proj_out(x)  # (n, c*pt*ph*pw): diffusers orders a patch's values channels first
        return out.unflatten(-1, (self.out_channels, -1)).transpose(-1, -2).flatten(-2)  # (n, pt*ph*pw*c)


def _check_inputs(tokens, text, text_lens, glyph, glyph_lens, image, image_lens, layout, attention) -> None:
    """ValueError naming the input whose rows disagree with its lengths, or an attention function
    built over other segments than the joint ones (the video lengths alone, the usual slip)."""
    for name, rows, lens in (
        ("tokens", tokens, layout.video_lens),
        ("text", text, text_lens),
        ("glyph", glyph, glyph_lens),
        ("image", image, image_lens),
    ):
        have = 0 if rows is None else rows.shape[0]
        if have != int(lens.sum()):
            raise ValueError(
                f"{name} has {have} rows but its lengths sum to {int(lens.sum())}: one length per clip"
            )
    if isinstance(attention, PackedAttention):
        want = PackedAttention(layout.segment_lens()).cu_seqlens
        if not torch.equal(attention.cu_seqlens, want):
            raise ValueError(
                "the attention function's segments are not the joint video + context ones: "
                "build it as PackedAttention(joint_lens(seq_lens, text_lens, glyph_lens, image_lens))"
            )
