"""The plan of a sampling queue: its requests as the planner's jobs, the forward-only cost model,
the memory a rank may plan for, and whether the DiT's weights stay replicated or are FSDP-sharded
(``plan_with_weights``); ``dynamic_cp/runtime/sampling.py`` runs the plan."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dit.sample_requests import SampleRequest
from dit.sampling import compute_dtype, request_grid, request_scheduler
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.memory import sampling_token_cap, weight_bytes
from dynamic_cp.planning.model_dims import ModelDims
from dynamic_cp.planning.sampling_planner import SamplingJob, SamplingPlan, plan_sampling

SAMPLING_FSDP = ("auto", "none", "per_layer")  # training's per_step would gather all weights: replicated


def request_tokens(model, vae, request: SampleRequest) -> int:
    patch = tuple(model.config.patch_size)
    stride = (1, 1, 1) if vae is None else tuple(vae.stride)
    f, h, w = request_grid(request, patch, stride)
    return f * h * w


def high_steps(model, request: SampleRequest, num_tokens: int, shift) -> int | None:
    """Of a two-expert model (``dit.experts.ExpertPair``): how many of the request's steps the high
    expert runs (its scheduler's timesteps, the pair's own switch); None for one model."""
    if getattr(model, "boundary_ratio", None) is None:
        return None
    timesteps = request_scheduler(request, num_tokens, shift).timesteps
    return sum(model.expert_name_at(t) == "high" for t in timesteps)


def sampling_jobs(model, vae, requests: list[SampleRequest], shift=None) -> list[SamplingJob]:
    """The planner's view of ``requests``: tokens, steps, guidance, pixels and, of a two-expert
    model, each request's high-expert steps at ``shift`` (the run's; None: by token count)."""
    jobs = []
    for r in requests:
        n = request_tokens(model, vae, r)
        pixels = r.frames * r.height * r.width
        jobs.append(SamplingJob(n, r.steps, r.guided, r.label(), pixels, high_steps(model, r, n, shift)))
    return jobs


def sampling_cost_model(
    model, device: torch.device, world: dist.ProcessGroup, hardware: str | None
) -> CostModel:
    """The training cost model for this model priced forward-only: ``hardware`` (a profile name or
    path), else the profile training's ``parallel.hardware=auto`` would start from."""
    text_tokens = model.config.text_pad_len or 64
    dims = ModelDims.from_config(model.config, text_tokens=text_tokens)
    if hardware is not None:
        hw = Hardware.load(hardware)
    else:
        from dynamic_cp.runtime.auto_hardware import auto_hardware

        hw = auto_hardware(dims, device, world)
    return CostModel(dims, hw).forward()


def plan_queue(
    model,
    vae,
    requests: list[SampleRequest],
    world_size: int,
    cost: CostModel,
    memory_bytes: float | None,
    cfg_parallel: bool,
    sharded: bool = False,
    resident_bytes: float = 0.0,
    shift=None,
    base_bytes: int | None = None,
    offload_blocks: int = 0,
    idle_on_host: bool = False,
) -> SamplingPlan:
    """The plan of ``requests``; ``sharded``: the DiT is FSDP-sharded over the ``world_size`` ranks
    (memory priced with 1/W of the weights; lockstep rounds, in two expert phases for two experts at
    the run's ``shift``). Memory is priced in the DiT's compute dtype, next to ``resident_bytes`` of
    the other models on every rank (``resident_bytes(sampler)``); ``base_bytes`` and ``offload_blocks``:
    the blocks' storage (sample.py's --base-dtype, --offload), as ``memory.weight_bytes`` prices them;
    ``idle_on_host``: a two-expert model's idle expert waits in host memory (--idle-expert cpu)."""
    jobs = sampling_jobs(model, vae, requests, shift)
    value_bytes = compute_dtype(model).itemsize  # 2: bf16 (--precision bf16), 4: fp32
    shards = world_size if sharded else 1
    # two experts (dit/experts.py) stay resident while one runs, unless the idle one waits on the host
    idle_on_device = getattr(model, "boundary_ratio", None) is not None and not idle_on_host
    if memory_bytes is not None and idle_on_device:
        memory_bytes -= idle_expert_bytes(cost.dims, shards, value_bytes, base_bytes, offload_blocks)
    try:
        cap = (
            None
            if memory_bytes is None
            else sampling_token_cap(
                cost.dims,
                memory_bytes,
                shards=shards,
                value_bytes=value_bytes,
                resident_bytes=resident_bytes,
                base_bytes=base_bytes,
                offload_blocks=offload_blocks,
            )  # fmt: skip
        )
    except ValueError as e:
        if not idle_on_device or world_size > 1:  # --idle-expert is sample.py's on one process only
            raise
        raise ValueError(
            f"{e}; the idle expert is on the device too: --idle-expert cpu keeps it on the host"
        ) from None
    return plan_sampling(jobs, world_size, cost, cap, cfg_parallel=cfg_parallel, sharded=sharded)


