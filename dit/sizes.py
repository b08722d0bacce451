"""Model sizes by name. Widths, depths and heads of the Wan sizes follow the published Wan2.1 configs."""

from __future__ import annotations

MODEL_SIZES: dict[str, dict] = {
    # Pixel-space model that trains on 2 CPU cores in minutes (configs/tiny.yaml).
    "tiny": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=32,
        in_channels=3,
        text_dim=64,
        freq_dim=64,
        ffn_dim=512,
        num_layers=4,
    ),
    # Latent-space model for quick GPU experiments with a 16-channel video VAE.
    "small": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=64,
        in_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=2048,
        num_layers=12,
    ),
    "wan-1.3b": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
    ),
    "wan-14b": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=40,
        attention_head_dim=128,
        in_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=13824,
        num_layers=40,
    ),
}
# Wan2.1 image-to-video (480P and 720P share one config): T2V-14B plus 16 noisy + 4 mask + 16 image-latent
# input channels and CLIP ViT-H/14 image tokens (1280 wide) through added K/V in every cross-attention.
MODEL_SIZES["wan-i2v-14b"] = dict(
    MODEL_SIZES["wan-14b"], in_channels=36, out_channels=16, image_dim=1280, added_kv_proj_dim=5120
)
# Wan2.1 first-last-frame-to-video: as I2V, with two images (2 x 257 tokens) and a learned position table.
MODEL_SIZES["wan-flf2v-14b"] = dict(MODEL_SIZES["wan-i2v-14b"], pos_embed_seq_len=514)


def model_kwargs(size: str, overrides: dict | None = None) -> dict:
    """VideoDiT keyword arguments of a named size with ``overrides`` applied."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model size {size!r} is unknown; choose one of {sorted(MODEL_SIZES)}")
    kwargs = dict(MODEL_SIZES[size])
    import inspect

    from dit.model import VideoDiT

    valid = set(inspect.signature(VideoDiT.__init__).parameters) - {"self"}
    for key, value in (overrides or {}).items():
        if key not in valid:
            raise ValueError(
                f"model.overrides.{key} is not a VideoDiT field; valid: {', '.join(sorted(valid))}"
            )
        kwargs[key] = tuple(value) if key == "patch_size" else value
    return kwargs


# Wan2.2 TI2V-5B: text- and image-to-video in one model on the Wan2.2 VAE's 48 latent channels (16x
# spatial, so one token covers 4 x 32 x 32 pixels); image-to-video gives the first latent frame t = 0.
MODEL_SIZES["wan2.2-ti2v-5b"] = dict(
    MODEL_SIZES["wan-1.3b"],
    num_attention_heads=24,
    in_channels=48,
    out_channels=48,
    ffn_dim=14336,
    expand_timesteps=True,
)
# Wan2.2 A14B: two experts (high and low noise) of Wan2.1-T2V-14B's shape. I2V-A14B takes the 36
# input channels of Wan2.1 I2V (noisy + mask + image latent) but no CLIP image tokens.
MODEL_SIZES["wan2.2-t2v-a14b"] = dict(MODEL_SIZES["wan-14b"])
MODEL_SIZES["wan2.2-i2v-a14b"] = dict(MODEL_SIZES["wan-14b"], in_channels=36, out_channels=16)
