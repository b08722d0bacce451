"""What a training run builds before its first step, and the option checks that guard it.

``Trainer.__init__`` (dit/trainer.py) calls these in order: ``check_train_options`` (combinations
that cannot run, each refused with the fix), ``validation_sigmas``, ``build_train_model`` (the VideoDiT or A14B's pair,
LoRA adapters on a frozen base) and ``build_train_data`` (datasets, the clip encoder, and the checks
that the data fits the model: text- or image-to-video, TI2V, a latent cache made for another model).
"""

from __future__ import annotations

import torch

from data.cache_dataset import LatentCacheDataset
from data.image_encoders import load_image_encoder
from dit.block_offload import models_of
from dit.clips import ClipEncoder
from dit.config import Config
from dit.image_cond import conditioning_of
from dit.setup import build_datasets, build_model, build_text_encoder, build_vae, check_cache_fits, vae_stride
from dit.ti2v import check_ti2v_data


def check_train_options(cfg: Config, expert: tuple[str, float] | None, device: torch.device) -> None:
    """ValueError naming the fix for option combinations training does not run (on ``device``)."""
    from dit.fp8_train import check_fp8_runs

    check_fp8_runs(cfg.train.fp8, cfg.model.lora is not None, device)
    check_lora_base(cfg.model)
    if cfg.model.offload != "none" and not cfg.model.gradient_checkpointing:
        raise ValueError(
            f"model.offload={cfg.model.offload} trains by bringing each block back for its recompute in "
            "backward; set model.gradient_checkpointing=true (or model.offload=none)"
        )
    sample_every = cfg.train.sample_every
    if expert and expert[0] == "both" and sample_every:
        raise ValueError(
            f"train.sample_every={sample_every} with model.expert=both: validation clips of two "
            "experts are not supported yet; set train.sample_every=0 and sample the checkpoint's model/ "
            "with sample.py --pretrained"
        )
    if expert and sample_every:
        raise ValueError(
            f"train.sample_every={sample_every} with model.expert={expert[0]}: validation "
            "clips would run this one expert at every step; set train.sample_every=0 and sample both "
            "experts with sample.py --pretrained"
        )
    if expert and expert[0] == "both" and cfg.model.idle_expert == "cpu" and cfg.model.compile:
        raise ValueError(
            "model.idle_expert=cpu with model.compile: a compiled expert's weights cannot move to the "
            "host between its steps; set model.compile=false, or model.idle_expert=sharded"
        )


def check_lora_base(model_cfg) -> None:
    """Refuse LoRA on the seeded init: adaLN-zero zeroes the output layer (and every block's gates), so
    the output does not depend on the blocks and every adapter's gradient is exactly zero. A LoRA
    checkpoint holds adapters alone (its base is model.pretrained again on resume), and model.lora_init
    adds adapters to the same zero base, so neither helps; ``model.overrides={adaln_zero_init: false}``
    (a random base whose gradients flow, as benchmarks use) is let through."""
    from dit.sizes import model_kwargs

    if model_cfg.lora is None or model_cfg.pretrained:
        return
    if model_kwargs(model_cfg.size, model_cfg.overrides).get("adaln_zero_init", True):
        raise ValueError(
            "model.lora without model.pretrained: LoRA on an untrained base gets zero gradients (its "
            "adaLN-zero output layer is zero) and trains nothing; set model.pretrained=PATH to a diffusers "
            "Wan folder or a full run's checkpoint model/, or drop model.lora to train every weight"
        )


def warn_on_few_checkpoints(cfg: Config) -> None:
    if cfg.train.keep_checkpoints < 2:
        print(
            f"warning: train.keep_checkpoints={cfg.train.keep_checkpoints}: a crash while saving can "
            "leave no whole checkpoint to resume; keep 2 or more"
        )


def validation_sigmas(sigmas, expert: tuple[str, float] | None) -> list[float]:
    """flow.val_sigmas, less those on the other expert's side of the switch (an expert is never run
    there, so its loss there says nothing); under model.expert=both each sigma's own expert answers."""
    sigmas = list(sigmas)
    if expert is None or expert[0] == "both":
        return sigmas
    from dit.flow import model_timesteps, on_expert_side

    kept = [s for s, ok in zip(sigmas, on_expert_side(model_timesteps(sigmas), *expert)) if ok]
    if not kept:
        name, ratio = expert
        raise ValueError(
            f"flow.val_sigmas={sigmas} has no sigma on the {name} expert's side of {ratio}; add one, e.g. "
            f"flow.val_sigmas=[{(1 + ratio) / 2 if name == 'high' else ratio / 2:.3g}]"
        )
    return kept


