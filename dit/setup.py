"""Build the model, text encoder, VAE and datasets that a config names."""

from __future__ import annotations

import torch

from data.types import ClipMeta
from dit.config import DataConfig
from dit.model import VideoDiT
from dit.model_config import ModelConfig
from dit.sizes import model_kwargs


def model_config_of(cfg: ModelConfig) -> dict:
    """The VideoDiT keyword arguments ``cfg`` builds, read without loading weights (a pretrained
    folder's config.json, else the size table with the overrides)."""
    if not cfg.pretrained:
        return model_kwargs(cfg.size, cfg.overrides)
    import json

    from dit.wan_import import OUR_CLASS, WAN_TEXT_LEN, videodit_config
    from dit.wan_pipeline_folders import pipeline_expand_timesteps, transformer_folder

    expert = "high" if cfg.expert == "both" else cfg.expert  # the two experts share their shapes
    config = json.loads((transformer_folder(cfg.pretrained, expert) / "config.json").read_text())
    if config.get("_class_name") == OUR_CLASS:
        config = {k: v for k, v in config.items() if not k.startswith("_")}
    else:
        config = videodit_config(config, WAN_TEXT_LEN, pipeline_expand_timesteps(cfg.pretrained))
    return {
        **config,
        "expand_timesteps": size_expands_timesteps(cfg) or config.get("expand_timesteps", False),
    }


def size_expands_timesteps(cfg: ModelConfig) -> bool:
    """A TI2V model.size marks a pretrained model as per-token (a bare transformer/ folder cannot say)."""
    from dit.sizes import MODEL_SIZES

    return bool(MODEL_SIZES.get(cfg.size, {}).get("expand_timesteps"))


def build_model(cfg: ModelConfig, boundary_ratio: float | None = None):
    """The VideoDiT ``cfg`` names; under model.expert=both an ``ExpertPair`` of two (high built
    first, so random ones differ), switching at ``boundary_ratio``."""
    if cfg.expert == "both":
        from dataclasses import replace

        from dit.experts import ExpertPair

        if cfg.pretrained:
            from dit.wan_pipeline_folders import is_two_expert, pipeline_index, transformer_folder

            transformer_folder(cfg.pretrained, "high")  # a folder that is not there says so first
            if not is_two_expert(pipeline_index(cfg.pretrained)):
                raise ValueError(
                    f"model.expert=both: {cfg.pretrained} holds one transformer, no transformer_2/ (Wan2.2 "
                    "A14B's low-noise expert); point model.pretrained at a Wan2.2 A14B pipeline folder or "
                    "a model.expert=both checkpoint's model/, or train one expert with model.expert=high|low"
                )
        high, low = (build_model(replace(cfg, expert=name)) for name in ("high", "low"))
        return ExpertPair(high, low, boundary_ratio)
    if cfg.pretrained and cfg.overrides:
        raise ValueError(
            f"model.overrides {sorted(cfg.overrides)} cannot change a pretrained model ({cfg.pretrained}); "
            "drop the overrides, or train from scratch without model.pretrained"
        )
    if cfg.pretrained:
        from dit.wan_import import load_pretrained

        model = load_pretrained(cfg.pretrained, expert=cfg.expert)
        check_same_task(cfg, model.config)
        if size_expands_timesteps(cfg):
            from dit.sizes import MODEL_SIZES

            want = MODEL_SIZES[cfg.size]["in_channels"]
            if model.config.in_channels != want:
                raise ValueError(
                    f"model.pretrained={cfg.pretrained} takes {model.config.in_channels} latent channels but "
                    f"model.size={cfg.size} is Wan2.2 TI2V ({want}, the Wan2.2 VAE's); point model.pretrained "
                    "at Wan2.2-TI2V-5B-Diffusers, or choose the model.size of that checkpoint"
                )
            model.register_to_config(expand_timesteps=True)
    else:
        model = VideoDiT(**model_kwargs(cfg.size, cfg.overrides))
    model.gradient_checkpointing = cfg.gradient_checkpointing
    return model


