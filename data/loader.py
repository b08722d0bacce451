"""DataLoader with workers and prefetch, and a position that goes into the checkpoint.

    loader = build_dataloader(dataset, batch_size=4, num_workers=2, seed=0)
    for batch in loader:              # one epoch from the saved position; batch = list of samples
        ...
    ckpt["data"] = loader.state_dict()   # {"epoch", "position", ...}
    loader.load_state_dict(ckpt["data"]) # resumes at the next unseen sample, exactly

Batches are lists: clips of different shapes are never stacked (the planner packs them).
The position counts samples handed to the caller, not samples prefetched by workers, so a resume
neither skips nor repeats what workers had loaded ahead.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler


def collate_list(samples: list[dict]) -> list[dict]:
    return list(samples)


class ResumableSampler(Sampler[int]):
    """A per-epoch permutation (seeded by seed + epoch), this rank's share of it, from ``start``."""

    def __init__(
        self, num_samples: int, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1
    ):
        if num_samples < 1:
            raise ValueError("the dataset is empty: nothing to sample")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def order(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            perm = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            perm = list(range(self.num_samples))
        per_rank = -(-self.num_samples // self.world_size)
        perm += perm[: per_rank * self.world_size - len(perm)]  # wrap so every rank gets as many
        return perm[self.rank :: self.world_size]

    def __len__(self) -> int:
        return -(-self.num_samples // self.world_size) - self.start

    def __iter__(self):
        return iter(self.order(self.epoch)[self.start :])

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.start,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "rank": self.rank,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        for k in ("num_samples", "world_size", "seed", "shuffle"):
            if k in state and state[k] != getattr(self, k):
                raise ValueError(
                    f"data state has {k}={state[k]}, this run has {getattr(self, k)}: resuming would not "
                    "replay the same order. Use the same dataset and settings, or start the data from zero."
                )
        self.epoch, self.start = int(state["epoch"]), int(state["position"])


class ResumableLoader:
    """Iterates one epoch per ``for`` loop from the current position; tracks consumed samples."""

    def __init__(
        self,
        dataset,
        sampler: ResumableSampler,
        batch_size: int,
        num_workers: int = 2,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: use at least 1")
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.failures = getattr(dataset, "failures", None)
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate_list,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=num_workers > 0,  # no worker start-up cost at every epoch
            pin_memory=pin_memory,
        )

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        for batch in self.loader:
            for sample in batch:
                records = sample.pop("failures", None)
                if records and self.failures is not None:
                    self.failures.merge(records)  # worker copies count separately: gather them here
            self.sampler.start += len(
                batch
            )  # the iterator already read start: this is the checkpoint position
            yield batch
        self.sampler.epoch += 1
        self.sampler.start = 0

    def batches(self):
        """Batches forever, epoch after epoch."""
        while True:
            yield from self

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def build_dataloader(
    dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 2,
    prefetch_factor: int = 2,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool = False,
) -> ResumableLoader:
    sampler = ResumableSampler(len(dataset), shuffle, seed, rank, world_size)
    return ResumableLoader(dataset, sampler, batch_size, num_workers, prefetch_factor, pin_memory)
