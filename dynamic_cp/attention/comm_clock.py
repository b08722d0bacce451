"""Seconds spent in CP collectives, so the runtime can split a micro-batch into compute and comm.

The runtime installs a ``CommClock`` for the span of one micro-batch (``with clock.active():``);
Ulysses' all-to-alls and the ring's sends and waits run inside ``timed()``. Nothing is timed when no
clock is active (tests, the single-process trainer). The active clock is process state, not group
state: autograd may run backward on another thread (CUDA), where a context variable would not be
seen, and one process runs one micro-batch at a time.

CPU: ``perf_counter`` around each call (gloo collectives block, so that is their cost). CUDA:
events recorded on the current stream around each call, summed once at the end of the micro-batch
(``seconds()``), so timing adds no synchronization inside the micro-batch.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

_ACTIVE: CommClock | None = None


class CommClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._cpu_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def active(self):
        global _ACTIVE
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous

    def seconds(self) -> float:
        """Collective seconds so far; on CUDA call after the stream is synchronized."""
        if self.cuda:
            return self._cpu_s + sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        return self._cpu_s


@contextmanager
def timed():
    """Charge the enclosed collective call to the active clock, if any."""
    clock = _ACTIVE
    if clock is None:
        yield
        return
    if clock.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        clock._events.append((start, end))
        return
    t = time.perf_counter()
    yield
    clock._cpu_s += time.perf_counter() - t
