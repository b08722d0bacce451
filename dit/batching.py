"""Which clips each step trains on, and how a step's clips are packed into micro-batches.

The clip order is a pure function of (seed, step): position p of the endless stream is item
``perm_e[p % N]`` of epoch ``e = p // N``'s permutation. So the data position in a checkpoint is just
the step number, a resumed run sees exactly the clips it would have seen, and DataLoader workers can
prefetch ahead without the prefetching leaking into the saved state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader


class GlobalBatchSampler:
    """Yields the dataset indices of every step's global batch, starting at ``start_step``."""

    def __init__(self, indices: Sequence[int], batch_size: int, seed: int, start_step: int = 0):
        if len(indices) == 0:
            raise ValueError("the dataset has no usable clips; check data.source and the failure report")
        self.indices = indices if isinstance(indices, range) else list(indices)  # a range costs nothing
        self.batch_size = batch_size
        self.seed = seed
        self.start_step = start_step
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        # Positions into self.indices as one int64 tensor (8 MB at 1M clips): a list of them, or
        # iterating the tensor (a 0-d tensor per clip), would cost GBs and seconds at that size.
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perms = {epoch: torch.randperm(len(self.indices), generator=g)}
        return self._perms[epoch]

    def batch(self, step: int) -> list[int]:
        n = len(self.indices)
        first = step * self.batch_size
        return [self.indices[int(self._perm(p // n)[p % n])] for p in range(first, first + self.batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield self.batch(step)
            step += 1


def pack_by_token_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group positions 0..len-1 into micro-batches of at most ``budget`` tokens (first-fit decreasing).

    A clip longer than the budget gets a micro-batch of its own: it has to run somewhere, and this
    single-process path has no smaller unit than a clip (context parallelism is the answer for those).
    Returns lists of positions, each sorted, micro-batches ordered by their first position, so the
    result is deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def keep_list(samples: list) -> list:
    """DataLoader collate: clips have different shapes, so a batch stays a list."""
    return samples


def step_loader(
    dataset, indices: Sequence[int], batch_size: int, seed: int, start_step: int = 0, num_workers: int = 0
) -> DataLoader:
    """The trainer's data path: step ``start_step``'s global batch first, then every later step's, as
    lists of samples, loaded (and prefetched) by ``num_workers`` DataLoader workers. Samples may carry
    ``failures`` records from a worker's dataset copy (``data.failures.absorb_worker_failures``)."""
    sampler = GlobalBatchSampler(indices, batch_size, seed, start_step=start_step)
    return list_loader(dataset, sampler, num_workers, seed, start_step)


def list_loader(dataset, batch_sampler, num_workers: int, seed: int, start_step: int) -> DataLoader:
    """A DataLoader of ``batch_sampler``'s batches as lists, on ``num_workers`` workers.

    Its workers' base seed comes from the data seed and the first step, not from torch's global
    generator: an iterator started after a resume restored that generator would otherwise move it
    one draw on, and the resumed run would not continue exactly where the uninterrupted one is."""
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=keep_list,
        num_workers=num_workers,
        prefetch_factor=2 if num_workers else None,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed * 1_000_003 + start_step),
    )


def shut_down_workers(batches) -> None:
    """End the worker processes of a DataLoader iterator now, not when the iterator is collected: an
    exception's traceback keeps the iterator (and its persistent workers) alive for as long as the
    exception is held (issue 58: workers outlived their tests by minutes). No-op without workers."""
    stop = getattr(batches, "_shutdown_workers", None)  # torch's, which the iterator's __del__ calls
    if stop is not None:
        stop()


def close_batches(batches) -> None:
    """End what an iterator of batches runs: its own close() where it has one (DynamicCPBatches: its
    planning thread and its loader's workers), else a DataLoader iterator's worker processes."""
    if hasattr(batches, "close"):
        batches.close()
    else:
        shut_down_workers(batches)
