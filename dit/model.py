"""VideoDiT: a packed, variable-length video diffusion transformer.

The block structure is Wan2.1's (full 3D self-attention with 3D RoPE, RMS q/k norms, cross-attention
to text, time modulation shared by all blocks plus a learned per-block table, GELU-tanh FFN), with
parameter names equal to diffusers' ``WanTransformer3DModel`` so checkpoints map one to one
(``dit/wan_import.py``). What differs is the input: not a padded (batch, c, f, h, w) tensor but a
*packed* token sequence (see ``dit/packing.py``) of clips with different shapes, and an injected
``attention`` function. The model never talks to other processes; under context parallelism it is
handed this rank's tokens and a CP attention function, and everything else here is per token or per
clip.

Image conditioning (Wan2.1 I2V / FLF2V, ``image_dim`` set): each clip also carries m CLIP image
tokens (257 per image; FLF2V: first and last frame, 514), embedded by diffusers' ``WanImageEmbedding``
and attended to in every cross-attention through separate ``add_k_proj``/``add_v_proj`` (``norm_added_k``);
that output is added to the text attention's. The image latents and mask enter as extra input
channels (``dit/image_cond.py``), so they need nothing here.

Per-token timesteps (Wan2.2 TI2V-5B, diffusers' ``expand_timesteps``): ``token_timesteps`` gives each
token its own timestep, so its modulation (and the output norm's shift and scale) come from its own
time embedding instead of its clip's. TI2V's image-to-video mode gives the clean first latent frame
t = 0 and the rest of the clip the clip's t (``dit/ti2v.py``). The embedding runs once per distinct
value (a clip has one or two), and every block gathers its rows per token, so memory stays that of
per-clip timesteps. Without ``token_timesteps`` the model runs exactly as before.

Legend: n = packed tokens held by this process, b = clips in the micro-batch, l = text tokens
(all clips), m = image tokens per clip, p = patch values (pt*ph*pw*c), D = hidden width, h = heads,
d = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import (
    PixArtAlphaTextProjection,
    TimestepEmbedding,
    Timesteps,
    get_1d_rotary_pos_embed,
)
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanImageEmbedding
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch.utils.checkpoint import checkpoint

from dit.attention import AttentionFn, cu_seqlens_from_lengths, varlen_attention


def pad_text(text: torch.Tensor, text_lens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(l, text_dim) captions -> (b*length, text_dim), each zero-padded to ``length``, and new lengths.

    Wan pads every umT5 caption with zeros to 512 tokens and cross-attends to the padding too (the
    text projection maps zero rows to a learned vector), so a Wan checkpoint only sees its training
    distribution when its captions are padded the same way.
    """
    lens = text_lens.to(text.device)
    if lens.numel() and int(lens.max()) > length:
        raise ValueError(
            f"a caption has {int(lens.max())} text tokens but text_pad_len is {length}; "
            f"set data.text_max_length <= {length}"
        )
    clip = torch.repeat_interleave(torch.arange(lens.numel(), device=text.device), lens)  # (l,)
    within = torch.arange(text.shape[0], device=text.device) - (torch.cumsum(lens, 0) - lens)[clip]
    padded = text.new_zeros(lens.numel() * length, text.shape[1])
    padded[clip * length + within] = text
    return padded, torch.full_like(text_lens, length)


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

    The head dim is split into t, h, w parts (h = w = 2 * (d // 6), t takes the rest); every part
    rotates adjacent channel pairs. Indexing by position is what lets a CP shard, or a packed clip,
    get exactly the rotation it would get in the full, unpacked clip.
    """

    def __init__(self, head_dim: int, max_positions: int = 1024, theta: float = 10000.0):
        super().__init__()
        h_dim = w_dim = 2 * (head_dim // 6)
        self.split = (head_dim - h_dim - w_dim, h_dim, w_dim)
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


class VideoDiT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Packed video DiT. Config names follow diffusers' WanTransformer3DModel where they overlap.

    ``PeftAdapterMixin`` is diffusers' own LoRA mixin (as on WanTransformer3DModel): ``add_adapter``,
    ``fuse_lora``, ``unload_lora`` and friends work here unchanged, since module names equal Wan's
    (``dit/lora.py`` builds training, save and load on them).

    ``text_pad_len`` (ours, not diffusers'): zero-pad each caption to this many tokens as Wan's pipeline
    does (512 for Wan checkpoints, set by ``dit.wan_import``); None uses the captions as given.

    ``image_dim``, ``added_kv_proj_dim`` (must equal the width) and ``pos_embed_seq_len`` (FLF2V: 514
    tokens of two images) are diffusers' image-conditioning fields; with ``image_dim`` set, forward
    needs each clip's CLIP image tokens.

    ``expand_timesteps`` (ours; diffusers keeps it in the pipeline's ``model_index.json``): the model
    was trained with per-token timesteps, Wan2.2 TI2V-5B. It changes no weight and no computation
    here; training and sampling read it to run image-to-video with a clean first latent frame at
    t = 0 (``dit/ti2v.py``).
    """

    _supports_gradient_checkpointing = True
    _keep_in_fp32_modules = ["rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"]

    @register_to_config
    def __init__(
        self,
        patch_size: tuple[int, int, int] = (1, 2, 2),
        num_attention_heads: int = 12,
        attention_head_dim: int = 128,
        in_channels: int = 16,
        out_channels: int | None = None,
        text_dim: int = 4096,
        freq_dim: int = 256,
        ffn_dim: int = 8960,
        num_layers: int = 30,
        cross_attn_norm: bool = True,
        qk_norm: bool = True,
        eps: float = 1e-6,
        rope_max_seq_len: int = 1024,
        adaln_zero_init: bool = True,
        text_pad_len: int | None = None,
        image_dim: int | None = None,
        added_kv_proj_dim: int | None = None,
        pos_embed_seq_len: int | None = None,
        expand_timesteps: bool = False,
    ):
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        check_image_fields(dim, image_dim, added_kv_proj_dim, pos_embed_seq_len)
        out_channels = out_channels or in_channels
        self.patch_size = tuple(patch_size)
        self.out_patch_dim = out_channels * math.prod(patch_size)

        self.rope = RotaryEmbedding3D(attention_head_dim, rope_max_seq_len)
        # A linear layer on (pt, ph, pw, c) patches: the same map as Wan's strided Conv3d.
        self.patch_embedding = nn.Linear(in_channels * math.prod(patch_size), dim)
        self.condition_embedder = nn.Module()
        self.condition_embedder.timesteps_proj = Timesteps(
            freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0
        )
        self.condition_embedder.time_embedder = TimestepEmbedding(freq_dim, dim)
        self.condition_embedder.time_proj = nn.Linear(dim, 6 * dim)
        self.condition_embedder.text_embedder = PixArtAlphaTextProjection(text_dim, dim, act_fn="gelu_tanh")
        if image_dim is not None:
            self.condition_embedder.image_embedder = WanImageEmbedding(image_dim, dim, pos_embed_seq_len)
        self.blocks = nn.ModuleList(
            DiTBlock(dim, ffn_dim, num_attention_heads, eps, qk_norm, cross_attn_norm, added_kv_proj_dim)
            for _ in range(num_layers)
        )
        self.norm_out = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, self.out_patch_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.gradient_checkpointing = False
        if adaln_zero_init:
            self._adaln_zero_init()

    @torch.no_grad()
    def _adaln_zero_init(self) -> None:
        """DiT's adaLN-Zero: every block starts as the identity and the output as zero.

        Zero gates (table rows 2 and 5) and a zero time projection make each residual branch vanish
        at step 0; the gates still get gradients, so the branches switch on as training proceeds.
        """
        for block in self.blocks:
            block.scale_shift_table[:, 2].zero_()
            block.scale_shift_table[:, 5].zero_()
        nn.init.zeros_(self.condition_embedder.time_proj.weight)
        nn.init.zeros_(self.condition_embedder.time_proj.bias)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(
        self,
        tokens: torch.Tensor,  # (n, p) patches of this process's tokens
        positions: torch.Tensor,  # (n, 3) global (t, h, w) patch index inside each token's clip
        seq_lens: torch.Tensor,  # (b,) tokens of each clip held here (0 allowed under CP)
        timesteps: torch.Tensor,  # (b,) in [0, 1000]
        text: torch.Tensor,  # (l, text_dim) all clips' text embeddings, concatenated
        text_lens: torch.Tensor,  # (b,)
        attention: AttentionFn,
        image: torch.Tensor | None = None,  # (b, m, image_dim) CLIP tokens per clip (image_dim models)
        token_timesteps: torch.Tensor | None = None,  # (n,) in [0, 1000]: each token's own (TI2V)
    ) -> torch.Tensor:
        """Returns the predicted velocity for each token, (n, p_out).

        ``token_timesteps`` replaces ``timesteps`` for the modulation of every token (diffusers'
        (batch, seq_len) timestep of Wan2.2 TI2V); None keeps one timestep per clip."""
        ce = self.condition_embedder
        rows = None  # (n,) row of temb/modulation per token when timesteps are per token
        if token_timesteps is not None:
            if token_timesteps.shape != (tokens.shape[0],):
                raise ValueError(
                    f"token_timesteps has shape {tuple(token_timesteps.shape)}, expected ({tokens.shape[0]},): "
                    "one timestep per token held here"
                )
            # one embedding per distinct value (1-2 per clip), gathered per token in each block
            timesteps, rows = torch.unique(token_timesteps.float(), return_inverse=True)  # (u,), (n,)
        t_freq = ce.timesteps_proj(timesteps.float())  # (b, freq_dim)
        temb = ce.time_embedder(t_freq.to(ce.time_embedder.linear_1.weight.dtype)).type_as(tokens)  # (b, D)
        modulation = ce.time_proj(F.silu(temb)).unflatten(1, (6, -1))  # (b, 6, D)
        if self.config.text_pad_len is not None:  # Wan's zero-padded captions (see pad_text)
            text, text_lens = pad_text(text, text_lens, self.config.text_pad_len)  # (b*L, text_dim)
        context = ce.text_embedder(text.to(tokens.dtype))  # (l, D)
        text_cu_seqlens = cu_seqlens_from_lengths(text_lens)
        cu_seqlens = cu_seqlens_from_lengths(seq_lens)
        rope = self.rope(positions)
        image_context, image_cu_seqlens = self.embed_image(image, seq_lens.shape[0], tokens.dtype)

        x = self.patch_embedding(tokens)  # (n, D)
        for block in self.blocks:
            args = (x, context, modulation, rope, seq_lens, cu_seqlens, text_cu_seqlens, attention)
            args += (image_context, image_cu_seqlens)
            if rows is not None:  # absent otherwise: the block's call (and compiled graph) stays as it was
                args += (rows,)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, *args, use_reentrant=False)
            else:
                x = block(*args)

        shift, scale = (self.scale_shift_table + temb[:, None, :]).unbind(1)  # (b, D) each
        if rows is None:
            shift, scale = per_token(shift, seq_lens), per_token(scale, seq_lens)
        else:
            shift, scale = shift.index_select(0, rows), scale.index_select(0, rows)  # (n, D)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        return self.proj_out(x)  # (n, pt*ph*pw*c)

    def embed_image(
        self, image: torch.Tensor | None, num_clips: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(b, m, image_dim) CLIP tokens -> (b*m, D) embedded tokens and their (b+1,) offsets, or Nones."""
        image_dim = self.config.image_dim
        if image_dim is None:
            if image is not None:
                raise ValueError(
                    "image embeddings were given to a text-to-video model (image_dim is None); drop --image, "
                    "or load an image-to-video checkpoint (Wan2.1 I2V/FLF2V)"
                )
            return None, None
        if image is None:
            raise ValueError(
                f"this model is image-conditioned (image_dim={image_dim}) and needs each clip's CLIP image "
                "embeddings; pass an image (sample.py --image PATH) or use a cache built with --image-encoder"
            )
        m = self.config.pos_embed_seq_len
        if (
            image.ndim != 3
            or image.shape[0] != num_clips
            or image.shape[2] != image_dim
            or m not in (None, image.shape[1])
        ):
            want = f"({num_clips}, {m or 'tokens'}, {image_dim})"
            raise ValueError(
                f"image embeddings have shape {tuple(image.shape)}, expected {want}: one row of CLIP tokens per "
                "clip (FLF2V: first and last frame's tokens concatenated)"
            )
        embedder = self.condition_embedder.image_embedder
        if m is not None:
            # diffusers' FLF2V embedder takes the two images as separate rows and pairs them itself
            # (its input is (2b, m/2, image_dim)); ours are already paired per clip.
            image = image.reshape(-1, m // 2, image_dim)
        tokens_per_clip = image.shape[1] if m is None else m
        context = embedder(image.to(dtype)).flatten(0, 1)  # (b*m, D)
        return context, cu_seqlens_from_lengths([tokens_per_clip] * num_clips)


def check_image_fields(
    dim: int, image_dim: int | None, added_kv_proj_dim: int | None, pos_embed_seq_len: int | None
) -> None:
    """ValueError unless the image-conditioning fields describe a model diffusers can build and run."""
    if (image_dim is None) != (added_kv_proj_dim is None):
        raise ValueError(
            f"image_dim={image_dim} and added_kv_proj_dim={added_kv_proj_dim}: set both (image-to-video) or neither"
        )
    if added_kv_proj_dim is not None and added_kv_proj_dim != dim:
        raise ValueError(
            f"added_kv_proj_dim={added_kv_proj_dim} must equal the width num_attention_heads * "
            f"attention_head_dim = {dim} (the image K/V read the embedded image tokens)"
        )
    if pos_embed_seq_len is not None and (image_dim is None or pos_embed_seq_len % 2):
        raise ValueError(
            f"pos_embed_seq_len={pos_embed_seq_len} is FLF2V's two-image length: it needs image_dim and an "
            "even value (514 for two CLIP images of 257 tokens)"
        )


def cast_weights(model: nn.Module, dtype: torch.dtype, keep_fp32: bool = True) -> nn.Module:
    """Parameters of ``model`` to ``dtype``, except (``keep_fp32``) those of the modules diffusers keeps
    in fp32 (the ``_keep_in_fp32_modules`` of every VideoDiT inside, so both experts of an ExpertPair:
    norms, time embedding, modulation tables), as ``from_pretrained(torch_dtype=...)`` loads them.
    Buffers (the RoPE tables, fp32 for the complex rotation) stay as they are."""
    keep = set()
    for module in model.modules() if keep_fp32 else ():
        keep.update(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        if not keep & set(name.split(".")):
            p.data = p.data.to(dtype)
    return model
