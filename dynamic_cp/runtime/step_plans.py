"""The plan function the runtime calls every step: Dynamic-CP planner or static CP, from the config.

Both return a ``Plan`` whose ``predicted_step_s`` is the simulator's critical path under the same
cost model, so predicted times of the two modes are comparable with each other and with the
measured ones in the logs.
"""

from __future__ import annotations

from collections.abc import Callable

from dit.config import Config
from dynamic_cp.planning.baselines import static_plan
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import default_cp_sizes, normalize_cp_sizes
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.model_dims import ModelDims
from dynamic_cp.planning.pipeline_order import plan_for_pipeline
from dynamic_cp.planning.pipeline_sim import default_stage_layers
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.rounds_planner import plan_for_mode

# The built-in hashed text encoder keeps at most this many words; real encoders pad or cut captions
# to data.text_max_length tokens.
HASHED_TEXT_TOKENS = 64


def cp_sizes_of(cfg: Config, world_size: int) -> tuple[int, ...]:
    """Allowed CP sizes of this run: static mode uses exactly one."""
    p = cfg.parallel
    if p.mode == "static":
        c = p.static_cp_size
        if c > world_size or world_size % c:
            raise ValueError(
                f"parallel.static_cp_size={c} must divide the number of ranks ({world_size}); "
                f"use one of {[d for d in default_cp_sizes(world_size) if world_size % d == 0]}"
            )
        return normalize_cp_sizes(world_size, [c])
    return normalize_cp_sizes(world_size, p.cp_sizes)


def cap_tokens_of(cfg: Config) -> int:
    return cfg.parallel.cap_tokens if cfg.parallel.cap_tokens is not None else cfg.train.micro_batch_tokens


def largest_cp_of(cfg: Config, world_size: int) -> int:
    """The largest CP group one clip may run on (one pipeline stage's ranks); 1 unparallel."""
    if cfg.parallel.mode == "none":
        return 1
    return max(cp_sizes_of(cfg, world_size // max(1, cfg.parallel.pp_size)))


def clip_token_limit(cfg: Config, world_size: int) -> tuple[int, str]:
    """(most tokens one clip may have, that limit in the config's words): the cap of a rank times the
    largest CP group one pipeline stage allows, the limit the planner enforces at every step; with
    ``parallel.mode=none``, one rank's micro-batch budget (the trainer runs a larger clip alone, at
    memory and time the config never priced)."""
    if cfg.parallel.mode == "none":
        n = cfg.train.micro_batch_tokens
        return n, f"one rank holds (train.micro_batch_tokens={n:,})"
    cp = largest_cp_of(cfg, world_size)
    key = "parallel.cap_tokens" if cfg.parallel.cap_tokens is not None else "train.micro_batch_tokens"
    return cap_tokens_of(cfg) * cp, f"the largest CP group holds ({key}={cap_tokens_of(cfg):,} x CP {cp})"


def build_cost_model(cfg: Config, model_config, hardware: Hardware | None = None) -> CostModel:
    """Cost model of the configured VideoDiT on ``hardware`` (default: the configured profile; with
    ``parallel.hardware: auto`` the runtime measures one, ``dynamic_cp/runtime/auto_hardware.py``)."""
    if hardware is None and cfg.parallel.hardware == "auto":
        raise ValueError(
            "parallel.hardware=auto is resolved by the runtime at start-up; pass the measured profile "
            "or set parallel.hardware to a profile name (h100, h200, a100) or a yaml path"
        )
    text = HASHED_TEXT_TOKENS if cfg.data.text_encoder == "hashed" else cfg.data.text_max_length
    return CostModel(
        ModelDims.from_config(model_config, text_tokens=text),
        hardware if hardware is not None else Hardware.load(cfg.parallel.hardware),
        comm=cfg.parallel.cp_method,
    )


def stage_layers_of(cfg: Config, dims: ModelDims) -> list[int]:
    """Blocks per pipeline stage: ``parallel.pp_layers``, or the split the simulator and --dry-run
    price (``default_stage_layers``: least bottleneck, the embedders' and head's work counted)."""
    p = cfg.parallel
    layers = (
        [int(n) for n in p.pp_layers] if p.pp_layers is not None else default_stage_layers(dims, p.pp_size)
    )
    if sum(layers) != dims.layers:
        raise ValueError(
            f"parallel.pp_layers={layers} sums to {sum(layers)} blocks but the model has {dims.layers}; "
            f"list counts that add up to {dims.layers} (or null to balance them)"
        )
    return layers


def make_plan_fn(
    cfg: Config, cost_model: CostModel, world_size: int, fsdp: str = "none"
) -> Callable[[list[int]], Plan]:
    """lengths -> Plan for ``parallel.mode`` ('dynamic' or 'static') under the resolved weight-sharding
    mode ``fsdp``; pure, safe in a thread. Dynamic-CP under per_layer plans its lockstep rounds with
    the rounds planner, the plan ``python -m dynamic_cp.simulate --fsdp per_layer`` prices; static CP
    is cut into greedy rounds by the trainer, as the simulator cuts it."""
    cap = cap_tokens_of(cfg)
    sizes = cp_sizes_of(cfg, world_size)
    p = cfg.parallel
    if p.mode == "dynamic" and p.pp_size > 1:
        # under pipeline stages: CP sizes, packing and micro-batch order chosen for the stages'
        # 1F1B/GPipe step (planning/pipeline_order.py); the runtime runs the list in this order
        layers = stage_layers_of(cfg, cost_model.dims)
        return lambda lengths: plan_for_pipeline(
            lengths, world_size, cap, cost_model, layers, p.pp_schedule, cp_sizes=sizes
        )
    if cfg.parallel.mode == "dynamic":
        return lambda lengths: plan_for_mode(lengths, world_size, cap, cost_model, fsdp, cp_sizes=sizes)
    if cfg.parallel.mode == "static":
        # Round-robin over the W/c groups, first-fit packing up to cap * c tokens: static CP as a
        # plain sharded loader does it (dynamic_cp.planning.baselines).
        return lambda lengths: static_plan(lengths, world_size, cap, cost_model, cp_sizes=sizes)
    raise ValueError(f"parallel.mode={cfg.parallel.mode!r} runs in one process; use 'static' or 'dynamic'")
