"""Per-step data flow of Dynamic-CP training: metadata, lengths, plan, load, route.

For step s, on every rank (see DESIGN.md "Data flow in one training step"):
1. ``GlobalBatchSampler.batch(s)`` gives the global batch (a pure function of seed and step); rank r
   owns positions r, r+W, ... of it and reads only their metadata (``dataset.meta``), no pixels;
2. the token counts are all-gathered over the world, so every rank holds all B lengths;
3. the plan function (planner or static CP) turns lengths into micro-batches; it is deterministic,
   so every rank gets the same plan without communicating it;
4. rank r loads and prepares its own share (DataLoader workers prefetch it), then
   ``routing.route_clips`` sends each clip to the ranks of its micro-batch;
5. the step gets this rank's micro-batches in plan order; each is sharded across its group at
   execution time (``make_cp_attention`` + ``micro_batch_loss(token_range=...)``).

Plan-ahead: with ``plan_ahead``, step s also all-gathers the lengths of step s+1 and hands them to a
background thread, so the planner runs while step s computes. Only the main thread ever calls a
collective, so collective order stays identical on every rank.

A rank whose share is empty (B < W) or which the plan leaves idle still joins every collective with
empty inputs, so uneven data cannot deadlock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from dit.batching import GlobalBatchSampler, list_loader, shut_down_workers
from dit.clips import TrainClip
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.runtime.routing import destinations, route_clips, share_of


@dataclass
class StepBatch:
    """What one rank needs for one optimizer step."""

    step: int
    plan: Plan
    lengths: list[int]  # tokens per clip of the whole global batch, by sample id (= batch position)
    micro_batches: list[tuple[tuple[int, ...], list[TrainClip]]]  # this rank's, in plan order
    plan_indices: list[int]  # index into plan.micro_batches of each entry of micro_batches
    timings: dict = field(default_factory=dict)  # seconds spent in gather / plan wait / load / route

    @property
    def num_clips(self) -> int:
        return len(self.lengths)


class _ShareSampler:
    """DataLoader batch sampler: this rank's dataset indices of every step, starting at ``start_step``."""

    def __init__(self, sampler: GlobalBatchSampler, rank: int, world_size: int, start_step: int):
        self.sampler, self.rank, self.world_size, self.start_step = sampler, rank, world_size, start_step

    def __iter__(self):
        step = self.start_step
        while True:
            batch = self.sampler.batch(step)
            yield [batch[p] for p in share_of(self.rank, self.world_size, len(batch))]
            step += 1


class DynamicCPBatches:
    """Iterator of ``StepBatch`` for steps start_step, start_step+1, ...; call on every rank in lockstep.

    token_fn(dataset_index) -> tokens of that clip from metadata only.
    prepare_fn(sample, step) -> TrainClip on the compute device (encode, noise, sigma).
    plan_fn(lengths) -> Plan; must be deterministic (same plan on every rank).
    experts_fn(step, dataset indices, lengths) -> each clip's expert (model.expert=both); the plan
    function then gets them too: plan_fn(lengths, experts).
    """

    def __init__(
        self,
        dataset: Dataset,
        indices: list[int],
        *,
        global_batch_size: int,
        data_seed: int,
        start_step: int,
        world: dist.ProcessGroup,
        token_fn: Callable[[int], int],
        prepare_fn: Callable[[dict, int], TrainClip],
        plan_fn: Callable[[list[int]], Plan],
        device: torch.device,
        plan_ahead: bool = True,
        num_workers: int = 0,
        experts_fn: Callable[[int, list[int], list[int]], list[str]] | None = None,
    ):
        self.world = world
        self.rank, self.world_size = dist.get_rank(world), dist.get_world_size(world)
        self.sampler = GlobalBatchSampler(indices, global_batch_size, data_seed, start_step)
        self.token_fn, self.prepare_fn, self.plan_fn = token_fn, prepare_fn, plan_fn
        self.experts_fn = experts_fn
        self.device = device
        self.step = start_step
        self._executor = ThreadPoolExecutor(max_workers=1) if plan_ahead else None
        self._pending: tuple[list[int], Future] | None = None
        share = _ShareSampler(self.sampler, self.rank, self.world_size, start_step)
        self._samples = iter(list_loader(dataset, share, num_workers, data_seed, start_step))

    # ------------------------------------------------------------------------------ lengths, plan

    def _gather_lengths(self, step: int) -> list[int]:
        """All B token counts of ``step``'s global batch, by batch position, from metadata only."""
        batch = self.sampler.batch(step)
        mine = [self.token_fn(batch[p]) for p in share_of(self.rank, self.world_size, len(batch))]
        shares: list[list[int]] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(shares, mine, group=self.world)
        lengths = [0] * len(batch)
        for r, share in enumerate(shares):
            for p, n in zip(share_of(r, self.world_size, len(batch)), share):
                lengths[p] = n
        return lengths

    def _plan_future(self, lengths: list[int], step: int) -> Future:
        args = [lengths]
        if self.experts_fn is not None:  # model.expert=both: each clip's expert, from metadata alone
            args.append(self.experts_fn(step, self.sampler.batch(step), lengths))
        if self._executor is not None:
            return self._executor.submit(self.plan_fn, *args)
        done: Future = Future()
        done.set_result(self.plan_fn(*args))
        return done

    # ------------------------------------------------------------------------------ one step

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        step, timings = self.step, {}
        t0 = time.perf_counter()
        if self._pending is None:
            lengths = self._gather_lengths(step)
            self._pending = (lengths, self._plan_future(lengths, step))
        lengths, future = self._pending
        if self._executor is not None:  # look one step ahead while this one computes
            upcoming = self._gather_lengths(step + 1)
            self._pending = (upcoming, self._plan_future(upcoming, step + 1))
        else:
            self._pending = None
        t1 = time.perf_counter()
        plan = future.result()
        t2 = time.perf_counter()

        batch_indices = self.sampler.batch(step)
        mine: dict[int, TrainClip] = {}
        samples = next(self._samples)
        for p, sample in zip(share_of(self.rank, self.world_size, len(batch_indices)), samples):
            clip = self.prepare_fn(sample, step)
            if clip.num_tokens != lengths[p]:
                raise ValueError(
                    f"dataset index {batch_indices[p]}: meta() promises {lengths[p]} tokens but the loaded "
                    f"clip has {clip.num_tokens}; make the dataset's meta(i) describe the clip after its "
                    "clip policy (frames, height, width), so the plan matches the data"
                )
            mine[p] = clip
        t3 = time.perf_counter()
        received = route_clips(mine, destinations(plan.micro_batches, len(lengths)), self.world, self.device)
        t4 = time.perf_counter()

        micro_batches, plan_indices = [], []
        for m, (ranks, ids) in enumerate(plan.micro_batches):
            if self.rank in ranks:
                micro_batches.append((tuple(ranks), [received[s] for s in ids]))
                plan_indices.append(m)
        timings.update(gather_s=t1 - t0, plan_wait_s=t2 - t1, load_s=t3 - t2, route_s=t4 - t3)
        self.step += 1
        return StepBatch(step, plan, lengths, micro_batches, plan_indices, timings)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        shut_down_workers(self._samples)
