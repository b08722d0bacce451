"""The transformer shape the cost and memory models need, and the built-in Wan sizes by name."""

from __future__ import annotations

from dataclasses import dataclass, fields

from dit.sizes import MODEL_SIZES


@dataclass(frozen=True)
class ModelDims:
    """Transformer shape the cost model needs."""

    d: int  # hidden size
    layers: int
    ffn: int  # FFN inner width
    heads: int
    text_tokens: int = 512  # cross-attention text context length
    image_tokens: int = 0  # image tokens per clip of an image-conditioned model (Wan I2V: 257, FLF2V: 514)
    # values per token into the patch embedding plus out of the output projection, pt*ph*pw*(in + out
    # channels): Wan2.1 T2V 4*(16+16) = 128, I2V 4*(36+16) = 208, Wan2.2 TI2V-5B 4*(48+48) = 384
    patch_values: int = 0

    def __post_init__(self):
        for f in fields(self):
            may_be_zero = f.name in ("text_tokens", "image_tokens", "patch_values")
            if int(getattr(self, f.name)) < 0 or (not may_be_zero and getattr(self, f.name) < 1):
                raise ValueError(f"model dimension {f.name}={getattr(self, f.name)} must be positive")

    @property
    def context_tokens(self) -> int:
        """Cross-attention keys per clip: text, then image (separate K/V, same cost per token)."""
        return self.text_tokens + self.image_tokens

    @property
    def num_params(self) -> int:
        # self-attn 4d^2 + cross-attn 4d^2 (+ image K/V 2d^2) + FFN 2df per block, plus the patch
        # embedding and output projection; text and time embeddings are left out (~2%).
        cross = 6 if self.image_tokens else 4
        blocks = self.layers * ((4 + cross) * self.d * self.d + 2 * self.d * self.ffn)
        return blocks + self.patch_values * self.d

    @classmethod
    def from_config(cls, config, text_tokens: int = 512) -> ModelDims:
        """Dims of a VideoDiT (or diffusers Wan) config: a mapping with ``num_attention_heads``,
        ``attention_head_dim``, ``num_layers`` and ``ffn_dim``, as in ``dit.sizes.MODEL_SIZES``; with
        ``image_dim`` set, the image tokens (``pos_embed_seq_len``, else one CLIP image's 257)."""
        heads = config["num_attention_heads"]
        patch = config.get("patch_size") or (1, 2, 2)
        in_channels = config.get("in_channels") or 16
        per_channel = patch[0] * patch[1] * patch[2]
        patch_values = per_channel * (in_channels + (config.get("out_channels") or in_channels))
        image_tokens = 0
        if config.get("image_dim") is not None:
            image_tokens = config.get("pos_embed_seq_len") or CLIP_IMAGE_TOKENS
        return cls(
            d=heads * config["attention_head_dim"],
            layers=config["num_layers"],
            ffn=config["ffn_dim"],
            heads=heads,
            text_tokens=text_tokens,
            image_tokens=image_tokens,
            patch_values=patch_values,
        )


CLIP_IMAGE_TOKENS = 257  # CLIP ViT-H/14 at 224 px: 16 x 16 patches + the class token (Wan2.1 I2V)

# Name -> dims registry, like DiT's size table. Wan2.1 sizes from its config files; Wan pads
# captions to 512 umT5 tokens.
MODELS: dict[str, ModelDims] = {
    name: ModelDims.from_config(MODEL_SIZES[name], text_tokens=512)
    for name in ("wan-1.3b", "wan-14b", "wan-i2v-14b", "wan-flf2v-14b", "wan2.2-ti2v-5b")
}
