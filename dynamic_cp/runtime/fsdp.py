"""FSDP2 sharding of the DiT that composes with Dynamic-CP's uneven micro-batch counts.

Weights (fp32 master), gradients and AdamW moments are sharded 1/W over the world with torch's
``fully_shard`` (``apply_fsdp``): each transformer block is one FSDP unit, the root (embedders,
output head) another. Mixed precision as torchtitan does it: fp32 sharded parameters, bf16 compute on
CUDA under ``train.mixed_precision=bf16`` (fp32 on CPU, so tests are exact), fp32 gradient reduction.

FSDP's all-gathers and reduce-scatters run over *all* ranks, so every rank must issue them in the
same order; under Dynamic-CP ranks run different numbers of micro-batches (``fully_shard`` as is on 2
gloo ranks where rank 0 runs two micro-batches and rank 1 one hangs). Two schedules make the world
collectives independent of the plan. Below, B = number of blocks, AG = all-gather of a unit's
parameter shards, RS = reduce-scatter of its gradients (SUM: the loss weights already make the sum
of per-rank gradients the single-process gradient, see ``dit/flow.py``), "world" = every rank.

``per_step`` (weights gathered once per step):
    1. AG root, AG block 0 .. B-1 (explicit ``unshard()``; every rank, before any CP collective);
    2. this rank's micro-batches in plan order, barrier-free as with replicated weights, with
       gradient sync, reshard-after-forward and reshard-after-backward all off: no world collective
       in any of them, only their CP groups' collectives. Unsharded gradients accumulate locally;
    3. one *empty* micro-batch (zero tokens) on every rank with gradient sync on and the weights
       still gathered (no AG): its backward issues RS block B-1 .. 0, then RS root (FSDP's final
       backward callback), and frees the gathered weights.
    Why not turn sync on for each rank's own last micro-batch (one RS round per rank, no extra
    pass)? Ranks reach their last micro-batch at different points of the plan: rank a may start its
    RS(world) while rank b is still inside a CP collective with rank c, and c is waiting in RS for a
    different block (or has not reached it): the RS of world and CP collectives of other groups
    then interleave differently on different ranks. Gloo processes ops of one group in order and
    blocks the caller; NCCL kernels on one stream serialize: both can deadlock or need fragile
    reasoning about every plan. Step 3 is issued by every rank after all its CP work, identically:
    obviously safe, for the price of one zero-token forward/backward (microseconds).
    Memory in the step: the compute-dtype weights and an unsharded gradient accumulator.

``per_layer`` (ZeRO-3): the plan runs in lockstep rounds (``dynamic_cp.planning.rounds``): in each
round each rank runs exactly one micro-batch, an empty one when it has none in that round. Every
micro-batch, empty or not, issues per round: AG root, AG block 0 .. B-1 in forward (each freed after
its forward), AG block B-1 .. 0 in backward (freed after), RS block B-1 .. 0, RS root. CP collectives
of a block sit between that block's AG and the next one on every member of the group, and all groups
of a round are disjoint, so no world collective can interleave with a CP collective differently on
two ranks. Reduce-scattered gradients accumulate into the sharded ``.grad`` round after round.

Between steps (validation, checkpoints) every rank runs the same forwards and state-dict calls.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dit.stages import held_blocks
from dit.trainer import autocast_dtype
from dynamic_cp.planning.memory import FSDP_MODES


def memory_per_rank(cfg) -> float:
    """Bytes one rank may use: ``parallel.memory_gb`` when set, else the CUDA device's memory, or on
    CPU the machine's RAM shared by the ranks of this node (``LOCAL_WORLD_SIZE``, set by torchrun)."""
    if cfg.parallel.memory_gb is not None:
        return cfg.parallel.memory_gb * 1e9
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def model_dims_of(cfg, model_config: dict | None = None):
    """The memory model's ``ModelDims`` of the configured VideoDiT, or of ``model_config`` (a
    VideoDiT config); no weights are read."""
    from dit.setup import model_config_of
    from dynamic_cp.planning.model_dims import ModelDims

    return ModelDims.from_config(model_config_of(cfg.model) if model_config is None else model_config)


