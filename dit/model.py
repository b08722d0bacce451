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
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.embeddings import (
    PixArtAlphaTextProjection,
    TimestepEmbedding,
    Timesteps,
)
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanImageEmbedding
from torch.utils.checkpoint import checkpoint

from dit.attention import AttentionFn, cu_seqlens_from_lengths
from dit.blocks import DiTBlock, RotaryEmbedding3D, per_token


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


@dataclass
class BlockInputs:
    """One micro-batch's inputs of every block besides x (and the head's ``temb``). The first five
    follow from the micro-batch alone (``VideoDiT.frame``); the embedded four carry gradients back
    to the embedders (``VideoDiT.embed``), and are what a pipeline stage hands the next one."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (n, 1, d)
    seq_lens: torch.Tensor  # (b,)
    cu_seqlens: torch.Tensor  # (b+1,)
    text_cu_seqlens: torch.Tensor  # (b+1,)
    image_cu_seqlens: torch.Tensor | None  # (b+1,), image-conditioned models only
    rows: torch.Tensor | None  # (n,) row of temb/modulation per token (per-token timesteps)
    context: torch.Tensor | None = None  # (l, D) embedded text
    modulation: torch.Tensor | None = None  # (u, 6, D) shared time projection
    temb: torch.Tensor | None = None  # (u, D) time embedding
    image_context: torch.Tensor | None = None  # (b*m, D) embedded image tokens


def checkpoint_block(block: nn.Module, *args) -> torch.Tensor:
    """Gradient checkpointing of one block: only its inputs are kept, its activations recomputed."""
    return checkpoint(block, *args, use_reentrant=False)


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
        # (block, *args) -> block's output, recomputed in backward; dit/block_offload.py may swap it
        self.checkpoint_fn = checkpoint_block
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
        stage=None,  # a pipeline stage's part (dit/stages.py StagePart): run that part instead
    ) -> torch.Tensor:
        """Returns the predicted velocity for each token, (n, p_out).

        ``token_timesteps`` replaces ``timesteps`` for the modulation of every token (diffusers'
        (batch, seq_len) timestep of Wan2.2 TI2V); None keeps one timestep per clip.

        The three parts (``embed``, ``run_blocks``, ``head``) are what a pipeline stage runs a piece
        of: with ``stage`` the call returns ``stage(self, ...)``'s (output, block inputs). It goes
        through this forward so that wrappers' hooks on it (FSDP2's root unit) still run."""
        if stage is not None:
            args = (tokens, positions, seq_lens, timesteps, text, text_lens)
            return stage(self, args, attention, {"image": image, "token_timesteps": token_timesteps})
        x, inputs = self.embed(
            tokens, positions, seq_lens, timesteps, text, text_lens, image, token_timesteps
        )
        return self.head(self.run_blocks(x, inputs, attention), inputs)

    def frame(
        self,
        positions: torch.Tensor,  # (n, 3)
        seq_lens: torch.Tensor,  # (b,)
        timesteps: torch.Tensor,  # (b,)
        text_lens: torch.Tensor,  # (b,)
        image: torch.Tensor | None = None,  # (b, m, image_dim)
        token_timesteps: torch.Tensor | None = None,  # (n,)
    ) -> tuple[BlockInputs, torch.Tensor]:
        """The block inputs that carry no gradient, from the micro-batch alone (no weight is read,
        so every pipeline stage computes them itself), and the timesteps to embed: (u,), one per row
        of the modulation (u = b, or the distinct values of ``token_timesteps``)."""
        rows = None  # (n,) row of temb/modulation per token when timesteps are per token
        if token_timesteps is not None:
            if token_timesteps.shape != (positions.shape[0],):
                raise ValueError(
                    f"token_timesteps has shape {tuple(token_timesteps.shape)}, expected ({positions.shape[0]},): "
                    "one timestep per token held here"
                )
            # one embedding per distinct value (1-2 per clip), gathered per token in each block
            timesteps, rows = torch.unique(token_timesteps.float(), return_inverse=True)  # (u,), (n,)
        if self.config.text_pad_len is not None:  # Wan's zero-padded captions (see pad_text)
            text_lens = torch.full_like(text_lens, self.config.text_pad_len)
        image_cu_seqlens = None
        if image is not None and self.config.image_dim is not None:
            per_clip = self.config.pos_embed_seq_len or image.shape[1]
            image_cu_seqlens = cu_seqlens_from_lengths([per_clip] * seq_lens.shape[0])
        cu_seqlens, text_cu_seqlens = cu_seqlens_from_lengths(seq_lens), cu_seqlens_from_lengths(text_lens)
        inputs = BlockInputs(
            self.rope(positions), seq_lens, cu_seqlens, text_cu_seqlens, image_cu_seqlens, rows
        )
        return inputs, timesteps

    def embed(
        self,
        tokens: torch.Tensor,  # (n, p)
        positions: torch.Tensor,  # (n, 3)
        seq_lens: torch.Tensor,  # (b,)
        timesteps: torch.Tensor,  # (b,)
        text: torch.Tensor,  # (l, text_dim)
        text_lens: torch.Tensor,  # (b,)
        image: torch.Tensor | None = None,
        token_timesteps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, BlockInputs]:
        """The first block's input x (n, D) and every block's other inputs, embedded."""
        ce = self.condition_embedder
        inputs, timesteps = self.frame(positions, seq_lens, timesteps, text_lens, image, token_timesteps)
        t_freq = ce.timesteps_proj(timesteps.float())  # (u, freq_dim)
        temb = ce.time_embedder(t_freq.to(ce.time_embedder.linear_1.weight.dtype)).type_as(tokens)  # (u, D)
        inputs.temb = temb
        inputs.modulation = ce.time_proj(F.silu(temb)).unflatten(1, (6, -1))  # (u, 6, D)
        if self.config.text_pad_len is not None:  # Wan's zero-padded captions (see pad_text)
            text, _ = pad_text(text, text_lens, self.config.text_pad_len)  # (b*L, text_dim)
        inputs.context = ce.text_embedder(text.to(tokens.dtype))  # (l, D)
        inputs.image_context, _ = self.embed_image(image, seq_lens.shape[0], tokens.dtype)
        return self.patch_embedding(tokens), inputs  # (n, D)

    def run_blocks(
        self, x: torch.Tensor, inputs: BlockInputs, attention: AttentionFn, layers: range | None = None
    ) -> torch.Tensor:
        """x (n, D) through blocks ``layers`` (default: all of them) -> (n, D)."""
        for i in range(len(self.blocks)) if layers is None else layers:
            block = self.blocks[i]
            args = (x, inputs.context, inputs.modulation, inputs.rope, inputs.seq_lens, inputs.cu_seqlens)
            args += (inputs.text_cu_seqlens, attention, inputs.image_context, inputs.image_cu_seqlens)
            if (
                inputs.rows is not None
            ):  # absent otherwise: the block's call (and compiled graph) stays as it was
                args += (inputs.rows,)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = self.checkpoint_fn(block, *args)
            else:
                x = block(*args)
        return x

    def head(self, x: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """The last block's output (n, D) -> the predicted velocity (n, pt*ph*pw*c)."""
        shift, scale = (self.scale_shift_table + inputs.temb[:, None, :]).unbind(1)  # (b, D) each
        if inputs.rows is None:
            shift, scale = per_token(shift, inputs.seq_lens), per_token(scale, inputs.seq_lens)
        else:
            shift, scale = shift.index_select(0, inputs.rows), scale.index_select(0, inputs.rows)  # (n, D)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        return self.proj_out(x)

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