def build_train_model(
    cfg: Config, expert: tuple[str, float] | None, compute_dtype: torch.dtype, sharded: bool = False
):
    """The model to train, on the CPU, from ``train.seed``: a VideoDiT, or under model.expert=both an
    ExpertPair; with model.lora a frozen base in ``compute_dtype`` and fp32 adapters, the only
    trainable parameters."""
    both = bool(expert) and expert[0] == "both"
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, expert[1] if both else None)
    if cfg.train.fp8:  # the blocks' linears (dit/fp8_train.py); fp8 all-gather when FSDP2 shards them
        from dit.fp8_train import convert_to_fp8

        convert_to_fp8(model, cfg.train.fp8_recipe, fsdp_all_gather=sharded)
    if cfg.model.lora is None:
        return model
    from dit.fp8_base import base_storage_dtype, store_base_in_fp8
    from dit.lora import setup_lora

    # cast before the move: a 14B base reaches the GPU as 28 GB of bf16, never as 57 GB of fp32
    base = cfg.model.base_dtype
    frozen = base_storage_dtype(base, compute_dtype)
    if not both:
        setup_lora(model, cfg.model.lora, cfg.model.lora_init, frozen)
    elif cfg.model.lora_init is not None:  # one adapter per expert, each saved as its own diffusers file
        raise ValueError(
            f"model.lora_init={cfg.model.lora_init} with model.expert=both: one file cannot start "
            "both experts' adapters; drop model.lora_init, or train one expert (model.expert=high|low)"
        )
    else:
        for one in (model.high, model.low):
            setup_lora(one, cfg.model.lora, None, frozen)
    if base.startswith("fp8"):  # quantised once, here, from the loaded (or fresh) base
        store_base_in_fp8(model, per_row=base == "fp8_scaled", compute_dtype=compute_dtype)
    return model


def blocks_to_offload(cfg: Config, model) -> int:
    """``model.offload_blocks`` as a number. The distributed launcher turns ``auto`` into the fewest
    blocks that fit (``dynamic_cp.runtime.launch.resolve_auto_offload``, from the memory model); a
    single-process run, which has no memory model, offloads every block under ``auto``."""
    if cfg.model.offload == "none":
        return 0
    layers = len(models_of(model)[0].blocks)
    return layers if cfg.model.offload_blocks == "auto" else cfg.model.offload_blocks


def build_train_data(cfg: Config, model_config, device: torch.device):
    """-> (train set, train indices, val set, val indices, ClipEncoder) for a model of
    ``model_config``; ValueError when the data cannot train it."""
    patch = tuple(model_config.patch_size)
    train_set, train_indices, val_set, val_indices = build_datasets(cfg.data, patch)
    encoder = ClipEncoder(
        lambda: build_vae(cfg.data, device),
        lambda: build_text_encoder(cfg.data, model_config.text_dim, device),
        device,
        empty_text=getattr(train_set, "empty_text_emb", None),
        build_image_encoder=lambda: load_image_encoder(cfg.data.image_encoder_path, str(device)),
    )
    # a latent cache says its channels; otherwise the VAE (built here, as training will need it) does
    cached_channels = getattr(train_set, "latent_channels", None)
    channels = cached_channels
    if channels is None:
        channels = 3 if encoder.vae is None else encoder.vae.latent_channels
    check_ti2v_data(model_config, channels, cfg.flow.clean_first_frame, cached_channels is not None)
    # text-to-video, or image-to-video (mask + image latent as extra input channels); else a ValueError
    encoder.conditioning = conditioning_of(model_config, channels, vae_stride(cfg.data)[0])
    if encoder.conditioning and cfg.train.sample_every:
        raise ValueError(
            f"train.sample_every={cfg.train.sample_every}: validation clips of an image-to-video model are "
            "not supported yet; set train.sample_every=0 and sample with sample.py --image PATH"
        )
    if isinstance(train_set, LatentCacheDataset):  # one made for another model is refused here
        check_cache_fits(cfg.data, train_set, encoder.conditioning, model_config.image_dim)
    if encoder.conditioning and encoder.conditioning.clip_tokens and cached_channels is None:
        _ = encoder.image_encoder  # built now (training needs it): a bad path fails here, not at step 1
    return train_set, train_indices, val_set, val_indices, encoder
