"""The layers of the VideoDiT (``dit/model.py``): 3D RoPE, attention, and Wan2.1's transformer block.

Parameter names are diffusers' ``WanTransformer3DModel``'s, so checkpoints map one to one. Every
layer works on packed tokens (``dit/packing.py``) and takes the attention function it is handed, so
the same block runs one process or a CP group's share of a sequence.

Legend: n = packed tokens held by this process, b = clips in the micro-batch, l = text tokens
(all clips), m = image tokens per clip, D = hidden width, h = heads, d = head dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.models.normalization import FP32LayerNorm
from torch.fx.experimental.symbolic_shapes import guard_or_false

from dit.attention import AttentionFn, varlen_attention


def per_token(per_clip: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """(b, ...) -> (n, ...): repeat each clip's row for each of its tokens on this process.

    num_tokens: n when the caller knows it (a block does: x.shape[0]); under torch.compile it is a
    symbolic size, where ``int(seq_lens.sum())`` would read a tensor and break the graph.
    """
    # One clip: broadcasting avoids materializing n copies. Under torch.compile b is an unbacked size
    # (dit/compile.py), for which guard_or_false answers False without a guard: one graph for all b.
    if guard_or_false(per_clip.shape[0] == 1):
        return per_clip[0]
    torch._check(seq_lens.shape[0] == per_clip.shape[0])  # one length per clip (ties unbacked b's)
    n = int(seq_lens.sum()) if num_tokens is None else num_tokens
    # output_size spares CUDA a device-to-host sync to learn the result's length
    return per_clip.repeat_interleave(seq_lens.to(per_clip.device), dim=0, output_size=n)


@torch.compiler.disable
def eager_attention(attention: AttentionFn, *args) -> torch.Tensor:
    """Call an attention function outside any torch.compile graph (a graph break under compile).

    Self-attention may be a CP function whose collectives must stay out of compiled code, and every
    varlen kernel walks the clips of the micro-batch, whose count and lengths change each step: traced,
    they would specialize the graph on them and recompile for every new packing. In eager mode this
    is a plain call.

    The output leaves as a tensor of its own, not a view: compiled code that resumes after the break
    guards on a view's base, and the kernels return a view for some packings and not for others,
    which recompiled the block's resume frames once (tests/test_compile.py).
    """
    out = attention(*args)
    return out.clone() if out._base is not None else out


class RotaryEmbedding3D(nn.Module):
    """Wan's 3D RoPE, indexed by each token's global (t, h, w) position instead of a dense grid.

    The head dim is split into t, h, w parts (Wan: h = w = 2 * (d // 6), t takes the rest; ``axes``
    gives them instead, as HunyuanVideo-1.5's ``rope_axes_dim``); every part rotates adjacent channel
    pairs. Indexing by position is what lets a CP shard, or a packed clip, get exactly the rotation it
    would get in the full, unpacked clip.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int = 1024,
        theta: float = 10000.0,
        axes: tuple[int, int, int] | None = None,
    ):
        super().__init__()
        h_dim = w_dim = 2 * (head_dim // 6)
        self.split = tuple(axes) if axes is not None else (head_dim - h_dim - w_dim, h_dim, w_dim)
        if axes is not None and (sum(self.split) != head_dim or any(a % 2 for a in self.split)):
            raise ValueError(
                f"rope axes {self.split} must be even and sum to the head dim {head_dim} (t, h, w parts)"
            )
        cos, sin = [], []
        for dim in self.split:
            c, s = get_1d_rotary_pos_embed(
                dim,
                max_positions,
                theta,
                use_real=True,
                repeat_interleave_real=True,
                freqs_dtype=torch.float64,
            )
            cos.append(c.float())
            sin.append(s.float())
        self.max_positions = max_positions
        # Derived from the config, so not saved in checkpoints (as in diffusers' Wan).
        self.register_buffer("cos_table", torch.cat(cos, dim=1), persistent=False)  # (max_positions, d)
        self.register_buffer("sin_table", torch.cat(sin, dim=1), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (n, 3) long -> cos, sin: (n, 1, d), broadcast over heads."""
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"a clip has {int(positions.max()) + 1} patches along one axis but rope_max_seq_len is "
                f"{self.max_positions}; raise model.rope_max_seq_len or use a smaller clip"
            )
        cos = torch.cat(
            [part[positions[:, axis]] for axis, part in enumerate(self.cos_table.split(self.split, dim=1))],
            dim=-1,
        )
        sin = torch.cat(
            [part[positions[:, axis]] for axis, part in enumerate(self.sin_table.split(self.split, dim=1))],
            dim=-1,
        )
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of x (n, h, d) by the angles in cos/sin (n, 1, d), as Wan does.

    Computed as one complex multiply per pair: the same rotation as Wan's four real products and
    strided writes (equal to ~1e-7), and about 5-10% faster for a whole training step on CPU.
    """
    angles = torch.complex(cos[..., 0::2], sin[..., 1::2])  # (n, 1, d/2)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())  # (n, h, d/2)
    return torch.view_as_real(pairs * angles).flatten(-2).type_as(x)


class Attention(nn.Module):
    """q/k/v/out projections with RMS norm over all heads; parameter names follow diffusers' WanAttention."""

    def __init__(self, dim: int, heads: int, eps: float, qk_norm: bool, added_kv_proj_dim: int | None = None):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.norm_q = nn.RMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = nn.RMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        if added_kv_proj_dim is not None:  # image K/V of Wan I2V's cross-attention (diffusers' WanAttention)
            self.add_k_proj = nn.Linear(added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, dim)
            # diffusers applies it whatever qk_norm says, as it does norm_k
            self.norm_added_k = nn.RMSNorm(dim, eps=eps)

    def fusable(self) -> bool:
        """True while q, k and v are plain linear layers (no adapter layer wraps them)."""
        return all(type(m) is nn.Linear for m in (self.to_q, self.to_k, self.to_v))

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None):
        """x (n, D), context (l, D) or None -> q (n, h, d), k and v (n or l, h, d)."""
        # One GEMM for q, k and v (or k and v of the context) instead of three: larger matrix products
        # run closer to peak; the weights stay separate parameters, named as in Wan.
        if not self.fusable():  # peft LoRA layers wrap these projections: call them, or the adapters drop out
            q = self.to_q(x)
            k, v = self.to_k(x if context is None else context), self.to_v(x if context is None else context)
        elif context is None:
            weight = torch.cat([self.to_q.weight, self.to_k.weight, self.to_v.weight])
            bias = torch.cat([self.to_q.bias, self.to_k.bias, self.to_v.bias])
            q, k, v = F.linear(x, weight, bias).chunk(3, dim=-1)
        else:
            q = self.to_q(x)
            weight = torch.cat([self.to_k.weight, self.to_v.weight])
            k, v = F.linear(context, weight, torch.cat([self.to_k.bias, self.to_v.bias])).chunk(2, dim=-1)
        q = self.norm_q(q).unflatten(-1, (self.heads, -1))
        k = self.norm_k(k).unflatten(-1, (self.heads, -1))
        return q, k, v.unflatten(-1, (self.heads, -1))

    def project_added(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """image (b*m, D) -> k, v (b*m, h, d) through the added (image) projections."""
        k = self.norm_added_k(self.add_k_proj(image)).unflatten(-1, (self.heads, -1))
        return k, self.add_v_proj(image).unflatten(-1, (self.heads, -1))

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """(n, h, d) -> (n, D)"""
        return self.to_out[0](o.flatten(-2))


class DiTBlock(nn.Module):
    """Self-attention, cross-attention and FFN, with time modulation (shift, scale, gate) per clip."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        heads: int,
        eps: float,
        qk_norm: bool,
        cross_attn_norm: bool,
        added_kv_proj_dim: int | None = None,
    ):
        super().__init__()
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = Attention(dim, heads, eps, qk_norm)
        self.attn2 = Attention(dim, heads, eps, qk_norm, added_kv_proj_dim)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, inner_dim=ffn_dim, activation_fn="gelu-approximate")
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(
        self,
        x: torch.Tensor,  # (n, D)
        text: torch.Tensor,  # (l, D)
        modulation: torch.Tensor,  # (b, 6, D) from the shared time projection
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin (n, 1, d)
        seq_lens: torch.Tensor,  # (b,) local tokens per clip
        cu_seqlens: torch.Tensor,  # (b+1,) offsets of seq_lens, for cross-attention
        text_cu_seqlens: torch.Tensor,  # (b+1,)
        attention: AttentionFn,
        image: torch.Tensor | None = None,  # (b*m, D) embedded image tokens, image-conditioned models only
        image_cu_seqlens: torch.Tensor | None = None,  # (b+1,)
        modulation_rows: torch.Tensor | None = None,  # (n,) row of ``modulation`` per token (per-token t)
    ) -> torch.Tensor:
        mod = self.scale_shift_table + modulation.float()  # (b, 6, D), or (u, 6, D) per distinct timestep
        n = x.shape[0]
        if modulation_rows is None:
            shift1, scale1, gate1, shift2, scale2, gate2 = (per_token(m, seq_lens, n) for m in mod.unbind(1))
        else:
            shift1, scale1, gate1, shift2, scale2, gate2 = mod.index_select(0, modulation_rows).unbind(1)

        # 1. self-attention over each whole clip (possibly spread over a CP group)
        h = (self.norm1(x.float()) * (1 + scale1) + shift1).type_as(x)
        q, k, v = self.attn1.project(h)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        h = self.attn1.output(eager_attention(attention, q, k, v))
        x = (x.float() + h * gate1).type_as(x)

        # 2. cross-attention: each token attends to its own clip's text (and image), which every rank holds
        h = self.norm2(x.float()).type_as(x)
        q, k, v = self.attn2.project(h, text)
        o = eager_attention(varlen_attention, q, k, v, cu_seqlens, text_cu_seqlens)  # (n, h, d)
        if image is not None:  # Wan I2V: the same queries attend to the image apart; the outputs add
            k, v = self.attn2.project_added(image)
            o = o + eager_attention(varlen_attention, q, k, v, cu_seqlens, image_cu_seqlens).type_as(q)
        x = x + self.attn2.output(o)

        # 3. feed-forward
        h = (self.norm3(x.float()) * (1 + scale2) + shift2).type_as(x)
        return (x.float() + self.ffn(h).float() * gate2).type_as(x)
