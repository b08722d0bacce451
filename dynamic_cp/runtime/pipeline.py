"""Pipeline stages under Dynamic-CP (``parallel.pp_size > 1``): one plan, every stage, 1F1B or GPipe.

The world is pp_size x R ranks, stage-major (``dynamic_cp/planning/pipeline_stages.py``): stage p is
global ranks p*R .. p*R + R - 1 and holds a contiguous range of blocks (``dit/stages.py``: stage 0 the
embedders, the last stage the head). Plan rank r of stage p is global rank p*R + r.

One plan serves every stage. Each stage runs the data flow of ``DynamicCPBatches`` over its own R
ranks (its stage group): rank r of every stage reads, prepares and routes the same clips (all
randomness is drawn per clip and step, ``dit/clips.py``), and the learner gets the same observations
on every rank (the timeline of every stage rides in the world all-reduce), so every stage plans the
same micro-batches on the same CP-group pattern. The last stage computes the loss target itself and
the first stage the input; only activations cross stages.

One step on a rank (``run_pipeline``): the stage's op order (``stage_schedule``: ``stage_ops``, 1F1B
at the plan's warm-up or GPipe, over the plan's whole micro-batch list) restricted to this rank's
micro-batches (``rank_ops``). A forward
receives x and the embedded block inputs from plan rank r of the stage before, runs the stage's
blocks with the micro-batch's CP attention, and sends them on (the last stage computes the loss). A
backward receives their gradients from the stage after, runs autograd, and sends the gradients of
what it received back. Sends are ``isend``s waited for at the end of the step, receives block; so a
rank blocks only on a receive or on a CP collective, both met in one order on every rank (see
``dynamic_cp/planning/pipeline_schedule.py``), and no cycle of waits can form. Every p2p message has
its own tag (micro-batch, direction, tensor), so nothing depends on the transport keeping order.

Every shape on the wire follows from the plan and the clips, which every rank holds: a receiver
computes its buffers' shapes from the micro-batch (``carried_shapes``), so packed, variable-length
activations need no shape exchange. dtypes follow from the config: the compute dtype for the
activations (autocast's, or fp32), fp32 for the time embedding (it is cast to the tokens' dtype).

Gradients: each stage's parameters are summed over that stage's R ranks (the stage group), the loss
and timeline over the world (the loss lives on the last stage's ranks, every other rank adds 0), the
gradient norm's square summed over stages. ``torch.distributed.pipelining`` is not used: its stages
take one fixed activation shape per stage (pytorch#159942, torchtitan#431), where packed
micro-batches change shape every time (docs/runtime.md, "Pipeline stages").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dit.clips import micro_batch_inputs
from dit.flow import flow_loss
from dit.stages import CARRIED, StagePart, carried_shapes, keep_stage, stage_frame
from dynamic_cp.attention.comm_clock import CommClock
from dynamic_cp.planning.pipeline_schedule import rank_ops, stage_ops
from dynamic_cp.planning.pipeline_stages import check_pipeline, layer_ranges, stage_ranks
from dynamic_cp.runtime.step_plans import stage_layers_of
from dynamic_cp.runtime.step_stats import StepTimeline


@dataclass
class Pipeline:
    """This rank's place in the pipeline and the groups it talks over."""

    pp_size: int
    stage: int
    plan_size: int  # R: ranks per stage, the plan's world
    plan_rank: int  # r: this rank in the plan (and in its stage group)
    layers: range  # the blocks this stage holds
    schedule: str
    world: dist.ProcessGroup
    stage_group: dist.ProcessGroup  # the R ranks of this stage: gradients, routing, FSDP mesh

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp_size - 1

    def peer(self, stage: int) -> int:
        """Global rank of this rank's plan rank on ``stage``."""
        return stage * self.plan_size + self.plan_rank

    def part(self, received=None) -> StagePart:
        return StagePart(self.layers, self.first, self.last, received)

    def keep(self, model) -> None:
        keep_stage(model, self.layers, self.first, self.last)


