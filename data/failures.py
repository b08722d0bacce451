"""Bookkeeping for files that fail or are skipped: counted, logged with path and reason, never silent.

Two kinds, kept apart because only one of them means the data is broken:
- failures: the file is missing, empty, corrupt, truncated, not a video, unreadable. These count
  against ``max_failure_share``; above it the run stops and names some of the files.
- skips: the clip policy rejected a readable file (too short, too few tokens). Reported, not fatal.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("data")


class TooManyFailures(RuntimeError):
    pass


class FailureLog:
    def __init__(self, total: int = 0, max_failure_share: float = 0.05):
        if not 0.0 <= max_failure_share <= 1.0:
            raise ValueError(f"max_failure_share={max_failure_share}: use a share in [0, 1], e.g. 0.05")
        self.total = total
        """Number of files or rows the share is taken over; set by the dataset once it knows it."""
        self.max_failure_share = max_failure_share
        self.failed: dict[str, str] = {}  # path -> reason; a path is counted once however often it fails
        self.skipped: dict[str, str] = {}

    def fail(
        self, path: str, reason: str, detail: str = "", check: bool = True, logged: bool = False
    ) -> None:
        if path not in self.failed:
            self.failed[path] = reason
            if not logged:
                log.warning("data: skipping %s: %s%s", path, reason, f" ({detail})" if detail else "")
        if check:
            self.check()

    def skip(self, path: str, reason: str, detail: str = "") -> None:
        if path not in self.skipped:
            self.skipped[path] = reason
            log.info("data: policy skips %s: %s%s", path, reason, f" ({detail})" if detail else "")

    def merge(self, records: list[tuple[str, str]]) -> None:
        """Absorb failures reported by DataLoader workers (their dataset copies are separate). The worker
        logged each one already: one line per broken file, not one per process that met it."""
        for path, reason in records:
            self.fail(path, reason, logged=True)

    @property
    def share(self) -> float:
        return len(self.failed) / self.total if self.total else 0.0

    def check(self) -> None:
        if self.total and self.share > self.max_failure_share:
            some = "\n  ".join(f"{p}: {r}" for p, r in list(self.failed.items())[:10])
            raise TooManyFailures(
                f"{len(self.failed)} of {self.total} files failed ({self.share:.1%}), above "
                f"max_failure_share={self.max_failure_share:.1%}. First ones:\n  {some}\n"
                "Fix or remove these files (python -m data.scan rewrites a clean manifest), "
                "or raise max_failure_share if this share is expected."
            )

    def counts(self) -> dict[str, Counter]:
        return {"failed": Counter(self.failed.values()), "skipped": Counter(self.skipped.values())}

    def summary(self) -> str:
        c = self.counts()
        fails = ", ".join(f"{r}={n}" for r, n in sorted(c["failed"].items())) or "none"
        skips = ", ".join(f"{r}={n}" for r, n in sorted(c["skipped"].items())) or "none"
        return (
            f"data: {self.total} files, {len(self.failed)} failed ({fails}), "
            f"{len(self.skipped)} skipped by the clip policy ({skips})"
        )

    def report(self) -> str:
        """Summary line plus every failed and skipped path with its reason."""
        lines = [self.summary()]
        lines += [f"  failed  {p}: {r}" for p, r in self.failed.items()]
        lines += [f"  skipped {p}: {r}" for p, r in self.skipped.items()]
        return "\n".join(lines)


def absorb_worker_failures(samples: list[dict], failures: FailureLog | None) -> None:
    """Move the ``failures`` records that DataLoader workers attach to samples into the main
    process's log (each worker counts in its own copy of the dataset); may raise TooManyFailures."""
    for sample in samples:
        records = sample.pop("failures", None)
        if records and failures is not None:
            failures.merge(records)
