"""Bookkeeping for files that fail or are skipped: counted, logged with path and reason, never silent.

Two kinds, kept apart because only one of them means the data is broken:
- failures: the file is missing, empty, corrupt, truncated, not a video, unreadable. These count
  against ``max_failure_share``; above it the run stops and names some of the files.
- skips: the clip policy rejected a readable file (too short, too few tokens). Reported, not fatal.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
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
            raise TooManyFailures(
                too_many_failures(len(self.failed), self.total, self.max_failure_share, self.failed)
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


class _AboveBars(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)  # clears the bar, writes the line, redraws it


@contextlib.contextmanager
def warnings_above_bars():
    """While a tqdm bar is drawn, the data log's warnings go through ``tqdm.write`` on their own line
    instead of being glued to the bar's. Only where nothing else handles them: logging's last-resort
    handler would print the same message to stderr, but on the bar's line."""
    if log.hasHandlers():
        yield
        return
    handler = _AboveBars(logging.WARNING)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def too_many_failures(failed: int, total: int, allowed: float, named: dict[str, str], where: str = "") -> str:
    """One line: how many files failed against ``max_failure_share``, the first ten (each was also
    logged with its reason), and both fixes, with where the key goes in each command."""
    share = failed / total
    enough = math.ceil(share * 20) / 20  # the next multiple of 5% that lets this share through
    first = ", ".join(f"{p}: {r}" for p, r in list(named.items())[:10])
    return (
        f"{failed} of {total} files failed{where} ({share:.1%}), above max_failure_share={allowed:.1%} "
        f"({first}); fix or remove them (python -m data.scan writes a clean manifest), or allow "
        f"the share: train.py 'data.options={{max_failure_share: {enough:g}}}', python -m data.cache "
        f"--option max_failure_share={enough:g}"
    )


def absorb_worker_failures(samples: list[dict], failures: FailureLog | None) -> None:
    """Move the ``failures`` records that DataLoader workers attach to samples into the main
    process's log (each worker counts in its own copy of the dataset); may raise TooManyFailures."""
    for sample in samples:
        records = sample.pop("failures", None)
        if records and failures is not None:
            failures.merge(records)