def auto_fsdp_choice(cfg, world_size: int, memory_bytes: float, dims=None) -> tuple[str, float, int]:
    """``parallel.fsdp: auto`` -> (mode, bytes per rank it expects, token cap): the fastest mode
    (none, then per_step, then per_layer) whose states and one micro-batch of ``parallel.cap_tokens``
    fit 90% of ``memory_bytes``, from the memory model ``dynamic_cp.planning.memory``. A LoRA run
    keeps a replicated frozen base ('none'). ValueError, naming the knobs, when nothing fits.
    ``dims``: the model's ``ModelDims`` when known (default: read from the config)."""
    from dynamic_cp.planning.memory import choose_fsdp_mode
    from dynamic_cp.runtime.step_plans import cap_tokens_of

    dims = model_dims_of(cfg) if dims is None else dims
    cap = cap_tokens_of(cfg)
    ckpt, ema = cfg.model.gradient_checkpointing, cfg.train.ema_decay > 0
    two = {"experts": 2 if cfg.model.expert == "both" else 1, "idle_expert": cfg.model.idle_expert}
    if cfg.model.lora is not None:  # the base as stored (model.base_dtype) and placed (model.offload)
        from dynamic_cp.runtime.run_memory import offload_count, run_breakdown

        blocks = offload_count(cfg, world_size, dims, cap, memory_bytes)
        return "none", run_breakdown(cfg, world_size, "none", dims, cap, blocks).total, cap
    return choose_fsdp_mode(
        dims,
        world_size,
        cap,
        memory_bytes,
        ckpt,
        shard_optimizer=cfg.parallel.shard_optimizer,
        ema=ema,
        **two,
    )


def resolve_fsdp_mode(cfg, world_size: int, memory_bytes: float | None = None) -> str:
    """``parallel.fsdp`` -> the mode this run uses ('none', 'per_step' or 'per_layer'); 'auto' asks
    ``auto_fsdp_choice`` with ``memory_bytes`` (default: ``memory_per_rank(cfg)``). The launcher
    (``dynamic_cp.runtime.launch``) resolves 'auto' once, with the smallest memory of any rank, logs
    the choice and hands the trainers the concrete mode."""
    mode = cfg.parallel.fsdp
    if mode == "auto":
        memory = memory_per_rank(cfg) if memory_bytes is None else memory_bytes
        return auto_fsdp_choice(cfg, world_size, memory)[0]
    if mode not in FSDP_MODES:
        raise ValueError(f"parallel.fsdp={mode!r}; use 'none', 'per_step', 'per_layer' or 'auto'")
    if mode != "none" and cfg.model.lora is not None:
        raise ValueError(
            f"parallel.fsdp={mode} with model.lora: LoRA trains replicated adapters on a frozen bf16 base "
            "(Wan-14B's is 28 GB, it fits one 80 GB GPU unsharded); set parallel.fsdp=auto or none"
        )
    return mode


def mixed_precision_policy(device: torch.device, mixed_precision: str) -> MixedPrecisionPolicy:
    """bf16 gathered weights and compute on CUDA under 'bf16' or 'auto', fp32 otherwise (CPU keeps fp32
    weights even under 'bf16': autocast does the casts there); fp32 gradient reduction."""
    bf16 = device.type == "cuda" and autocast_dtype(mixed_precision, device) is not None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)


def apply_fsdp(
    model: torch.nn.Module, world: dist.ProcessGroup, device: torch.device, mixed_precision: str
) -> torch.nn.Module:
    """Shard ``model`` (a ``VideoDiT``) in place over ``world``: each block a unit, then the root."""
    mesh = DeviceMesh.from_group(world, device.type)
    policy = mixed_precision_policy(device, mixed_precision)
    for block in held_blocks(model):  # a pipeline stage holds some of them (dit/stages.py)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for unit in fsdp_units(model):
        # SUM, not FSDP's default average: the loss weights already divide by the global batch.
        # Forcing SUM (instead of NCCL's PREMUL_SUM with factor 1) also works on gloo.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        # A parameter no clip of this rank used still joins the reduce-scatter (as zeros): the
        # collective's size must not depend on which clips a rank ran.
        unit.set_reduce_scatter_unused_params(True, recurse=False)
    return model


def fp8_scales_after_step(optimizer: torch.optim.Optimizer, model: torch.nn.Module):
    """``train.fp8`` with fp8 all-gather (tensorwise, ``dit/fp8_train.py``): after each step of
    ``optimizer`` the scales of all of ``model``'s fp8-gathered weights are computed at once, in one
    all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan calls it), not
    one amax all-reduce per weight in its all-gather. A model without Float8Linear: unchanged."""
    if any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return optimizer


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    """The root, then block 0 .. B-1: the order of the explicit gathers of ``per_step``."""
    return [model, *held_blocks(model)]


def configure(
    model: torch.nn.Module, *, keep_gathered: bool, free_after_backward: bool, sync: bool, last_backward: bool
) -> None:
    """Set the FSDP knobs on every unit for the next forward/backward.

    keep_gathered: blocks stay gathered after forward (per_step); otherwise each is freed after its
        forward and gathered again for its backward (the root always stays gathered through the
        pass, as FSDP does by default: its head runs last in forward and first in backward).
    free_after_backward: free the gathered weights after backward.
    sync: reduce-scatter the gradients in this backward.
    """
    model.set_reshard_after_forward(not keep_gathered, recurse=True)
    model.set_reshard_after_forward(False, recurse=False)
    model.set_reshard_after_backward(free_after_backward, recurse=True)
    model.set_requires_gradient_sync(sync, recurse=True)
    model.set_is_last_backward(last_backward)


