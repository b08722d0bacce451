"""What ``sample.py`` samples with: model, text encoder, VAE and default shift, from a training run
(``--checkpoint``) or a diffusers-format Wan folder (``--pretrained``: ``transformer/``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``scheduler/``, as the Wan-AI ``*-Diffusers`` repositories are
laid out).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Sampler:
    model: torch.nn.Module
    text_encoder: object
    vae: object | None  # None: the model works in pixels
    shift: float | None  # the default sigma shift; None: by token count
    out_dir: Path  # where clips go unless --out says otherwise
    source: str  # what the weights are, for the output files' keys
    image_encoder: object | None = None  # CLIP image tokens: image-to-video models with image_dim
    base_dtype: str = "precision"  # --base-dtype as applied: fp8_e4m3, fp8_scaled, or the DiT's dtype
    offloaders: list = field(default_factory=list)  # --offload: one BlockOffloader per VideoDiT
    idle_host: object | None = None  # --idle-expert cpu: the IdleExpertHost of a two-expert model

    @property
    def offload_blocks(self) -> int:
        """Blocks of each VideoDiT whose weights wait in host memory (--offload)."""
        return len(self.offloaders[0].swapped) if self.offloaders else 0


LOWMEM_DEFAULTS = ("auto", "auto", None, "auto")  # --base-dtype, --offload, --offload-blocks, --idle-expert


def resolve_lowmem(
    model_cfg, base_dtype: str, offload: str, idle_expert: str = "auto"
) -> tuple[str, str, str]:
    """``--base-dtype``, ``--offload`` and ``--idle-expert`` ``auto`` -> what the run trained with
    (``model_cfg``: its ``model.base_dtype``, fp8 or not, ``model.offload``, blocks or not, and
    ``model.idle_expert``, cpu or not, under ``model.expert=both``), or for a ``--pretrained`` folder
    (``model_cfg`` None) the DiT's own dtype, no offload and both experts on the device."""
    if base_dtype == "auto":
        run = "auto" if model_cfg is None else model_cfg.base_dtype
        base_dtype = run if run.startswith("fp8") else "precision"
    if offload == "auto":
        offload = "none" if model_cfg is None or model_cfg.offload == "none" else "blocks"
    if idle_expert == "auto":
        trained = model_cfg is not None and model_cfg.expert == "both" and model_cfg.idle_expert == "cpu"
        idle_expert = "cpu" if trained else "device"
    return base_dtype, offload, idle_expert


def idle_expert_for_sampling(model, idle_expert: str, device):
    """``--idle-expert cpu`` on a sampling model still on the CPU: an ``IdleExpertHost`` that keeps
    the expert not running in host memory (the low one there from the start, so the device never
    holds both), as musubi-tuner's ``--offload_inactive_dit``; None with ``device``. Sampling is
    forward-only, so each expert's pre-hook sends the other away (``dit/expert_offload.py``), and a
    request moves each expert in once: its high-noise steps come first, then its low-noise ones."""
    if idle_expert == "device":
        return None
    if getattr(model, "boundary_ratio", None) is None:
        raise ValueError(
            "--idle-expert cpu: this model has one transformer, no idle expert to move; it applies to a "
            "two-expert (Wan2.2 A14B) model; drop it, or use --offload blocks"
        )
    from dit.expert_offload import IdleExpertHost

    host = IdleExpertHost(model, None, device)
    host.offload("low")
    return host


def store_for_sampling(model, base_dtype: str, offload: str, offload_blocks: int | None, device, dtype):
    """``--base-dtype`` and ``--offload`` on a sampling model still on the CPU, in ``dtype``
    (``sampling_weights``) -> its BlockOffloaders ([] without offload). The blocks' linears are
    quantised after any LoRA is merged (the weights sampled are one fp8 matrix each, as musubi-tuner
    merges before its fp8 optimisation); ``--lora``'s unmerged adapters keep ``dtype``."""
    from dit.block_offload import BlockOffloader, models_of
    from dit.fp8_base import store_base_in_fp8

    if base_dtype.startswith("fp8"):
        for name, p in model.named_parameters():  # store_base_in_fp8 converts the frozen linears only
            p.requires_grad_(".lora_" in name)
        store_base_in_fp8(model, per_row=base_dtype == "fp8_scaled", compute_dtype=dtype)
    if offload == "none":
        return []
    dits = models_of(model)
    layers = len(dits[0].blocks)
    count = layers if offload_blocks is None else offload_blocks
    if not 0 <= count <= layers:
        raise ValueError(f"--offload-blocks {count}: the model has {layers} blocks; use 0 to {layers}")
    # sampling recomputes nothing: each block's weights go back to the host after its forward
    return [BlockOffloader(dit.blocks, device, count, lambda: False) for dit in dits]


