"""Training configuration: dataclass defaults, then a YAML file, then ``a.b=value`` overrides.

Every field has a one-line docstring (the comment after it). Unknown keys and bad values raise a
ValueError that names the dotted field and says what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dit.model_config import ModelConfig

_READER_KEYS = ("data.reader", "data.options.backend")  # the key and its deprecated alias, for messages


@dataclass
class DataConfig:
    source: str = "synthetic"  # 'synthetic', a video folder, a .csv/.jsonl manifest, a latent cache, or pkg.module:Class
    num_clips: int = 2048  # synthetic only: clips in the dataset
    frame_counts: list = field(default_factory=lambda: [1, 5, 9])  # synthetic only: frame counts to draw from
    # synthetic only: (height, width) choices
    resolutions: list = field(default_factory=lambda: [[16, 16], [16, 24], [24, 16]])
    max_shapes: int = 2  # synthetic only: most moving shapes in one clip
    options: dict = field(default_factory=dict)  # clip-policy options for real sources (see docs/data.md)
    # video reader of data.scan, data.cache and training: 'auto' (the first that loads: torchcodec,
    # decord, PyAV; docs/data.md "Decode speed"), 'torchcodec', 'decord' or 'pyav'. One that is not
    # installed is refused when the dataset is built. data.options.backend is its deprecated alias
    reader: str = "auto"
    vae: str = "identity"  # 'identity' (pixel space), 'wan', 'wan2.2' (TI2V-5B), 'hunyuan' or 'cogvideox'
    vae_path: str | None = None  # local directory of the VAE weights
    text_encoder: str = "hashed"  # 'hashed' (built in), 't5' or 'umt5'
    text_encoder_path: str | None = None  # local directory of the text encoder
    # local CLIPVisionModel folder for Wan2.1 I2V/FLF2V (a pipeline folder with image_encoder/ works)
    image_encoder_path: str | None = None
    text_max_length: int = 512  # longest caption in text tokens
    caption_dropout: float = 0.1  # share of captions replaced by '' so guidance has an unconditional model
    num_workers: int = 0  # DataLoader worker processes
    num_val_clips: int = 16  # held-out clips for the validation loss
    seed: int = 0  # dataset seed (synthetic content, shuffling)

    def __post_init__(self):
        from data.readers import choose_reader

        if "backend" in self.options:  # built in Python with the deprecated alias: it fills a default reader
            self.options = dict(self.options)
            backend = self.options.pop("backend")
            self.reader = choose_reader(None if self.reader == "auto" else self.reader, backend, _READER_KEYS)
        self.reader = choose_reader(self.reader, None, _READER_KEYS)
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"data.caption_dropout={self.caption_dropout} must be in [0, 1)")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be >= 0")
        if self.num_val_clips < 1:
            raise ValueError(f"data.num_val_clips={self.num_val_clips} must be >= 1")


@dataclass
class FlowConfig:
    timestep_sampling: str = "logit_normal"  # 'logit_normal' or 'uniform'
    logit_mean: float = 0.0  # mean of the logit-normal sigma distribution
    logit_std: float = 1.0  # std of the logit-normal sigma distribution
    shift: float | None = None  # fixed sigma shift; None shifts each clip by its token count
    val_sigmas: list = field(
        default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9]
    )  # fixed sigmas of the val loss
    # share of clips trained image-to-video the Wan2.2 TI2V way: latent frame 0 clean at t = 0 and out of
    # the loss (dit/ti2v.py); 0 = text-to-video only. Needs a per-token model (model.size=wan2.2-ti2v-5b)
    clean_first_frame: float = 0.0

    def __post_init__(self):
        if self.timestep_sampling not in ("logit_normal", "uniform"):
            raise ValueError(
                f"flow.timestep_sampling={self.timestep_sampling!r}; use 'logit_normal' or 'uniform'"
            )
        if not 0.0 <= self.clean_first_frame <= 1.0:
            raise ValueError(
                f"flow.clean_first_frame={self.clean_first_frame} must be in [0, 1] (a share of the clips)"
            )
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"flow.shift={self.shift} must be positive (or null for the token-count shift)")


@dataclass
class TrainConfig:
    max_steps: int = 300  # optimizer steps
    global_batch_size: int = 8  # clips per optimizer step, over all ranks
    micro_batch_tokens: int = 4096  # token budget of one packed micro-batch on one rank
    lr: float = 3e-4  # peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list = field(default_factory=lambda: [0.9, 0.99])  # AdamW betas
    warmup_steps: int = 20  # steps of linear warm-up from 0 to train.lr, then train.lr_schedule
    lr_schedule: str = "constant"  # after warm-up: 'constant', or 'cosine'/'linear' decay to 0
    lr_decay_steps: int | None = None  # step at which cosine/linear reach 0; None = train.max_steps
    optimizer: str = "adamw"  # 'adamw', 'adamw_fused' or 'adamw_8bit' (bitsandbytes: pip .[quant])
    grad_clip: float = 1.0  # max gradient norm; 0 disables clipping
    ema_decay: float = 0.99  # EMA of the weights used for sampling; 0 disables it
    # 'auto' (bf16 autocast on CUDA, fp32 on CPU), 'bf16' (any device) or 'no'
    mixed_precision: str | bool = "auto"
    # Float8 matmuls in the blocks' linears (dit/fp8_train.py, torchao: pip .[fp8]); full training
    # on a GPU of compute capability 8.9+ (H100); fp32 master weights and optimizer states stay
    fp8: bool = False
    fp8_recipe: str = "tensorwise"  # train.fp8's scales: 'tensorwise' (fp8 FSDP all-gather) or 'rowwise'
    seed: int = 0  # seed of initialization, noise and timesteps
    log_every: int = 10  # steps between metric lines
    val_every: int = 50  # steps between validation losses
    checkpoint_every: int = 100  # steps between checkpoints
    keep_checkpoints: int = (
        2  # newest checkpoints kept on disk (below 2, a crash while saving can leave none)
    )
    # 'auto': resume the newest whole checkpoint of output_dir, or start fresh when there is none (the
    # setting for jobs that torchrun or SLURM restart); a path: resume that run or step directory;
    # null: a new run. train.py's --resume overrides it
    resume: str | None = None
    # write checkpoints in a background thread from a copy staged in CPU memory (replicated weights:
    # dit/async_checkpoint.py; FSDP: DCP's async_save, dynamic_cp/runtime/fsdp_checkpoint.py); training
    # blocks only for the copy. Costs host memory of one checkpoint; a failed background save stops
    # the run at the next step
    async_checkpoint: bool = False
    max_bad_steps: int = 20  # non-finite losses in a row before the run stops
    peak_tflops: float | None = None  # accelerator peak for the MFU figure (989 for H100 bf16); None = no MFU
    report_to: list = field(default_factory=lambda: ["jsonl"])  # any of 'jsonl', 'tensorboard', 'wandb'
    tracker_project: str = "dynamic-cp-video"  # wandb project (runs are named after output_dir)
    # steps between validation clips (mp4s + a PNG grid under <output_dir>/samples); 0 = off
    sample_every: int = 0
    sample_prompts: list = field(
        default_factory=list
    )  # prompts of the validation clips (fixed seed train.seed)
    sample_shape: list = field(default_factory=lambda: [9, 16, 16])  # frames, height, width of the clips
    sample_steps: int = 20  # Euler steps of the validation clips
    sample_guidance: float = 4.0  # classifier-free guidance of the validation clips

    def __post_init__(self):
        for name in ("max_steps", "global_batch_size", "micro_batch_tokens", "log_every", "val_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be a positive integer")
        if self.checkpoint_every <= 0 or self.keep_checkpoints <= 0:
            raise ValueError("train.checkpoint_every and train.keep_checkpoints must be positive")
        if self.lr <= 0:
            raise ValueError(f"train.lr={self.lr} must be positive")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"train.ema_decay={self.ema_decay} must be in [0, 1)")
        if self.mixed_precision is False:  # YAML 1.1 reads an unquoted `no` as false
            self.mixed_precision = "no"
        if self.mixed_precision not in ("auto", "bf16", "no"):
            raise ValueError(f"train.mixed_precision={self.mixed_precision!r}; use 'auto', 'bf16' or 'no'")
        from dit.fp8_train import check_fp8_settings

        check_fp8_settings(self.fp8, self.fp8_recipe)
        if len(self.betas) != 2:
            raise ValueError(f"train.betas={self.betas} must be two numbers")
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"train.lr_schedule={self.lr_schedule!r}; use 'constant', 'cosine' or 'linear'")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup_steps:
            raise ValueError(
                f"train.lr_decay_steps={self.lr_decay_steps} must be above train.warmup_steps="
                f"{self.warmup_steps} (or null for train.max_steps)"
            )
        if self.optimizer not in ("adamw", "adamw_fused", "adamw_8bit"):
            raise ValueError(
                f"train.optimizer={self.optimizer!r}; use 'adamw', 'adamw_fused' or 'adamw_8bit'"
            )
        unknown = [r for r in self.report_to if r not in ("jsonl", "tensorboard", "wandb")]
        if unknown:
            raise ValueError(
                f"train.report_to has {unknown[0]!r}; use a list of 'jsonl', 'tensorboard', 'wandb'"
            )
        if self.sample_every < 0:
            raise ValueError(f"train.sample_every={self.sample_every} must be >= 0 (0 turns samples off)")
        if self.sample_every and not self.sample_prompts:
            raise ValueError(
                f"train.sample_every={self.sample_every} needs train.sample_prompts, e.g. "
                "train.sample_prompts='[a red circle moving right on a black background]'"
            )
        if len(self.sample_shape) != 3 or self.sample_steps < 1:
            raise ValueError(
                f"train.sample_shape={self.sample_shape} must be [frames, height, width] and "
                f"train.sample_steps={self.sample_steps} >= 1"
            )


@dataclass
class ParallelConfig:
    mode: str = "none"  # 'none' (one process), 'static' (one CP size for all) or 'dynamic' (planned per step)
    cp_method: str = "auto"  # 'auto' (Ulysses when heads divide, else ring), 'ulysses' or 'ring'
    static_cp_size: int = 1  # CP size of static mode
    cp_sizes: list | None = None  # allowed CP sizes in dynamic mode; None = powers of two and the world
    cap_tokens: int | None = None  # most tokens one rank may hold; None = train.micro_batch_tokens
    # planner's starting hardware profile: 'auto' (CUDA: the built-in profile matching the device
    # name; CPU: a quick measurement at start-up; on --resume the run's learned_profile.yaml), a
    # built-in name (h100, h200, a100) or a yaml path
    hardware: str = "auto"
    learn_costs: bool = True  # refit the cost model online from measured micro-batches; false freezes it
    refit_every: int = 10  # steps between refits of the learned cost model
    explore_budget: float = 0.1  # most predicted step share one exploratory micro-batch may add (0: none)
    plan_ahead: bool = True  # plan step s+1 in a background thread while step s runs
    # plans from fixed prices only: no CPU measurement at start-up (hardware=auto takes the device's
    # built-in profile; on CPU h100's), no refits and no exploration, so any two runs and any resume
    # plan alike and end bitwise equal (on CPU; docs/faults.md says what the default, learned
    # costs, may differ by)
    deterministic: bool = False
    # ZeRO-1: each rank keeps the AdamW moments of its share of the parameters (torch's
    # ZeroRedundancyOptimizer) and sends its updated share to the others; weights, gradients and the
    # plan are unchanged, so this saves 8 bytes per parameter x (1 - 1/ranks) for one broadcast a step
    shard_optimizer: bool = True
    # FSDP2 sharding of weights, gradients and AdamW moments over all ranks (docs/runtime.md):
    # 'none' (replicated; shard_optimizer applies), 'per_step' (weights gathered once a step),
    # 'per_layer' (ZeRO-3, lockstep rounds) or 'auto' (the memory model picks; see
    # dynamic_cp.runtime.fsdp.resolve_fsdp_mode)
    fsdp: str = "auto"
    # memory per rank (GB) that parallel.fsdp=auto plans for; None = the device's own (CUDA: the
    # GPU's; CPU: the machine's RAM over the node's ranks). Lower it to leave headroom
    memory_gb: float | None = None
    # seconds a collective may wait before its rank stops with a line naming it (a hung or dead
    # rank); start-up, the first step, validation, samples and checkpoints get 3x (torchtitan's
    # 100 s / 300 s). On NCCL each rank then dumps its flight-recorder trace (docs/runtime.md)
    timeout_s: float = 100.0
    # pipeline stages (docs/runtime.md "Pipeline stages"): the world is pp_size x R ranks, the blocks
    # split into pp_size contiguous stages (embedders on the first, the head on the last), and every
    # stage runs the one Dynamic-CP plan of its R ranks
    pp_size: int = 1
    pp_layers: list | None = None  # blocks per stage, e.g. [21, 19]; None = balanced by the cost model
    pp_schedule: str = "1f1b"  # '1f1b' (one forward, one backward) or 'gpipe' (all forwards first)

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s={self.timeout_s} must be positive (seconds, e.g. 100)")
        if self.mode not in ("none", "static", "dynamic"):
            raise ValueError(f"parallel.mode={self.mode!r}; use 'none', 'static' or 'dynamic'")
        if self.fsdp not in ("none", "per_step", "per_layer", "auto"):
            raise ValueError(f"parallel.fsdp={self.fsdp!r}; use 'none', 'per_step', 'per_layer' or 'auto'")
        if self.mode == "none" and self.fsdp in ("per_step", "per_layer"):
            raise ValueError(
                f"parallel.fsdp={self.fsdp} shards over the ranks of the distributed runtime; set "
                "parallel.mode=static or dynamic and launch with torchrun (one rank is fine), or "
                "parallel.fsdp=none"
            )
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ValueError(
                f"parallel.memory_gb={self.memory_gb} must be positive (or null for the device's)"
            )
        if self.cp_method not in ("auto", "ulysses", "ring"):
            raise ValueError(f"parallel.cp_method={self.cp_method!r}; use 'auto', 'ulysses' or 'ring'")
        if self.static_cp_size < 1:
            raise ValueError(f"parallel.static_cp_size={self.static_cp_size} must be >= 1")
        if self.refit_every < 1:
            raise ValueError(f"parallel.refit_every={self.refit_every} must be >= 1 (steps between refits)")
        if not 0 <= self.explore_budget <= 1:
            raise ValueError(f"parallel.explore_budget={self.explore_budget} must be in [0, 1]")
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        if self.pp_size < 1:
            raise ValueError(f"parallel.pp_size={self.pp_size} must be >= 1 (1: no pipeline)")
        if self.pp_schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"parallel.pp_schedule={self.pp_schedule!r}; use '1f1b' or 'gpipe'")
        if self.pp_size > 1 and self.mode == "none":
            raise ValueError(
                f"parallel.pp_size={self.pp_size} runs stages on the ranks of the distributed runtime; "
                "set parallel.mode=static or dynamic and launch with torchrun"
            )
        if self.pp_layers is not None:
            if len(self.pp_layers) != self.pp_size or any(int(n) < 1 for n in self.pp_layers):
                raise ValueError(
                    f"parallel.pp_layers={self.pp_layers} must list pp_size={self.pp_size} block "
                    "counts of at least 1 each (or null to balance them by the cost model)"
                )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)  # the network
    data: DataConfig = field(default_factory=DataConfig)  # clips, captions, VAE and text encoder
    flow: FlowConfig = field(default_factory=FlowConfig)  # the rectified-flow objective
    train: TrainConfig = field(default_factory=TrainConfig)  # optimization, logging, checkpoints
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # context parallelism
    output_dir: str = "runs/tiny"  # checkpoints, metrics.jsonl and samples go here


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    """Return value converted to the annotated type, or raise a ValueError naming the field."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(value, option, where)
            except ValueError:
                pass
        raise ValueError(f"{where}={value!r} does not fit {annotation}")
    base = origin or annotation
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is float and isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if base in (list, tuple) and isinstance(value, (list, tuple)):
        return list(value)
    if base is list and isinstance(value, str):  # train.report_to=jsonl means [jsonl]
        return [value]
    if base in (int, float, str, bool, dict, list) and not isinstance(value, base):
        raise ValueError(f"{where}={value!r} must be of type {base.__name__}")
    if base is int and isinstance(value, bool):
        raise ValueError(f"{where}={value!r} must be an integer")
    return value


