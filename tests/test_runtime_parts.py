"""Pure pieces of the Dynamic-CP runtime, without processes: shares, routing layout, timeline, config."""

from __future__ import annotations

import os

import pytest
import torch

from dit.clips import TrainClip
from dit.config import load_config
from dit.packing import grid_positions
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.runtime.routing import _flatten, _header, _unflatten, destinations, owner_of, share_of
from dynamic_cp.runtime.step_plans import cp_sizes_of
from dynamic_cp.runtime.step_stats import StepTimeline


def test_shares_cover_the_batch_once_even_when_ranks_outnumber_clips():
    for batch, world in [(8, 4), (3, 4), (7, 3), (0, 2)]:
        shares = [share_of(r, world, batch) for r in range(world)]
        assert sorted(p for s in shares for p in s) == list(range(batch))
        assert all(owner_of(p, world) == r for r, s in enumerate(shares) for p in s)
    assert share_of(3, 4, 3) == []


def test_destinations_and_missing_sample():
    mbs = [((0, 1), [2]), ((0,), [0, 3]), ((1,), [1])]
    assert destinations(mbs, 4) == [(0,), (1,), (0, 1), (0,)]
    with pytest.raises(AssertionError, match="unassigned"):
        destinations(mbs, 5)


def test_clip_round_trips_through_the_flat_buffer():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(12, 5, generator=g)
    clip = TrainClip(
        7, x0, torch.randn(12, 5, generator=g), 0.25, grid_positions((3, 2, 2)), torch.randn(4, 6)
    )
    h = _header(3, clip)
    back = _unflatten(h, _flatten(clip))
    assert h.numel == _flatten(clip).numel()
    assert back.index == 7 and back.sigma == 0.25
    for a, b in [
        (back.x0, clip.x0),
        (back.noise, clip.noise),
        (back.positions, clip.positions),
        (back.text, clip.text),
    ]:
        assert torch.equal(a, b) and a.dtype == b.dtype
    empty_text = TrainClip(1, x0, x0, 0.5, grid_positions((3, 2, 2)), torch.zeros(0, 6))
    assert _unflatten(_header(0, empty_text), _flatten(empty_text)).text.shape == (0, 6)


def test_timeline_idle_shares():
    # Micro-batch 0 on (0, 1); then rank 0 runs micro-batch 1 alone while rank 1 has nothing.
    plan = Plan([((0, 1), [0]), ((0,), [1])], world_size=2, cap_tokens=10)
    parts = []
    for rank, records, end in [(0, [(0, 0.0, 1.0), (1, 1.0, 3.0)], 3.0), (1, [(0, 0.5, 1.0)], 1.0)]:
        tl = StepTimeline(plan, rank)
        for m, ready, done in records:
            tl.record(m, ready, done)
        tl.finish(end)
        parts.append(tl.local())
    stats = StepTimeline(plan, 0).summarize(parts[0] + parts[1])  # what the SUM all-reduce gives
    assert stats["compute_s"] == 3.0
    # rank 0 waited 0.5 s for rank 1, then ran 0.5 + 2 s; rank 1 ran 0.5 s of the 3 s window
    assert stats["idle_share"] == [pytest.approx(1 / 6, abs=1e-4), pytest.approx(5 / 6, abs=1e-4)]


def test_static_cp_size_must_divide_the_world():
    cfg = load_config(None, ["parallel.mode=static", "parallel.static_cp_size=2"])
    assert cp_sizes_of(cfg, 4) == (2,)
    with pytest.raises(ValueError, match="static_cp_size=2 must divide"):
        cp_sizes_of(cfg, 3)


def test_run_distributed_outside_torchrun_says_how_to_launch(monkeypatch):
    from dynamic_cp.runtime.launch import run_distributed

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert "RANK" not in os.environ
    with pytest.raises(ValueError, match="torchrun"):
        run_distributed(load_config(None, ["parallel.mode=dynamic"]))


def test_failure_share_is_checked_over_the_world():
    """Each rank sees 1/W of the load failures; the share is judged on the all-reduced count."""
    from data.failures import FailureLog, TooManyFailures
    from dynamic_cp.runtime.distributed_trainer import check_world_failures

    log = FailureLog(total=100, max_failure_share=0.05)
    log.fail("a.mp4", "truncated")  # this rank: 1% alone
    check_world_failures(log, 5)  # 5% in the world: still allowed
    with pytest.raises(TooManyFailures, match="6 of 100 files failed over all ranks"):
        check_world_failures(log, 6)