def build_pipeline(cfg, world: dist.ProcessGroup, dims) -> Pipeline | None:
    """This rank's ``Pipeline`` for ``parallel.pp_size`` (None for 1); call on every rank: it creates
    one process group per stage, every rank all of them in the same order."""
    p = cfg.parallel
    world_size, rank = dist.get_world_size(world), dist.get_rank(world)
    check_pipeline(world_size, p.pp_size, dims.layers)
    if p.pp_size == 1:
        return None
    check_pipeline_options(cfg)
    per_stage = stage_layers_of(cfg, dims)  # the split the planner prices
    groups = [dist.new_group(stage_ranks(world_size, p.pp_size, s)) for s in range(p.pp_size)]
    plan_size = world_size // p.pp_size
    stage = rank // plan_size
    layers = layer_ranges([int(n) for n in per_stage])[stage]
    return Pipeline(
        p.pp_size, stage, plan_size, rank % plan_size, layers, p.pp_schedule, world, groups[stage]
    )


def check_pipeline_options(cfg) -> None:
    """ValueError naming the fix for options a pipeline stage cannot run (it holds part of the model)."""
    bad = {
        "parallel.fsdp=per_layer": cfg.parallel.fsdp == "per_layer",
        "model.expert=both": cfg.model.expert == "both",
        f"model.offload={cfg.model.offload}": cfg.model.offload != "none",
        "train.sample_every > 0": bool(cfg.train.sample_every),
    }
    for what, on in bad.items():
        if on:
            raise ValueError(
                f"{what} with parallel.pp_size={cfg.parallel.pp_size}: not supported under pipeline stages "
                "(each holds part of the model); drop it, or set parallel.pp_size=1"
            )


# ----------------------------------------------------------------------------- timeline