def expert_of(cfg: ModelConfig) -> tuple[str, float] | None:
    """(model.expert, its boundary_ratio) for a Wan2.2 A14B expert, else None. The ratio comes from
    model.boundary_ratio or the pipeline's model_index.json; a ValueError when neither has it or
    they disagree (training on a range the pipeline never runs the expert in)."""
    if cfg.expert is None:
        return None
    from dit.wan_pipeline_folders import pipeline_index

    folder = pipeline_index(cfg.pretrained).get("boundary_ratio") if cfg.pretrained else None
    if folder is not None and cfg.boundary_ratio is not None and folder != cfg.boundary_ratio:
        raise ValueError(
            f"model.boundary_ratio={cfg.boundary_ratio} but {cfg.pretrained}/model_index.json switches experts "
            f"at {folder}; drop model.boundary_ratio to train where the pipeline runs this expert"
        )
    ratio = cfg.boundary_ratio if cfg.boundary_ratio is not None else folder
    if ratio is None:
        raise ValueError(
            f"model.expert={cfg.expert} needs the experts' switch: set model.boundary_ratio (0.875 for Wan2.2 "
            "T2V-A14B, 0.9 for I2V-A14B) or point model.pretrained at the pipeline folder"
        )
    return cfg.expert, float(ratio)


def task_of(config) -> str:
    """'image-to-video' when the model takes image conditioning (extra input channels or CLIP tokens)."""
    conditioned = config.get("image_dim") is not None or config.get("out_channels") not in (
        None,
        config["in_channels"],
    )
    return "image-to-video" if conditioned else "text-to-video"


def check_same_task(cfg: ModelConfig, config) -> None:
    """ValueError when model.pretrained is a T2V checkpoint and model.size an I2V one, or the reverse."""
    from dit.sizes import MODEL_SIZES

    size = MODEL_SIZES.get(cfg.size)
    if size is not None and task_of(size) != task_of(config):
        raise ValueError(
            f"model.pretrained={cfg.pretrained} is a {task_of(config)} checkpoint (in_channels "
            f"{config['in_channels']}, image_dim {config.get('image_dim')}) but model.size={cfg.size} is "
            f"{task_of(size)}; point model.pretrained at a {task_of(size)} checkpoint or change model.size"
        )


def build_text_encoder(
    cfg: DataConfig, text_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
):
    from data.text_encoders import load_text_encoder

    encoder = load_text_encoder(
        cfg.text_encoder, cfg.text_encoder_path, cfg.text_max_length, device=str(device), dtype=dtype,
        hashed_dim=text_dim, seed=cfg.seed,
    )  # fmt: skip
    if encoder.dim != text_dim:
        raise ValueError(
            f"text encoder {cfg.text_encoder_path} gives {encoder.dim}-wide embeddings but the model expects "
            f"text_dim={text_dim}; use the encoder the model was trained with, or (from scratch) set "
            f"model.overrides.text_dim={encoder.dim}"
        )
    return encoder


def build_vae(cfg: DataConfig, device: torch.device | str = "cpu"):
    """None means pixel space: the clip itself is the model's input."""
    if cfg.vae == "identity":
        return None
    from data.vaes import load_vae

    return load_vae(cfg.vae, cfg.vae_path, device=str(device))


def vae_stride(cfg: DataConfig) -> tuple[int, int, int]:
    """The VAE's (t, h, w) stride: the user's data.options.vae_stride, else the kind's (pixel space
    1x1x1, Wan2.2's 4x16x16, 4x8x8 for Wan2.1, HunyuanVideo and CogVideoX)."""
    if "vae_stride" in cfg.options:
        return tuple(cfg.options["vae_stride"])
    from data.vaes import VAE_STRIDES

    return VAE_STRIDES.get(cfg.vae, (4, 8, 8))