def place_for_sampling(model, model_cfg, lowmem: tuple, device, model_device, dtype):
    """``lowmem`` (--base-dtype, --offload, --offload-blocks, --idle-expert; ``auto`` resolved
    against ``model_cfg``, ``resolve_lowmem``) applied to a sampling model still on the CPU, which
    then moves to ``model_device`` (default ``device``) -> (the model, the base dtype applied, its
    BlockOffloaders, its IdleExpertHost or None). The fp8 storage and the offloads are set up before
    the move, so the device never holds what waits on the host."""
    base_dtype, offload, offload_blocks, idle_expert = lowmem
    base_dtype, offload, idle_expert = resolve_lowmem(model_cfg, base_dtype, offload, idle_expert)
    offloaders = store_for_sampling(model, base_dtype, offload, offload_blocks, device, dtype)
    idle_host = idle_expert_for_sampling(model, idle_expert, device)
    return model.to(model_device or device).eval(), base_dtype, offloaders, idle_host


def load_checkpoint_sampler(
    checkpoint: str,
    weights_kind: str,
    lora: str | None,
    lora_scale: float,
    device,
    model_device=None,
    dtype: torch.dtype = torch.float32,
    lowmem: tuple = ("precision", "none", None, "device"),
) -> Sampler:
    """``model_device``: where the DiT goes (default ``device``; the CPU when it is sharded next).
    ``dtype``: the DiT's weights (``sampling_weights``) and the text encoder's; the VAE stays fp32.
    ``lowmem``: --base-dtype, --offload, --offload-blocks (None: all) and --idle-expert, ``auto``
    as the run trained (``place_for_sampling``)."""
    import yaml

    from dit.checkpoint import resolve_checkpoint
    from dit.config import Config, from_dict
    from dit.setup import build_text_encoder, build_vae

    step_dir = resolve_checkpoint(checkpoint)
    cfg = from_dict(Config, yaml.safe_load((step_dir / "config.yaml").read_text()))
    quiet = os.environ.get("RANK", "0") != "0"  # under torchrun one rank says which weights
    weights_kind = choose_weights(
        step_dir, cfg.train.ema_decay, weights_kind, (lambda _: None) if quiet else print
    )
    weights = step_dir / weights_kind
    if not weights.is_dir():
        raise ValueError(
            f"{weights} does not exist; this checkpoint has no {weights_kind} weights, try --weights model"
        )
    model = load_sampling_model(cfg, weights, lora, lora_scale)
    model = sampling_weights(with_other_expert(cfg, model), dtype)
    model, base_dtype, offloaders, idle_host = place_for_sampling(
        model, cfg.model, lowmem, device, model_device, dtype
    )
    text_encoder = build_text_encoder(cfg.data, model.config.text_dim, device, dtype)
    vae = build_vae(cfg.data, device)
    image_encoder = None
    if model.config.get("image_dim") is not None:
        from data.image_encoders import load_image_encoder

        image_encoder = load_image_encoder(cfg.data.image_encoder_path, str(device))
    return Sampler(
        model,
        text_encoder,
        vae,
        cfg.flow.shift,
        step_dir.parent.parent / "samples",
        str(weights.resolve()),
        image_encoder,
        base_dtype,
        offloaders,
        idle_host,
    )


def choose_weights(step_dir: Path, decay: float, kind: str, report=print) -> str:
    """``--weights``: ``auto`` takes the EMA once it shows what was learned, else the trained weights
    (``model/``) with one line saying why; ``ema`` while it is young says so too (``ema_not_ready``)."""
    import re

    from dit.ema import ema_not_ready

    step = re.fullmatch(r"step_(\d+)", step_dir.name)
    why = ema_not_ready(decay, int(step[1])) if step and (step_dir / "ema").is_dir() else None
    if kind == "auto":
        kind = "ema" if (step_dir / "ema").is_dir() and why is None else "model"
        if why:
            report(f"sampling model/ (the trained weights), not the EMA: {why}; --weights ema to sample it")
    elif kind == "ema" and why:
        report(f"note: {why}, so its clips look like the start's; --weights model samples what was learned")
    return kind