def from_dict(cls, data: dict, prefix: str = "", origin=lambda key: ""):
    """Build dataclass ``cls`` from nested dicts, rejecting unknown keys by their dotted name (with the
    nearest valid one, and ``origin(key)``: where a key came from, e.g. `` (in config file my.yaml)``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}{unknown[0]}"
        near = difflib.get_close_matches(unknown[0], list(fields), n=1)
        raise ValueError(
            f"unknown config key {key}{origin(key)}; valid keys here are: {', '.join(sorted(fields))}"
            + (f"; did you mean {prefix}{near[0]}?" if near else "")
        )
    if cls is DataConfig and isinstance(data.get("options"), dict) and "backend" in data["options"]:
        # the deprecated alias, resolved here where an explicit data.reader (even 'auto') is visible
        from data.readers import choose_reader

        options = dict(data["options"])
        reader = choose_reader(data.get("reader"), options.pop("backend"), _READER_KEYS)
        data = {**data, "reader": reader, "options": options}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        optional = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if optional and value is not None:  # an optional section such as model.lora
            hint = optional[0]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_dict(hint, value or {}, f"{prefix}{name}.", origin)
        else:
            try:
                kwargs[name] = _check_type(value, hint, f"{prefix}{name}")
            except ValueError as err:
                raise ValueError(f"{err}{origin(prefix + name)}") from None
    return cls(**kwargs)


def apply_override(data: dict, item: str) -> None:
    """Apply one ``a.b.c=value`` override to nested dict ``data``; the value is parsed as YAML."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.key=value, e.g. train.max_steps=200")
    key, raw = item.split("=", 1)
    node = data
    *parents, leaf = key.strip().split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {item!r}: {part} is not a section")
    node[leaf] = _yaml(raw, f"override {item!r}")


def _yaml(text: str, where: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:  # its message spans several lines: keep the problem and its place
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where} is not valid YAML{at}: {problem}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- overrides. Raises ValueError on unknown keys or bad values."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"config file {path} does not exist; pass --config configs/tiny.yaml or another file"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"config file {path} is not UTF-8 text ({err.reason} at byte {err.start})"
            ) from None
        data = _yaml(text, f"config file {path}") or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    for item in overrides:
        apply_override(data, item)
    overridden = {item.split("=", 1)[0].strip() for item in overrides}
    in_file = f" (in config file {path})" if path is not None else ""
    # a key the file set (not an override) is named with the file, so a typo there is found
    origin = lambda key: "" if any(key == k or key.startswith(k + ".") for k in overridden) else in_file  # noqa: E731
    return from_dict(Config, data, origin=origin)


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)
