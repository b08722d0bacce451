"""The Dynamic-CP iterator refuses a clip whose decoded size disagrees with its metadata.

The plan is made from ``meta()`` token counts before any pixel is decoded; a dataset whose loaded
clip has another size would silently run a plan made for different data, so the iterator stops
with the dataset index and both counts. One gloo process is enough (the check is per rank).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from dit.clips import TrainClip
from dynamic_cp.runtime.iterator import DynamicCPBatches
from dynamic_cp.runtime.testing import run_gloo


def _clip(index: int, n: int) -> TrainClip:
    return TrainClip(index, torch.zeros(n, 4), torch.zeros(n, 4), 0.5, torch.zeros(n, 3), torch.zeros(2, 8))


def _batches(decoded_tokens: list[int], num_workers: int = 0) -> DynamicCPBatches:
    dataset = [{"i": i} for i in range(len(decoded_tokens))]
    return DynamicCPBatches(
        dataset,
        list(range(len(dataset))),
        global_batch_size=len(dataset),
        data_seed=0,
        start_step=0,
        world=dist.group.WORLD,
        token_fn=lambda i: 12,  # what meta() promises for every clip
        prepare_fn=lambda sample, step: _clip(sample["i"], decoded_tokens[sample["i"]]),
        plan_fn=lambda lengths: SimpleNamespace(micro_batches=[((0,), list(range(len(lengths))))]),
        device=torch.device("cpu"),
        plan_ahead=False,
        num_workers=num_workers,
    )


def _iterate(rank: int, world_size: int, decoded_tokens: list[int]) -> str:
    batches = _batches(decoded_tokens)
    try:
        step = next(batches)
        return f"no error: {[c.num_tokens for _, clips in step.micro_batches for c in clips]}"
    except ValueError as e:
        return str(e)
    finally:
        batches.close()


def test_clip_size_differing_from_its_metadata_is_an_error():
    consistent, mismatched = run_gloo(_iterate, 1, [12, 12, 12])[0], run_gloo(_iterate, 1, [12, 20, 12])[0]
    assert consistent == "no error: [12, 12, 12]"
    assert "dataset index 1: meta() promises 12 tokens but the loaded clip has 20" in mismatched
    assert "meta(i) describe the clip after its clip policy" in mismatched  # and says how to fix it


def _workers_before_and_after_close(rank: int, world_size: int) -> tuple[int, int]:
    import multiprocessing

    batches = _batches([12, 12, 12], num_workers=2)
    next(batches)
    before = len(multiprocessing.active_children())
    batches.close()
    return before, len(multiprocessing.active_children())


def test_close_ends_the_loader_workers():
    """close() ends the DataLoader workers, though the iterator object lives on (issue 58). Planted:
    DynamicCPBatches.close without ``shut_down_workers`` -> (2, 2)."""
    assert run_gloo(_workers_before_and_after_close, 1)[0] == (2, 0)