class PipelineTimeline(StepTimeline):
    """One ``StepTimeline`` per stage in one vector: stage p fills segment p, so the world SUM
    all-reduce gathers every stage's. A micro-batch's measured seconds are the sum over stages of
    its forward and backward there (what the cost model prices for the whole model)."""

    def __init__(self, plan, plan_rank: int, stage: int, pp_size: int):
        super().__init__(plan, plan_rank)
        self.stage, self.pp_size = stage, pp_size

    def local(self) -> torch.Tensor:
        out = torch.zeros(self.pp_size * self.size, dtype=torch.float64)
        out[self.stage * self.size : (self.stage + 1) * self.size] = self._values
        return out

    def _stages(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        return list(gathered.double().cpu().view(self.pp_size, self.size))

    def summarize(self, gathered: torch.Tensor) -> dict:
        per_stage = [StepTimeline.summarize(self, v) for v in self._stages(gathered)]
        return {
            "compute_s": max(s["compute_s"] for s in per_stage),
            "idle_share": [x for s in per_stage for x in s["idle_share"]],  # by global rank
        }

    def micro_batch_seconds(self, gathered: torch.Tensor) -> list[tuple[float, float, float]]:
        per_stage = [StepTimeline.micro_batch_seconds(self, v) for v in self._stages(gathered)]
        return [(rows[0][0], sum(r[1] for r in rows), sum(r[2] for r in rows)) for rows in zip(*per_stage)]


# ----------------------------------------------------------------------------- one step


class _Wire:
    """Tagged point-to-point sends and receives of one step; sends are waited for in ``close``."""

    def __init__(self, pipe: Pipeline, device: torch.device, compute_dtype: torch.dtype):
        self.pipe, self.device, self.compute_dtype = pipe, device, compute_dtype
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in ("temb", "loss") else self.compute_dtype

    @staticmethod
    def tag(m: int, backward: bool, k: int) -> int:
        return (2 * m + backward) * 8 + k

    def send(self, tensors: list[torch.Tensor], names: list[str], stage: int, m: int, backward: bool) -> None:
        for k, (t, name) in enumerate(zip(tensors, names)):
            if t.dtype != self.dtype(name):
                raise AssertionError(f"{name} is {t.dtype}, the wire carries {self.dtype(name)}")
            if t.numel():  # the receiver knows the shape too, and skips the same empty tensors
                t = t.detach().contiguous()
                work = dist.isend(
                    t, self.pipe.peer(stage), group=self.pipe.world, tag=self.tag(m, backward, k)
                )
                self._sends.append((work, t))

    def recv(self, shapes: list[tuple[str, tuple]], stage: int, m: int, backward: bool) -> list[torch.Tensor]:
        out, works = [], []
        for k, (name, shape) in enumerate(shapes):
            buf = torch.empty(shape, dtype=self.dtype(name), device=self.device)
            if buf.numel():
                tag = self.tag(m, backward, k)
                works.append(dist.irecv(buf, self.pipe.peer(stage), group=self.pipe.world, tag=tag))
            out.append(buf)
        for w in works:
            w.wait()
        return out

    def close(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []


def stage_schedule(pipe: Pipeline, plan) -> list[tuple[str, int]]:
    """The stage's op list for ``plan``: its schedule at the plan's 1F1B warm-up, the list the
    simulator replays (every rank of the stage runs its subsequence of the same list)."""
    return stage_ops(len(plan.micro_batches), pipe.pp_size, pipe.stage, pipe.schedule, plan.pp_warmup)


def run_pipeline(trainer, batch, timeline: StepTimeline, t0: float) -> float:
    """This rank's ops of the stage's schedule; -> the sum of its losses (0 off the last stage)."""
    pipe: Pipeline = trainer.pipeline
    ops = stage_schedule(pipe, batch.plan)
    mine = dict(zip(batch.plan_indices, batch.micro_batches))
    wire = _Wire(pipe, trainer.device, trainer.compute_dtype())
    in_flight: dict[int, tuple] = {}  # m -> (outputs, their names, received leaves, times)
    local_loss = 0.0
    try:
        for kind, m in rank_ops(ops, batch.plan_indices):
            if kind == "F":
                local_loss += _forward(trainer, batch, wire, in_flight, m, *mine[m], t0)
            else:
                _backward(trainer, wire, in_flight, m, timeline)
    finally:
        wire.close()
    return local_loss


def _receive(trainer, wire: _Wire, args: tuple, extra: dict, m: int):
    """(x, block inputs) from the stage before, as leaves that collect their gradients, and the
    leaves; (None, []) on the first stage. Shapes from the micro-batch alone (``carried_shapes``)."""
    pipe, model = trainer.pipeline, trainer.model
    if pipe.first:
        return None, []
    inputs = stage_frame(model, args, extra)
    shapes = carried_shapes(model, inputs, args[0].shape[0])
    leaves = [t.requires_grad_(torch.is_grad_enabled()) for t in wire.recv(shapes, pipe.stage - 1, m, False)]
    for (name, _), t in zip(shapes[1:], leaves[1:]):
        setattr(inputs, name, t)
    return (leaves[0], inputs), leaves


def _send_on(wire: _Wire, out: torch.Tensor, inputs, m: int) -> tuple[list[torch.Tensor], list[str]]:
    """Send x and the block inputs to the next stage; -> (what was sent, their names)."""
    names = ["x", *(n for n in CARRIED if getattr(inputs, n) is not None)]
    outs = [out, *(getattr(inputs, n) for n in names[1:])]
    wire.send(outs, names, wire.pipe.stage + 1, m, backward=False)
    return outs, names


def _forward(trainer, batch, wire: _Wire, in_flight: dict, m: int, ranks, clips, t0: float) -> float:
    pipe, model = trainer.pipeline, trainer.model
    lengths = [c.num_tokens for c in clips]
    layouts = batch.plan.info.get("layouts")
    layout = tuple(layouts[m]) if layouts else trainer.cost_model.layout(lengths, len(ranks))
    attention, shard = trainer._cp_attention(ranks, lengths, model.config.num_attention_heads, layout)
    token_range = (shard.start, shard.end) if len(ranks) > 1 else None
    with trainer.autocast():
        args, extra, target, weights = micro_batch_inputs(model, clips, batch.num_clips, token_range)
        received, leaves = _receive(trainer, wire, args, extra, m)
        ready = time.perf_counter() - t0
        clock = CommClock(trainer.device)
        with clock.active():
            out, inputs = model(*args, attention, **extra, stage=pipe.part(received))
            loss = flow_loss(out, target, weights) if pipe.last else None
    trainer._sync()
    times = [ready, time.perf_counter() - t0 - ready, clock.seconds()]
    if pipe.last:
        in_flight[m] = ([loss], ["loss"], leaves, times)
        return loss.item()
    in_flight[m] = (*_send_on(wire, out, inputs, m), leaves, times)
    return 0.0


def _backward(trainer, wire: _Wire, in_flight: dict, m: int, timeline: StepTimeline) -> None:
    pipe = trainer.pipeline
    outs, names, leaves, times = in_flight.pop(m)
    if pipe.last:
        grads = [None]
    else:
        grads = wire.recv(
            [(n, tuple(t.shape)) for n, t in zip(names, outs)], pipe.stage + 1, m, backward=True
        )
    start = time.perf_counter()
    clock = CommClock(trainer.device)
    with clock.active():
        pairs = [(t, g) for t, g in zip(outs, grads) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    trainer._sync()
    if not pipe.first:
        back = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        wire.send(back, ["x", *CARRIED[: len(leaves) - 1]], pipe.stage - 1, m, backward=True)
    ready, busy, comm = times
    busy += time.perf_counter() - start
    timeline.record(m, ready, ready + busy, comm + clock.seconds())


def empty_received(trainer, args: tuple, extra: dict):
    """What a later stage receives for a zero-token micro-batch (FSDP's final reduce-scatter pass,
    ``fsdp.empty_micro_batch_loss``), made here: zeros of the carried shapes; None on stage 0."""
    pipe, model = trainer.pipeline, trainer.model
    if pipe.first:
        return None
    inputs = stage_frame(model, args, extra)
    wire = _Wire(pipe, trainer.device, trainer.compute_dtype())
    shapes = carried_shapes(model, inputs, 0)
    leaves = [
        torch.zeros(s, dtype=wire.dtype(n), device=trainer.device, requires_grad=True) for n, s in shapes
    ]
    for (name, _), t in zip(shapes[1:], leaves[1:]):
        setattr(inputs, name, t)
    return leaves[0], inputs


# ----------------------------------------------------------------------------- validation


class PipelineEval:
    """Validation through the stages: each micro-batch's forward runs stage by stage (the same
    ranks pair up as in training), the loss comes out on the last stage, whose total ``finish``
    hands to stage 0, the stage that logs."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.wire = _Wire(trainer.pipeline, trainer.device, trainer.compute_dtype())
        self.count = 0  # micro-batches so far: their tags

    def loss(self, clips, num_clips: int) -> float:
        from dit.attention import PackedAttention

        trainer, pipe, m = self.trainer, self.trainer.pipeline, self.count
        self.count += 1
        with trainer.autocast():
            args, extra, target, weights = micro_batch_inputs(trainer.model, clips, num_clips)
            received, _ = _receive(trainer, self.wire, args, extra, m)
            attention = PackedAttention([c.num_tokens for c in clips])
            out, inputs = trainer.model(*args, attention, **extra, stage=pipe.part(received))
        if pipe.last:
            return flow_loss(out, target, weights).item()
        _send_on(self.wire, out, inputs, m)
        return 0.0

    def finish(self, value: float) -> float:
        """The last stage's ``value`` on stage 0 (sent between the two plan-rank peers), nan on the
        stages between."""
        pipe = self.trainer.pipeline
        total = torch.tensor([value], dtype=torch.float32, device=self.trainer.device)
        if pipe.last:
            self.wire.send([total], ["loss"], 0, self.count, backward=False)
        elif pipe.first:
            total = self.wire.recv([("loss", (1,))], pipe.pp_size - 1, self.count, backward=False)[0]
        self.wire.close()
        return float(total) if pipe.first or pipe.last else math.nan


# ----------------------------------------------------------------------------- reductions


def clip_over_stages(pipe: Pipeline, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip every stage's gradients by the norm of the whole model's; -> that norm (the same on
    every rank). A stage's norm is the same on all its ranks (replicated, or FSDP's global norm of
    the stage's shards), so plan rank 0 of each stage adds its square."""
    from dynamic_cp.runtime.fsdp import grad_norm

    norm = grad_norm(params)
    square = (
        norm.double() ** 2
        if pipe.plan_rank == 0
        else torch.zeros((), dtype=torch.float64, device=norm.device)
    )
    square = square.reshape(1)
    dist.all_reduce(square, op=dist.ReduceOp.SUM, group=pipe.world)
    total = square[0].sqrt().to(norm.dtype)
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
