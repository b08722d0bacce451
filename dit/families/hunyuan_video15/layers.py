"""HunyuanVideo-1.5's layers on packed clips: attention, the MLLM token refiner, the dual-stream block.

Module and parameter names are diffusers' (``transformer_hunyuan_video15.py``), so its state dict
loads into ours as it is; diffusers' own per-token modules (``FeedForward``, ``AdaLayerNormZero``,
``HunyuanVideo15AdaNorm``, the timestep/text embedders) are reused, and only what depends on the
batch layout (masks, pooling, joint attention) is written here for packed rows.

The joint sequence: per clip, its video tokens followed by its context tokens (image, ByT5, MLLM:
the valid ones only), one varlen segment handed to the injected attention function. diffusers gets
the same attention from one padded row per clip under a mask; packing drops the padding instead.

Legend: n = packed video tokens held by this process, l = packed context tokens, t = MLLM tokens
(all clips), b = clips, D = hidden width, h = heads, d = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import CombinedTimestepTextProjEmbeddings
from diffusers.models.normalization import AdaLayerNormZero
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AdaNorm

from dit.attention import AttentionFn, cu_seqlens_from_lengths, varlen_attention
from dit.blocks import apply_rotary, eager_attention, per_token
from dit.packing import interleave_index, inverse_index

EPS = 1e-6  # every norm of the model (diffusers hard-codes it)


@dataclass
class JointLayout:
    """Where each clip's video and context rows sit in the joint sequence the attention sees."""

    video_lens: torch.Tensor  # (b,) video tokens of each clip held here
    context_lens: torch.Tensor  # (b,) its context tokens (image + ByT5 + MLLM)
    order: torch.Tensor  # (n+l,) rows of cat([video, context]) in joint (clip-major) order
    inverse: torch.Tensor  # (n+l,) joint order -> cat([video, context])

    @classmethod
    def build(cls, video_lens: torch.Tensor, context_lens: torch.Tensor) -> JointLayout:
        order = interleave_index(torch.stack([video_lens, context_lens]))
        return cls(video_lens, context_lens, order, inverse_index(order))

    def segment_lens(self) -> torch.Tensor:
        """(b,) joint segment of each clip: what the attention function must be built over."""
        return self.video_lens + self.context_lens