def gather_weights(model: torch.nn.Module) -> None:
    """All-gather every unit, root first, the same order on every rank."""
    for unit in fsdp_units(model):
        unit.unshard()


def release_weights(model: torch.nn.Module) -> None:
    """Free every gathered unit (no collective)."""
    for unit in fsdp_units(model):
        unit.reshard()


def empty_micro_batch_loss(model: torch.nn.Module, device: torch.device, stage=None) -> torch.Tensor:
    """A zero-token forward through every block: the loss (0, with a graph to every unit) of a rank
    that has no micro-batch in a round. One clip of zero tokens and no text; every matmul runs on
    (0, ·) rows, so each FSDP unit still gathers in forward and reduce-scatters in backward.
    ``stage``: (args, extra) -> a pipeline stage's ``StagePart`` for them (its blocks alone)."""
    cfg = model.config
    tokens = torch.zeros(0, cfg.in_channels * math.prod(cfg.patch_size), device=device)  # (0, p)
    positions = torch.zeros(0, 3, dtype=torch.long, device=device)  # (0, 3)
    one = torch.zeros(1, dtype=torch.long)
    text = torch.zeros(0, cfg.text_dim, device=device)  # (0, text_dim)

    def no_attention(q, k, v):  # (0, h, d) in, (0, h, d) out; keeps q, k, v in the graph
        return q + k + v

    extra = {}
    if cfg.get("image_dim") is not None:  # an image-conditioned model: one clip's CLIP tokens of zeros
        m = cfg.get("pos_embed_seq_len") or 1
        extra["image"] = torch.zeros(1, m, cfg.image_dim, device=device)  # (1, m, image_dim)
    args = (tokens, positions, one, torch.zeros(1, device=device), text, one)
    if stage is not None:
        pred, _ = model(*args, no_attention, **extra, stage=stage(args, extra))  # (0, p_out) or (0, D)
    else:
        pred = model(*args, no_attention, **extra)
    return pred.float().sum()  # (0, p_out) -> 0.0


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of ``params``' gradients, plain or sharded (DTensor): the total norm of DTensor
    shards is a partial sum that ``full_tensor`` all-reduces over their mesh."""
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type=2.0)
    return total.full_tensor() if isinstance(total, DTensor) else total


def grad_norm_and_clip(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip sharded (DTensor) gradients to ``max_norm`` by their global norm; -> that norm (a plain
    tensor)."""
    total = grad_norm(params)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def bytes_at_rest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds between steps: its parameters, their gradients and the optimizer's
    tensor states (AdamW's moments; the scalar step counts aside). DTensors (FSDP2 shards) count
    their local shard, plain tensors (replicated training) the whole tensor."""

    def local(tensors) -> int:
        return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)

    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {
        "params": local(params),
        "grads": local(p.grad for p in params if p.grad is not None),
        "optim": local(states),
    }


def track_gathered_peak(model: torch.nn.Module, peak: list[int]) -> None:
    """peak[0] <- most bytes of gathered (plain, not DTensor) parameters seen at any block's forward
    (hooks on ``model.blocks``; registered after FSDP's own, so a block is gathered when they run)."""

    def hook(*_):
        peak[0] = max(peak[0], sum(p.nbytes for p in model.parameters() if not isinstance(p, DTensor)))

    for block in model.blocks:
        block.register_forward_pre_hook(hook)
        block.register_forward_hook(hook)


class ShardedEMA:
    """EMA of this rank's parameter shards (DTensors); ``full_state_dict`` gathers them for export."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module, only: tuple[str, ...] | None = None) -> None:
        """``only``: name prefixes to update (model.expert=both: the experts that stepped)."""
        pairs = [
            (t.to_local(), p.detach().to_local())
            for (n, t), p in zip(self.params.items(), model.parameters())
            if only is None or n.startswith(only)
        ]
        if pairs:
            torch._foreach_lerp_([e for e, _ in pairs], [p for _, p in pairs], 1.0 - self.decay)

    def full_state_dict(self, is_main: bool) -> dict[str, torch.Tensor]:
        """Collective: every rank gathers each tensor; rank 0 keeps CPU copies, the others nothing."""
        out = {}
        for name, t in self.params.items():
            full = t.full_tensor()
            if is_main:
                out[name] = full.cpu()
        return out
