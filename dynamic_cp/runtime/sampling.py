"""Multi-process sampling: ``torchrun --nproc_per_node N sample.py ...`` runs a queue on a plan.

Every rank computes the same plan (``dynamic_cp/runtime/sampling_plan.py``, by
``dynamic_cp/planning/sampling_planner.py``) and runs its placements in plan order; a placement starts when all its ranks are there, as a training
micro-batch does (collectives block, so no barrier). Requests on disjoint groups run at once.

One placement on one rank, per Euler step (``run_placement``), with n tokens a branch, c ranks a
group and k branches in this group's forward (2 packed, or 1 under CFG-parallel or without guidance):
    x (n, p), the same on every rank of the request
    -repeat k, shard-> (k*n/c, p) -DiT with training's CP attention-> (k*n/c, p) velocity shard
    -all_gather in the group-> (k*n, p)
    -CFG-parallel only: swap with the same group rank of the other branch's group-> v_cond, v_uncond
    -mix, Euler step on the full x-> x (n, p), again the same on every rank
so every rank of a request holds the same x after each step, and the clip equals the one-process
clip up to the float rounding of the sharded forward. Text is encoded on every rank of the request
(one call for both captions, as in one process); the owner (the first rank of the conditional
group) decodes with the VAE and writes the mp4.

FSDP-sharded weights (``--fsdp per_layer``, or ``auto`` when replicated weights do not fit): the DiT
is sharded over the whole world with training's FSDP2 code (``runtime/fsdp.py``: each block a unit,
then the root), and every unit is freed again after its forward. Each forward then all-gathers every
unit over the world, so every rank must run the same number of forwards: the plan comes in lockstep
rounds (``SamplingPlan.rounds``), and in round k every rank runs ``round_forwards[k]`` forwards: its
request's steps, then empty ones (zero tokens, ``fsdp.empty_micro_batch_loss``) up to the round's
count, or only empty ones when it has no request in the round. Per rank, per forward:
    AG root (world), AG block 0 (world), block 0 with its CP group's collectives, AG block 1, ...
    after the forward: all_gather of the velocity in the CP group, the CFG-parallel swap
The groups of a round are disjoint, and between two world all-gathers each rank issues only its own
group's (or partner's) collectives, which its group's ranks issue at the same point: no collective
can wait on a rank that waits on another collective. Why shard over the world rather than within
each CP group: a rank belongs to a group of every size, and the plan moves it between sizes; one
sharding over all ranks is one copy of the weights (1/W each), as training keeps it.

Two experts (Wan2.2 A14B, ``dit.experts.ExpertPair``): each expert is sharded on its own, as training's
``model.expert=both`` shards them, so a forward gathers only its expert's units. A request runs its
high expert's forwards, then its low expert's, switching where its timesteps cross the boundary. A
round then runs in two phases (``SamplingPlan.phases``): every rank runs H_k forwards of the high
expert (its request's, then empty ones of the high expert), then L_k of the low expert. The empty
high forwards come at the switch, inside the request's denoising loop (``RoundForwards.before``, called
before each step's forward), so no rank gathers the low expert while another still gathers the high.

Legend: n = tokens of one branch, p = patch values, k = branches in one forward, c = CP group size.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from dit.sample_output import write_video
from dit.sample_requests import SampleRequest
from dit.sampling import compute_precision, decode, denoise, guidance_at, prepare, request_scheduler
from dynamic_cp.attention.cp_attention import make_cp_attention
from dynamic_cp.attention.sharding import gather_shards
from dynamic_cp.planning.sampling_planner import Placement, SamplingPlan
from dynamic_cp.runtime.fsdp import apply_fsdp, empty_micro_batch_loss
from dynamic_cp.runtime.groups import CPGroups, build_cp_groups
from dynamic_cp.runtime.sampling_plan import (
    device_memory,
    plan_with_weights,
    resident_bytes,
    sampling_cost_model,
)
from dynamic_cp.runtime.torchrun import init_torchrun


@contextlib.contextmanager
def sampling_world():
    """Join torchrun's process group (NCCL on GPUs, gloo on CPUs) for the ``with`` block; yields
    this rank's device."""
    device = init_torchrun()
    try:
        yield device
    finally:
        dist.destroy_process_group()