class HunyuanAttention(nn.Module):
    """diffusers' ``Attention`` as HunyuanVideo-1.5 configures it: q/k/v/out, per-head RMS q/k norms
    (``qk_norm``) and, with ``added``, the context stream's own projections and norms."""

    def __init__(self, dim: int, heads: int, qk_norm: bool, added: bool):
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.norm_q = nn.RMSNorm(head_dim, eps=EPS) if qk_norm else nn.Identity()
        self.norm_k = nn.RMSNorm(head_dim, eps=EPS) if qk_norm else nn.Identity()
        if added:
            self.add_q_proj, self.add_k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.add_v_proj, self.to_add_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_added_q = nn.RMSNorm(head_dim, eps=EPS) if qk_norm else nn.Identity()
            self.norm_added_k = nn.RMSNorm(head_dim, eps=EPS) if qk_norm else nn.Identity()

    def project(self, x: torch.Tensor):
        """x (n, D) -> q, k, v (n, h, d) through the video (or refiner) projections."""
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))
        return self.norm_q(q), self.norm_k(k), v

    def project_added(self, c: torch.Tensor):
        """c (l, D) -> q, k, v (l, h, d) through the context stream's projections."""
        q, k, v = (
            p(c).unflatten(-1, (self.heads, -1)) for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        )
        return self.norm_added_q(q), self.norm_added_k(k), v

    def joint(
        self,
        x: torch.Tensor,  # (n, D) normed video stream
        c: torch.Tensor,  # (l, D) normed context stream
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin (n, 1, d): video tokens only
        layout: JointLayout,
        attention: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Video and context attend jointly, each clip within its own segment -> (n, D), (l, D)."""
        q, k, v = self.project(x)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        cq, ck, cv = self.project_added(c)
        # (n, h, d) + (l, h, d) -> (n+l, h, d), clip-major: [video_0, context_0, video_1, ...]
        q, k, v = (torch.cat([a, b]).index_select(0, layout.order) for a, b in ((q, cq), (k, ck), (v, cv)))
        o = eager_attention(attention, q, k, v).index_select(0, layout.inverse).flatten(-2)  # (n+l, D)
        n = x.shape[0]
        return self.to_out[0](o[:n]), self.to_add_out(o[n:])


class RefinerBlock(nn.Module):
    """One block of the MLLM token refiner: self-attention among a clip's valid MLLM tokens and a
    SiLU MLP, each gated per clip from the refiner's own (time + pooled text) embedding."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=EPS)
        self.attn = HunyuanAttention(dim, heads, qk_norm=False, added=False)
        self.norm2 = nn.LayerNorm(dim, eps=EPS)
        self.ff = FeedForward(dim, activation_fn="linear-silu")  # 4x wide whatever mlp_ratio, as diffusers
        self.norm_out = HunyuanVideo15AdaNorm(dim, 2 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """x (t, D) packed MLLM tokens, temb (b, D), lens (b,) -> (t, D)."""
        cu = cu_seqlens_from_lengths(lens)
        q, k, v = self.attn.project(self.norm1(x))
        # local to each clip's prompt, which every CP rank holds whole: no injected attention here
        attn = self.attn.to_out[0](varlen_attention(q, k, v, cu, cu).flatten(-2))
        gate_msa, gate_mlp = self.norm_out.linear(self.norm_out.nonlinearity(temb)).chunk(2, dim=1)  # (b, D)
        x = x + attn * per_token(gate_msa, lens, x.shape[0])
        return x + self.ff(self.norm2(x)) * per_token(gate_mlp, lens, x.shape[0])


class TokenRefiner(nn.Module):
    """diffusers' ``HunyuanVideo15TokenRefiner`` on packed prompts: the pooled prompt is the mean of
    its valid tokens, and attention stays inside each prompt's valid tokens."""

    def __init__(self, in_dim: int, dim: int, heads: int, num_layers: int):
        super().__init__()
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(
            embedding_dim=dim, pooled_projection_dim=in_dim
        )
        self.proj_in = nn.Linear(in_dim, dim)
        self.token_refiner = nn.Module()
        self.token_refiner.refiner_blocks = nn.ModuleList(RefinerBlock(dim, heads) for _ in range(num_layers))

    def forward(self, text: torch.Tensor, lens: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """text (t, in_dim), lens (b,), timesteps (b,) -> (t, D)."""
        clip = torch.repeat_interleave(torch.arange(lens.numel(), device=text.device), lens.to(text.device))
        # fp32 sum as diffusers' masked mean (its float mask promotes the product), then the text's dtype
        sums = text.new_zeros(lens.numel(), text.shape[1], dtype=torch.float32).index_add_(
            0, clip, text.float()
        )
        pooled = (sums / lens.to(sums)[:, None]).to(text.dtype)  # (b, in_dim)
        temb = self.time_text_embed(timesteps, pooled)  # (b, D)
        x = self.proj_in(text)
        for block in self.token_refiner.refiner_blocks:
            x = block(x, temb, lens)
        return x


class DualStreamBlock(nn.Module):
    """diffusers' ``HunyuanVideo15TransformerBlock``: video and context keep their own modulation,
    projections and MLP, and attend jointly."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim, norm_type="layer_norm")
        self.norm1_context = AdaLayerNormZero(dim, norm_type="layer_norm")
        self.attn = HunyuanAttention(dim, heads, qk_norm=True, added=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.ff = FeedForward(dim, mult=mlp_ratio, activation_fn="gelu-approximate")
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.ff_context = FeedForward(dim, mult=mlp_ratio, activation_fn="gelu-approximate")

    def forward(
        self,
        x: torch.Tensor,  # (n, D) video stream
        c: torch.Tensor,  # (l, D) context stream, clip-major
        temb: torch.Tensor,  # (b, D)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin (n, 1, d)
        layout: JointLayout,
        attention: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x_mod = _modulation(self.norm1, temb, layout.video_lens, x.shape[0])
        c_mod = _modulation(self.norm1_context, temb, layout.context_lens, c.shape[0])
        shift, scale, gate, shift2, scale2, gate2 = x_mod
        c_shift, c_scale, c_gate, c_shift2, c_scale2, c_gate2 = c_mod

        h = self.norm1.norm(x) * (1 + scale) + shift
        hc = self.norm1_context.norm(c) * (1 + c_scale) + c_shift
        attn, c_attn = self.attn.joint(h, hc, rope, layout, attention)
        x = x + attn * gate
        c = c + c_attn * c_gate

        x = x + gate2 * self.ff(self.norm2(x) * (1 + scale2) + shift2)
        c = c + c_gate2 * self.ff_context(self.norm2_context(c) * (1 + c_scale2) + c_shift2)
        return x, c


def _modulation(norm: AdaLayerNormZero, temb: torch.Tensor, lens: torch.Tensor, rows: int):
    """The six (shift, scale, gate) x 2 rows of an AdaLayerNormZero, each (rows, D), per token."""
    mod = norm.linear(norm.silu(temb))  # (b, 6D)
    return [per_token(m, lens, rows) for m in mod.chunk(6, dim=1)]
