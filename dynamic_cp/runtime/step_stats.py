"""Measured timeline of one step, gathered for free inside the gradient all-reduce.

Each rank records, for each of its micro-batches, when it was ready to start it and when it finished,
and how many of those seconds it spent in CP collectives (``comm_clock``),
in seconds since its own step start (taken right after the routing all-to-all, which every rank leaves
at nearly the same moment; it is the clock alignment, good to the all-to-all's exit skew). Every
(micro-batch, member) pair and every rank's compute end owns one slot of a vector; a rank fills only
its own slots, so the SUM all-reduce that already carries the gradients acts as an all-gather and no
extra collective is needed. The vector has 3 * sum(CP sizes) + W entries: small next to gradients.

From the gathered timeline: a micro-batch really starts when its last member is ready (its first
collective blocks until then); a rank is busy from that start to its own end of the micro-batch, and
idle for the rest of the compute window (waiting for group peers, or done before the slowest rank).
A micro-batch's measured time is from that start to its last member's end, and its comm time the
members' mean collective seconds: what the cost model predicts and ``CostModel.fit`` learns from.
"""

from __future__ import annotations

import torch

from dynamic_cp.planning.plan_types import Plan


class StepTimeline:
    def __init__(self, plan: Plan, rank: int):
        self.plan, self.rank, self.world_size = plan, rank, plan.world_size
        self._slot: dict[tuple[int, int], int] = {}  # (micro-batch, rank) -> slot
        for m, (ranks, _) in enumerate(plan.micro_batches):
            for r in ranks:
                self._slot[(m, r)] = len(self._slot)
        self.num_slots = len(self._slot)
        self.size = 3 * self.num_slots + self.world_size
        self._values = torch.zeros(self.size, dtype=torch.float64)

    def record(self, m: int, ready_s: float, end_s: float, comm_s: float = 0.0) -> None:
        """This rank was ready for plan micro-batch ``m`` at ``ready_s``, finished it at ``end_s`` and
        spent ``comm_s`` of it in CP collectives."""
        k = self._slot[(m, self.rank)]
        self._values[3 * k] = ready_s
        self._values[3 * k + 1] = end_s
        self._values[3 * k + 2] = comm_s

    def finish(self, end_s: float) -> None:
        """This rank's last micro-batch ended (or it had none) at ``end_s``."""
        self._values[3 * self.num_slots + self.rank] = end_s

    def local(self) -> torch.Tensor:
        """(size,) this rank's slots filled, zeros elsewhere: what goes into the SUM all-reduce."""
        return self._values

    def summarize(self, gathered: torch.Tensor) -> dict:
        """Statistics from the summed vector (identical on every rank)."""
        v = gathered.double().cpu()
        rank_end = v[3 * self.num_slots :]
        window = float(rank_end.max()) if self.world_size else 0.0
        busy = [0.0] * self.world_size
        for m, (ranks, _) in enumerate(self.plan.micro_batches):
            start = max(float(v[3 * self._slot[(m, r)]]) for r in ranks)
            for r in ranks:
                busy[r] += max(float(v[3 * self._slot[(m, r)] + 1]) - start, 0.0)
        idle = [max(0.0, 1.0 - b / window) if window > 0 else 0.0 for b in busy]
        return {"compute_s": window, "idle_share": [round(x, 4) for x in idle]}

    def micro_batch_seconds(self, gathered: torch.Tensor) -> list[tuple[float, float, float]]:
        """(start, seconds, comm seconds) of every plan micro-batch from the summed vector, in plan
        order: start when its last member was ready, seconds until its last member finished."""
        v = gathered.double().cpu().tolist()
        out = []
        for m, (ranks, _) in enumerate(self.plan.micro_batches):
            slots = [3 * self._slot[(m, r)] for r in ranks]
            start = max(v[k] for k in slots)
            end = max(v[k + 1] for k in slots)
            comm = sum(v[k + 2] for k in slots) / len(slots)
            out.append((start, max(end - start, 0.0), comm))
        return out