def idle_expert_bytes(
    dims, shards: int, value_bytes: int, base_bytes: int | None, offload_blocks: int
) -> float:
    """Device bytes of a two-expert model's expert while the other runs: its 1/``shards`` of the
    weights, or replicated its weights as ``weight_bytes`` prices them with no block in flight (its
    offloaded blocks all wait on the host: its BlockOffloader frees each after its forward)."""
    if shards > 1:
        return value_bytes * dims.num_params / shards
    return weight_bytes(dims, 1, value_bytes, base_bytes, offload_blocks, in_flight=0)


def plan_with_weights(
    fsdp: str,
    model,
    vae,
    requests,
    world_size: int,
    cost: CostModel,
    memory_bytes,
    cfg_parallel: bool,
    resident: float = 0.0,
    shift=None,
) -> tuple[str, SamplingPlan]:
    """``--fsdp`` -> (the weights mode used, 'none' or 'per_layer'; its plan). 'auto' keeps the
    weights replicated when every request fits next to them (no weight traffic), else shards them;
    without a memory limit (CPU) it is 'none'."""
    if fsdp not in SAMPLING_FSDP:
        raise ValueError(f"--fsdp {fsdp}: use one of {', '.join(SAMPLING_FSDP)}")

    def plan(sharded: bool) -> SamplingPlan:
        return plan_queue(
            model, vae, requests, world_size, cost, memory_bytes, cfg_parallel, sharded, resident, shift
        )

    if fsdp == "per_layer" and world_size > 1:
        return "per_layer", plan(True)
    try:
        return "none", plan(False)
    except ValueError as e:
        if fsdp == "none" and world_size > 1 and "--fsdp" not in str(e):
            raise ValueError(f"{e}; or shard the weights with --fsdp per_layer (or auto)") from None
        if fsdp != "auto" or memory_bytes is None or world_size == 1:
            raise
    return "per_layer", plan(True)  # its own error names what to lower when even sharding does not fit


def check_memory(
    model, vae, requests: list[SampleRequest], memory_bytes: float, resident: float = 0.0, sampler=None
) -> None:
    """One process: a ValueError naming the first request whose forward does not fit
    ``memory_bytes`` next to ``resident`` bytes of other models (the planner's check on a world of
    one rank), the blocks stored and placed as ``sampler`` has them (--base-dtype, --offload), and
    its idle expert (--idle-expert)."""
    fp8 = sampler is not None and sampler.base_dtype.startswith("fp8")
    offload = 0 if sampler is None else sampler.offload_blocks
    idle_on_host = sampler is not None and sampler.idle_host is not None
    dims = ModelDims.from_config(model.config, text_tokens=model.config.text_pad_len or 64)
    cost = CostModel(dims, Hardware.load("h100")).forward()
    plan_queue(
        model, vae, requests, 1, cost, memory_bytes, True, resident_bytes=resident,
        base_bytes=1 if fp8 else None, offload_blocks=offload, idle_on_host=idle_on_host,
    )  # fmt: skip


def resident_bytes(sampler) -> int:
    """Bytes of the models besides the DiT that every rank holds while sampling: the text encoder,
    the VAE and an image encoder (their weights; the built-in hashed encoder and a pixel-space model's
    identity VAE hold none)."""
    parts = (sampler.text_encoder, sampler.vae, sampler.image_encoder)
    modules = [m.model for m in parts if isinstance(getattr(m, "model", None), torch.nn.Module)]
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def device_memory(device: torch.device, memory_gb: float | None) -> float | None:
    """Bytes a rank may plan for: ``memory_gb`` when given, else the GPU's; None (no limit) on CPU."""
    if memory_gb is not None:
        return memory_gb * 1e9
    return float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