def load_sampling_model(cfg, weights: Path, lora: str | None, lora_scale: float):
    """A checkpoint's weights (a LoRA run's: its base + the saved adapter), then ``lora`` on top."""
    from dit import lora as lora_lib
    from dit.model import VideoDiT
    from dit.setup import build_model

    if cfg.model.expert == "both":  # two experts: transformer/ and transformer_2/ of ``weights``
        return load_both_experts(cfg, weights, lora, lora_scale)
    if (weights / lora_lib.WEIGHT_NAME).is_file():  # a LoRA run saved only its adapter
        torch.manual_seed(cfg.train.seed)  # a base without model.pretrained is the run's seeded init
        model = build_model(cfg.model)  # the base it trained on
        lora_lib.load_lora(model, weights, adapter_name="trained")
        lora_lib.merge_lora(model)  # folded in, so that --lora below is the only adapter
    else:
        model = VideoDiT.from_pretrained(weights)
    add_lora(model, lora, lora_scale)
    return model


def load_both_experts(cfg, weights: Path, lora: str | None, lora_scale: float):
    """A model.expert=both checkpoint as one ExpertPair: its two experts' weights (a LoRA run's: each
    expert's base with its own adapter merged). ``--lora`` is refused: a file holds one expert's."""
    from dit import lora as lora_lib
    from dit.experts import ExpertPair
    from dit.setup import build_model, expert_of
    from dit.wan_import import load_pretrained
    from dit.wan_pipeline_folders import EXPERT_FOLDERS

    if lora is not None:
        raise ValueError(
            f"--lora {lora} with a model.expert=both checkpoint: a LoRA file holds one expert's adapter; merge "
            "it into that expert's folder (python -m dit.lora merge) and sample with --pretrained"
        )
    ratio = expert_of(cfg.model)[1]
    if not (weights / "transformer" / lora_lib.WEIGHT_NAME).is_file():
        return ExpertPair(
            load_pretrained(weights, expert="high"), load_pretrained(weights, expert="low"), ratio
        )
    torch.manual_seed(cfg.train.seed)  # a base without model.pretrained is the run's seeded init
    pair = build_model(cfg.model, ratio)  # the bases it trained on
    for name, folder in EXPERT_FOLDERS.items():
        expert = getattr(pair, name)
        lora_lib.load_lora(expert, weights / folder, adapter_name="trained")
        lora_lib.merge_lora(expert)
    return pair


def with_other_expert(cfg, model):
    """A run that trained one Wan2.2 A14B expert (``model.expert``) of a two-expert ``model.pretrained``
    folder samples with that folder's other expert beside it (``dit.experts.ExpertPair``, switching at
    the run's boundary); any other run's model is returned as it is."""
    from dit.setup import expert_of
    from dit.wan_import import load_pretrained
    from dit.wan_pipeline_folders import is_two_expert, pipeline_index

    expert = expert_of(cfg.model)
    if expert is None or expert[0] == "both" or not cfg.model.pretrained:
        return model  # model.expert=both: the checkpoint holds both experts already
    if not is_two_expert(pipeline_index(cfg.model.pretrained)):
        return model
    from dit.experts import ExpertPair

    name, ratio = expert
    other = load_pretrained(cfg.model.pretrained, expert="low" if name == "high" else "high")
    return ExpertPair(model, other, ratio) if name == "high" else ExpertPair(other, model, ratio)


def add_lora(model, lora: str | None, lora_scale: float) -> None:
    if lora is not None:
        from dit import lora as lora_lib

        lora_lib.load_lora(model, lora)
        lora_lib.set_lora_scale(model, lora_scale)


def sampling_weights(model, dtype: torch.dtype):
    """Every DiT parameter (adapters and the norms, time embedding and modulation diffusers keeps in
    fp32 included) in ``dtype``: sharded sampling needs one dtype (FSDP2 gathers a unit in one, as
    Wan's own ``--dit_fsdp`` and training's FSDP on GPUs gather every weight in bf16), and replicated
    sampling uses the same numbers, so N ranks give what one gives whichever way the weights go."""
    from dit.model import cast_weights

    return cast_weights(model, dtype, keep_fp32=False)


def pretrained_shift(folder: Path) -> float | None:
    """The ``flow_shift`` (or ``shift``) of the folder's scheduler config; None when it has none."""
    config = folder / "scheduler" / "scheduler_config.json"
    if not config.is_file():
        return None
    raw = json.loads(config.read_text())
    value = raw.get("flow_shift", raw.get("shift"))
    return None if value is None else float(value)