def build_datasets(cfg: DataConfig, patch: tuple[int, int, int]):
    """-> train dataset, its training indices, validation dataset, its indices.

    Synthetic data draws held-out clips from another seed; a real dataset holds out its last
    ``num_val_clips`` items so the validation loss never sees a training clip.
    """
    if cfg.source == "synthetic":
        from data.build import SHAPE_OPTIONS
        from data.synthetic import SyntheticClips

        # data.options for synthetic data: 'colours' (the palette); vae_stride / patch are read elsewhere
        extra = sorted(set(cfg.options) - {"colours", *SHAPE_OPTIONS})
        if extra:
            raise ValueError(
                f"data.source=synthetic does not take data.options {extra}; it takes ['colours']"
            )
        kw = dict(
            frame_counts=tuple(cfg.frame_counts),
            resolutions=tuple(tuple(r) for r in cfg.resolutions),
            max_shapes=cfg.max_shapes,
            colours=cfg.options.get("colours"),
        )
        train = SyntheticClips(cfg.num_clips, seed=cfg.seed, **kw)
        val = SyntheticClips(cfg.num_val_clips, seed=cfg.seed + 10_000, **kw)
        return train, list(range(len(train))), val, list(range(len(val)))
    from data.build import build_dataset

    # The clip policy snaps shapes to multiples of VAE stride x patch; user options win.
    dataset = build_dataset(
        cfg.source,
        **{"vae_stride": vae_stride(cfg), "patch": tuple(patch), **cfg.options, "reader": cfg.reader},
    )
    if len(dataset) <= cfg.num_val_clips:
        raise ValueError(
            f"data.source {cfg.source} has {len(dataset)} usable clips, not more than data.num_val_clips="
            f"{cfg.num_val_clips}; add clips or lower data.num_val_clips"
        )
    split = len(dataset) - cfg.num_val_clips
    return dataset, list(range(split)), dataset, list(range(split, len(dataset)))


def clip_tokens(meta: ClipMeta, patch: tuple[int, int, int], stride: tuple[int, int, int]) -> int:
    """Tokens of a clip from its metadata: what the planner needs before any pixels are read."""
    from data.tokens import num_tokens

    return num_tokens(meta.num_frames, meta.height, meta.width, stride, patch)


def _cached_for(record: dict | None) -> str:
    """A latent cache's ``image_condition`` (or a model's wish for one) in words."""
    if record is None:
        return "a text-to-video model (no image conditioning)"
    frames = "first and last frames (FLF2V)" if record["frames"] == "first-last" else "first frame (I2V)"
    clip = f"{record['image_dim']}-wide CLIP tokens" if record["image_dim"] else "no CLIP tokens"
    return f"an image-to-video model: {frames}, {clip}"


def check_cache_fits(cfg: DataConfig, cache, conditioning, image_dim: int | None) -> None:
    """Refuse a latent cache made for another model, before any step: another VAE kind, or image-to-video
    conditioning (data/cache.py --image-condition, --image-encoder) that is not what the model trains
    on. ``conditioning`` is the model's (dit.image_cond.conditioning_of), ``image_dim`` its CLIP width."""
    if cache.vae_kind != cfg.vae:
        raise ValueError(
            f"data.source {cfg.source} was encoded with the {cache.vae_kind} VAE but data.vae={cfg.vae}: set "
            f"data.vae={cache.vae_kind}, or re-run python -m data.cache with --vae {cfg.vae}"
        )
    want = None
    if conditioning is not None:
        frames = "first-last" if conditioning.last_frame else "first"
        want = {"frames": frames, "image_dim": image_dim if conditioning.clip_tokens else None}
    have = cache.image_condition
    if have is not None:
        have = {k: have.get(k) for k in ("frames", "image_dim")}
    if have == want:
        return
    if want is None:
        fix = "without --image-condition and --image-encoder"
    else:
        fix = f"with --image-condition {want['frames']}"
        fix += (
            f" --image-encoder {cfg.image_encoder_path or 'CLIP_FOLDER'} (data.image_encoder_path)"
            if want["image_dim"]
            else " and no --image-encoder"
        )
    raise ValueError(
        f"data.source {cfg.source} was cached for {_cached_for(have)}, but this model is {_cached_for(want)}: "
        f"re-run python -m data.cache {fix} into a new --out (or train from the videos)"
    )
