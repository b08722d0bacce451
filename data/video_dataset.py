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

import numpy as np
from torch.utils.data import Dataset

from data.clip_policy import ClipPolicy
from data.failures import FailureLog
from data.manifest import MISSING_FIX, Row
from data.manifest_table import ManifestTable, plan_rows
from data.readers import VideoInfo, VideoReadError, check_backend, read_frames
from data.scan import probe_rows
from data.types import ClipMeta

log = logging.getLogger("data")


class VideoDataset(Dataset):
    """``meta(i)`` from metadata only; ``__getitem__(i)`` -> {"video", "caption", "index"}.

    ``rows`` is a ``ManifestTable`` (data.manifest_table.read_table) or a list of ``Row``. The dataset keeps
    arrays only: the table, which table row each clip is, and each clip's shape; a clip's path and
    caption are read when it is loaded."""

    def __init__(
        self,
        rows: ManifestTable | list[Row],
        policy: ClipPolicy | None = None,
        *,
        name: str = "videos",
        backend: str = "auto",
        max_failure_share: float = 0.05,
        probe_workers: int = 8,
        progress: bool = True,
    ):
        self.policy = policy or ClipPolicy()
        if backend != "auto":  # 'auto' falls back to PyAV, and imports no decoder before the first decode
            check_backend(backend)  # a reader that is not installed: one line now, not in a DataLoader worker
        self.backend = backend
        table = rows if isinstance(rows, ManifestTable) else ManifestTable.from_rows(rows)
        self.table = table
        self.failures = FailureLog(total=len(table), max_failure_share=max_failure_share)
        for j in np.flatnonzero(table.missing):
            self.failures.fail(table.path(j), "missing_file", MISSING_FIX, check=False)
        keep = ~table.missing
        todo = np.flatnonzero(keep & ~table.has_info)
        if len(todo):  # rows without metadata: probed in threads, as Row objects (these rows only)
            todo_rows = [table.row(j) for j in todo]
            probe_rows(todo_rows, self.failures, probe_workers, backend, progress)
            for j, r in zip(todo, todo_rows):
                if r.info is None:
                    keep[j] = False
                else:
                    table.set_info(j, r.info)
        self._rows, self._meta = self._plan(np.flatnonzero(keep))  # (n,) int64, (n, 3) int32
        self._bad: set[int] = set()  # indices that failed at load time in this process
        num_uncaptioned = int((~table.captioned[self._rows]).sum())
        if num_uncaptioned:
            log.warning(
                "data: %d of %d clips in %s have no caption (trained unconditionally)",
                num_uncaptioned,
                len(self),
                name,
            )
        # A warning when anything was dropped, so the summary shows even where logging is not configured.
        noisy = self.failures.failed or self.failures.skipped
        log.log(logging.WARNING if noisy else logging.INFO, "%s", self.failures.summary())
        self.failures.check()
        if not len(self):
            raise ValueError(
                f"{name}: no usable clips. {self.failures.summary()}\n{self.failures.report()}\n"
                "Check the paths, or relax the clip policy (min_frames, min_tokens, fps)."
            )

    def _plan(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        kept, metas, skipped = plan_rows(self.table, rows, self.policy)
        for j, e in skipped:
            self.failures.skip(self.table.path(j), e.reason, e.detail)
        return kept, metas

    @property
    def vae_stride(self) -> tuple[int, int, int]:
        return self.policy.vae_stride

    def __len__(self) -> int:
        return len(self._rows)

    def meta(self, i: int) -> ClipMeta:
        return ClipMeta(*(int(x) for x in self._meta[i]))

    def info(self, i: int) -> VideoInfo:
        return self.table.info(int(self._rows[i]))

    def path(self, i: int) -> str:
        return self.table.path(int(self._rows[i]))

    def caption(self, i: int) -> str:
        return self.table.row(int(self._rows[i])).text

    def load(self, i: int, meta: ClipMeta | None = None) -> dict:
        """Decode clip ``i`` cut to ``meta`` (its own by default). Raises VideoReadError."""
        row = self.table.row(int(self._rows[i]))
        meta = meta or self.meta(i)
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
        order = (i + np.arange(1, len(self))) % len(self)
        same = (self._meta[order] == self._meta[i]).all(axis=1)
        records = [(self.path(i), err.reason)]
        for j in np.concatenate([order[same], order[~same]]).tolist():
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