def load_pretrained_sampler(
    folder: str,
    lora: str | None,
    lora_scale: float,
    device,
    text_max_length: int = 512,
    model_device=None,
    dtype: torch.dtype = torch.float32,
    lowmem: tuple = ("precision", "none", None, "device"),
) -> Sampler:
    """A Wan pipeline folder (text-to-video, image-to-video or first-last-frame): its transformer
    (``dit/wan_import.py``; a Wan2.2 A14B folder's two experts as one ``dit.experts.ExpertPair``), its
    UMT5 text encoder and tokenizer (``data/text_encoders.py``), its Wan VAE (``data/vaes.py``) and, when the transformer has ``image_dim``, its CLIP ``image_encoder/``
    and ``image_processor/`` (``data/image_encoders.py``). ``model_device``: where the DiT goes
    (default ``device``; the CPU when it is sharded next). ``dtype``: the DiT's and the text encoder's
    weights (``sampling_weights``); the VAE and image encoder stay fp32, as diffusers' Wan examples
    load them. ``lowmem``: as ``load_checkpoint_sampler``'s (``auto``: the DiT's dtype, no offload)."""
    from data.text_encoders import load_text_encoder
    from data.vaes import load_vae, wan_vae_kind
    from dit.sample_conditioning import data_channels
    from dit.wan_import import load_pretrained
    from dit.wan_pipeline_folders import is_two_expert, pipeline_index

    path = Path(folder)
    if not path.is_dir():
        raise ValueError(
            f"--pretrained {folder} is not a folder; pass a diffusers Wan folder such as Wan2.1-T2V-1.3B-Diffusers"
        )
    missing = [p for p in ("transformer", "vae", "text_encoder", "tokenizer") if not (path / p).is_dir()]
    if missing:
        raise ValueError(
            f"--pretrained {folder} lacks {', '.join(p + '/' for p in missing)}; pass a whole diffusers Wan "
            "pipeline folder (transformer/, vae/, text_encoder/, tokenizer/), or a training run with --checkpoint"
        )
    index = pipeline_index(path)
    if is_two_expert(index) and index.get("boundary_ratio") is not None:
        # Wan2.2 A14B: transformer/ above the switch, transformer_2/ below (dit/experts.py)
        from dit.experts import ExpertPair

        if lora is not None:
            raise ValueError(
                f"--lora on {folder}, a two-expert (Wan2.2 A14B) folder, is not supported yet: each expert takes "
                "its own LoRA; merge it into that expert's transformer folder first"
            )
        high, low = (load_pretrained(path, dtype, expert=e) for e in ("high", "low"))
        model = ExpertPair(high, low, index["boundary_ratio"])
    else:  # diffusers runs transformer/ alone when a pipeline has no boundary_ratio
        model = load_pretrained(path, dtype, expert="high" if is_two_expert(index) else None)
        add_lora(model, lora, lora_scale)
    model = sampling_weights(model, dtype)
    model, base_dtype, offloaders, idle_host = place_for_sampling(
        model, None, lowmem, device, model_device, dtype
    )
    text_encoder = load_text_encoder(
        "umt5", path, max_length=text_max_length, device=str(device), dtype=dtype
    )
    if text_encoder.dim != model.config.text_dim:
        raise ValueError(
            f"{path / 'text_encoder'} gives {text_encoder.dim}-wide embeddings but {path / 'transformer'} "
            f"expects text_dim={model.config.text_dim}; the folder mixes parts of different models"
        )
    vae = load_vae(wan_vae_kind(path / "vae"), path / "vae", device=str(device))
    channels = data_channels(model)
    if vae.latent_channels != channels:
        raise ValueError(
            f"{path / 'vae'} makes {vae.latent_channels}-channel latents but {path / 'transformer'} denoises "
            f"{channels}; the folder mixes parts of different models"
        )
    image_encoder = None
    if model.config.get("image_dim") is not None:
        from data.image_encoders import load_image_encoder

        if not (path / "image_encoder").is_dir():
            raise ValueError(
                f"--pretrained {folder}: the transformer takes CLIP image tokens (image_dim) but the folder has "
                "no image_encoder/; pass the whole Wan I2V/FLF2V diffusers folder"
            )
        image_encoder = load_image_encoder(path, str(device))  # its image_encoder/ and image_processor/
    return Sampler(
        model, text_encoder, vae, pretrained_shift(path), Path("samples"), str(path.resolve()), image_encoder,
        base_dtype, offloaders, idle_host,
    )  # fmt: skip
