"""Pixel-space dataset over real video files (from a folder or a manifest).

Failures are caught at two points:
- build time: missing files, and files without metadata that fail to probe, are dropped, counted
  and logged; readable files the clip policy rejects are counted as skips;
- load time: a file that decodes badly despite good metadata (truncated, corrupt) is counted and
  replaced by another clip, chosen deterministically and cut to the same shape, so ``meta(i)``
  (which the planner already used) stays true.
"""

from __future__ import annotations

import logging

from torch.utils.data import Dataset

from data.clip_policy import ClipPolicy, ClipSkip
from data.failures import FailureLog
from data.manifest import Row
from data.readers import VideoInfo, VideoReadError, read_frames
from data.scan import probe_rows
from data.types import ClipMeta

log = logging.getLogger("data")


class VideoDataset(Dataset):
    """``meta(i)`` from metadata only; ``__getitem__(i)`` -> {"video", "caption", "index"}."""

    def __init__(
        self,
        rows: list[Row],
        policy: ClipPolicy | None = None,
        *,
        name: str = "videos",
        backend: str = "auto",
        max_failure_share: float = 0.05,
        probe_workers: int = 8,
        progress: bool = True,
    ):
        self.policy = policy or ClipPolicy()
        self.backend = backend
        self.failures = FailureLog(total=len(rows), max_failure_share=max_failure_share)
        rows = probe_rows(rows, self.failures, probe_workers, backend, progress)
        self.items: list[tuple[Row, ClipMeta]] = []
        for r in rows:
            try:
                self.items.append((r, self.policy.plan(r.info)))
            except ClipSkip as e:
                self.failures.skip(r.path, e.reason, e.detail)
        self._bad: set[int] = set()  # indices that failed at load time in this process
        num_uncaptioned = sum(1 for r, _ in self.items if not r.text)
        if num_uncaptioned:
            log.warning(
                "data: %d of %d clips in %s have no caption (trained unconditionally)",
                num_uncaptioned,
                len(self.items),
                name,
            )
        # A warning when anything was dropped, so the summary shows even where logging is not configured.
        noisy = self.failures.failed or self.failures.skipped
        log.log(logging.WARNING if noisy else logging.INFO, "%s", self.failures.summary())
        self.failures.check()
        if not self.items:
            raise ValueError(
                f"{name}: no usable clips. {self.failures.summary()}\n{self.failures.report()}\n"
                "Check the paths, or relax the clip policy (min_frames, min_tokens, fps)."
            )

    @property
    def vae_stride(self) -> tuple[int, int, int]:
        return self.policy.vae_stride

    def __len__(self) -> int:
        return len(self.items)

    def meta(self, i: int) -> ClipMeta:
        return self.items[i][1]

    def info(self, i: int) -> VideoInfo:
        return self.items[i][0].info

    def path(self, i: int) -> str:
        return self.items[i][0].path

    def load(self, i: int, meta: ClipMeta | None = None) -> dict:
        """Decode clip ``i`` cut to ``meta`` (its own by default). Raises VideoReadError."""
        row, own = self.items[i]
        meta = meta or own
        indices = self.policy.frame_indices(row.info, meta, i)
        frames = read_frames(row.path, indices, self.backend)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] != len(indices):
            raise VideoReadError(row.path, "decode_error", f"decoded array of shape {frames.shape}")
        return {"video": self.policy.to_tensor(frames, meta, i), "caption": row.text, "index": i}

    def __getitem__(self, i: int) -> dict:
        if i < 0 or i >= len(self):
            raise IndexError(f"index {i} out of range for {len(self)} clips")
        try:
            if i not in self._bad:
                return self.load(i)
            err = VideoReadError(self.path(i), "failed_before")
        except VideoReadError as e:
            err = e
            self._bad.add(i)
            self.failures.fail(self.path(i), e.reason, e.detail)  # raises above max_failure_share
        return self._replacement(i, err)

    def _replacement(self, i: int, err: VideoReadError) -> dict:
        """Deterministic stand-in for a broken clip: the next clip with the same shape, else the next
        one cut to this shape. The sample keeps ``index=i`` and reports the failure to the loader."""
        target = self.meta(i)
        order = [(i + k) % len(self) for k in range(1, len(self))]
        same = [j for j in order if self.meta(j) == target]
        records = [(self.path(i), err.reason)]
        for j in same + [j for j in order if self.meta(j) != target]:
            if j in self._bad:
                continue
            try:
                sample = self.load(j, target)
            except VideoReadError as e:
                self._bad.add(j)
                self.failures.fail(self.path(j), e.reason, e.detail)
                records.append((self.path(j), e.reason))
                continue
            sample["index"] = i
            sample["failures"] = records  # popped by data.failures.absorb_worker_failures in the trainer
            # info, not warning: the failure itself was the one warning line for this file
            log.info("data: clip %d (%s) replaced by clip %d", i, self.path(i), j)
            return sample
        raise RuntimeError(f"every clip failed to load; last error: {err}\n{self.failures.report()}")