def _exchange(v: torch.Tensor, partner: int) -> torch.Tensor:
    """Swap ``v`` with the global rank ``partner`` (the same position in the other branch's group):
    one send and one receive of equal shapes."""
    other = torch.empty_like(v)
    ops = [dist.P2POp(dist.isend, v.contiguous(), partner), dist.P2POp(dist.irecv, other, partner)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return other


@torch.no_grad()
def run_placement(
    model,
    text_encoder,
    vae,
    request: SampleRequest,
    placement: Placement,
    groups: CPGroups,
    shift,
    image_encoder=None,
    before_forward=None,
) -> torch.Tensor | None:
    """Sample ``request`` on this rank's part of ``placement``; -> the video on the owner, else None.
    ``before_forward(t)``: called before each step's forward (``RoundForwards.before``)."""
    rank = groups.rank
    prep = prepare(model, text_encoder, vae, request, image_encoder)
    n = prep.num_tokens
    cfg = placement.cfg_ranks is not None
    cond_side = rank in placement.ranks
    ranks = placement.ranks if cond_side else placement.cfg_ranks
    texts = prep.texts[:1] if cfg and cond_side else prep.texts[1:] if cfg else prep.texts
    u, r = placement.layout
    group = groups.get(ranks)
    sub_groups = groups.sub_groups(ranks, u) if u > 1 and r > 1 else None
    heads = model.config.num_attention_heads
    attention, info = make_cp_attention(
        group, [n] * len(texts), num_heads=heads, layout=(u, r), sub_groups=sub_groups
    )
    token_range = (info.start, info.end) if group is not None else None
    if cfg:  # the rank at this rank's place in the other branch's group
        other = placement.cfg_ranks if cond_side else placement.ranks
        partner = other[ranks.index(rank)]

    def velocities(x, t):
        if before_forward is not None:
            before_forward(t)
        v = prep.velocity(model, x, t, attention, token_range, texts)  # (k*n/c, p)
        if group is not None:
            v = gather_shards(v, group, info)  # (k*n, p)
        if cfg:
            theirs = _exchange(v, partner)
            return (v, theirs) if cond_side else (theirs, v)
        return (v[:n], v[n:]) if request.guided else (v, None)

    scheduler = request_scheduler(request, n, shift, prep.noise.device)
    x = denoise(prep.noise, scheduler, velocities, guidance_at(model, request), prep.first_frame)
    if rank != placement.owner:
        return None
    return decode(x, prep.grid, tuple(model.config.patch_size), vae)


def shard_for_sampling(model, world: dist.ProcessGroup, device: torch.device):
    """Shard ``model`` over ``world`` with training's FSDP2 units (``apply_fsdp``), in its compute dtype
    (fp32, or bf16 under ``--precision bf16``: one dtype, as FSDP2 gathers a unit in one), every unit
    freed after its forward (no backward follows); the shards move to ``device``. Two experts are
    sharded each on its own, as training's ``model.expert=both`` does (``FSDPTrainer._shard_model``):
    a forward gathers only its expert."""
    for dit in _dits(model):
        apply_fsdp(dit, world, device, "fp32")  # "fp32": no policy cast, the weights' own dtype
        dit.set_reshard_after_forward(True, recurse=True)
    return model


def _dits(model) -> list[torch.nn.Module]:
    """The VideoDiTs of ``model``: the experts of an ``ExpertPair`` (high first), else the model."""
    return [model.high, model.low] if getattr(model, "boundary_ratio", None) is not None else [model]


@torch.no_grad()
def empty_forward(model, expert: str | None = None) -> None:
    """A zero-token forward: this rank's part of every unit's all-gather, nothing else (in the
    weights' precision, as a real forward runs). Of a two-expert model, of ``expert`` ('high' or
    'low'): the one the other ranks run."""
    dit = model if expert is None else getattr(model, expert)
    device = next(dit.parameters()).device
    with compute_precision(dit, device):
        empty_micro_batch_loss(dit, device)


class RoundForwards:
    """One rank's forwards in one lockstep round (``SamplingPlan.phases``): ``counts[e]`` forwards of
    expert e, in order, whatever this rank runs. ``before(t)`` comes before each of its request's
    forwards (at timestep t): at the first forward of the low expert it pads the high phase with empty
    forwards, so every rank gathers the high expert H_k times before any rank gathers the low one.
    ``finish()`` pads what is left (a rank with no request pads everything)."""

    def __init__(self, model, counts: tuple[int, ...]):
        self.model = model
        self.experts = ["high", "low"] if getattr(model, "boundary_ratio", None) is not None else [None]
        if len(counts) != len(self.experts):
            raise ValueError(
                f"a plan of {len(counts)}-phase rounds for a model of {len(self.experts)} expert(s); "
                "plan with this model (plan_queue)"
            )
        self.left = dict(zip(self.experts, counts))

    def before(self, t: torch.Tensor) -> None:
        expert = None if self.experts == [None] else self.model.expert_name_at(t)
        for earlier in self.experts[: self.experts.index(expert)]:
            self._pad(earlier)
        if self.left[expert] < 1:  # planned with another shift or boundary: stop before the gathers mismatch
            raise RuntimeError(
                f"a request runs more forwards of expert {expert} than its lockstep round planned; "
                "plan with the run's --shift (plan_queue's shift)"
            )
        self.left[expert] -= 1

    def _pad(self, expert) -> None:
        for _ in range(self.left[expert]):
            empty_forward(self.model, expert)
        self.left[expert] = 0

    def finish(self) -> None:
        for expert in self.experts:
            self._pad(expert)


def run_plan(
    model,
    text_encoder,
    vae,
    requests: list[SampleRequest],
    plan: SamplingPlan,
    groups: CPGroups,
    shift,
    on_done,
    image_encoder=None,
) -> None:
    """This rank's placements of ``plan`` (its jobs index ``requests``) in plan order; the owner of
    each calls ``on_done(request, video, placement, seconds)``. A plan with rounds (FSDP-sharded
    weights) runs them in lockstep, padded with empty forwards (module docstring)."""
    rounds = plan.rounds if plan.rounds is not None else [[i] for i in range(len(plan.placements))]
    for k, members in enumerate(rounds):
        mine = [plan.placements[i] for i in members if groups.rank in plan.placements[i].all_ranks]
        lockstep = RoundForwards(model, plan.phases(k)) if plan.rounds is not None else None
        for placement in mine:  # at most one under rounds
            request = requests[placement.job]
            t0 = time.perf_counter()
            video = run_placement(
                model, text_encoder, vae, request, placement, groups, shift, image_encoder,
                None if lockstep is None else lockstep.before,
            )  # fmt: skip
            if video is not None:
                on_done(request, video, placement, time.perf_counter() - t0)
        if lockstep is not None:
            lockstep.finish()


def sample_queue_distributed(
    sampler,
    requests: list[SampleRequest],
    paths: dict,
    shift,
    fps: int,
    upscale: int,
    cfg_parallel: bool,
    hardware: str | None,
    memory_gb: float | None = None,
    fsdp: str = "auto",
    device: torch.device | None = None,
) -> list:
    """``sample.py`` under torchrun: plan the requests whose clips are not written yet, run them and
    write each on its owner. Every rank returns the paths it wrote. The DiT may come on the CPU: it
    goes to ``device`` (default: where its parameters are), replicated or sharded by ``fsdp``."""
    world = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # rank 0 decides what is left (a rank that looked later could see a clip another rank has
    # just written, and plan a different queue)
    todo = [[r.index for r in requests if not paths[r.index].exists()]] if rank == 0 else [None]
    dist.broadcast_object_list(todo, src=0)
    todo_requests = [r for r in requests if r.index in set(todo[0])]
    if rank == 0 and len(todo_requests) < len(requests):
        print(
            f"{len(requests) - len(todo_requests)} of {len(requests)} clips already in place; sampling {len(todo_requests)}"
        )
    model = sampler.model
    device = next(model.parameters()).device if device is None else device
    cost = sampling_cost_model(model, device, world, hardware)
    memory = device_memory(device, memory_gb)
    mode, plan = plan_with_weights(
        fsdp,
        model,
        sampler.vae,
        todo_requests,
        world_size,
        cost,
        memory,
        cfg_parallel,
        resident_bytes(sampler),
        shift,
    )
    if mode == "per_layer":
        shard_for_sampling(model, world, device)
    else:
        model.to(device)
    groups = build_cp_groups(world, None, splits=cost.cp_layout)
    if rank == 0:
        sizes = sorted({len(p.all_ranks) for p in plan.placements})
        weights = "replicated" if mode == "none" else f"FSDP-sharded over {world_size} ranks"
        print(
            f"plan: {len(plan.placements)} requests on {world_size} ranks ({plan.info.get('policy')}; ranks a "
            f"request: {sizes}; weights {weights}), predicted {plan.makespan:.1f} s by the {cost.hw.name} profile",
            flush=True,
        )
    written = []

    def on_done(request, video, placement, seconds):
        path = write_video(video, paths[request.index], fps, upscale)
        written.append(path)
        where = f"ranks {placement.ranks}" + (
            f" + {placement.cfg_ranks} (CFG-parallel)" if placement.cfg_ranks else ""
        )
        print(
            f"[rank {rank}] {request.label()} on {where}, layout {placement.layout}: {seconds:.1f} s -> {path}",
            flush=True,
        )

    run_plan(
        model,
        sampler.text_encoder,
        sampler.vae,
        todo_requests,
        plan,
        groups,
        shift,
        on_done,
        sampler.image_encoder,
    )
    dist.barrier()  # every clip is written before any rank reports success
    return written
