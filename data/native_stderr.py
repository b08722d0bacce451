"""Drop the log lines a native library writes straight to file descriptor 2.

decord logs ``[09:34:38] .../video_reader.cc:83: ERROR opening: <path>, ...`` to stderr just before it
raises (dmlc's LOG_BEFORE_THROW, fixed at compile time; ``decord.logging.set_level`` only sets FFmpeg's
level). The exception already carries that reason, and ``data/failures.py`` reports each broken file
once, so the C++ line is noise that doubles every report.

While decord runs, fd 2 points at a pipe. A thread forwards everything else from the pipe to the real
stderr as it arrives (progress bars and other threads' warnings keep flowing) and drops only lines in
dmlc's format. Windows from several threads nest: the pipe stays until the last one ends.
"""

from __future__ import annotations

import os
import re
import sys
import threading

# dmlc's format: "[hh:mm:ss] <source file>:<line>: <message>\n". It may follow a progress bar's
# unfinished line ("probing videos: 0%| [00:00<?]"), so it is cut out wherever it starts. The C++
# stream writes it in pieces, so another thread's "\r<progress bar>" can land between its "[" and
# the rest (seen in a full-suite run): the "[" is optional.
NATIVE_LOG_LINE = re.compile(rb"\[?\d\d:\d\d:\d\d\] \S+\.(?:cc|cpp|h):\d+: [^\n]*\n?")
NATIVE_LOG_START = re.compile(rb"\[|\d\d:\d\d:\d\d\] ")


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


class NativeStderrFilter:
    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):  # POSIX; decord ships no Windows wheels anyway
            os.register_at_fork(after_in_child=self._after_fork)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = -1
        self._thread: threading.Thread | None = None

    def _after_fork(self) -> None:
        # A DataLoader worker forked mid-window would write into the parent's pipe: give it stderr back.
        if self._depth:
            os.dup2(self._saved, 2)
            os.close(self._saved)
        self._reset()

    def __enter__(self) -> NativeStderrFilter:
        with self._lock:
            if self._depth == 0:
                self._start()
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._stop()

    def _start(self) -> None:
        _flush()
        self._saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)  # fd 2 is now the only write end: restoring it ends the forwarder
        self._thread = threading.Thread(
            target=_forward, args=(read_end, os.dup(self._saved)), name="native-stderr", daemon=True
        )
        self._thread.start()

    def _stop(self) -> None:
        _flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        # A child process that kept the pipe open would keep the forwarder alive: it then goes on
        # forwarding for that child, and this thread does not wait for it.
        self._thread.join(timeout=2.0)


def _forward(read_end: int, out: int) -> None:
    pending = b""
    try:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                *lines, pending = re.split(rb"(?<=[\n\r])", pending + chunk)
                kept = b"".join(NATIVE_LOG_LINE.sub(b"", line) for line in lines)
                # an unfinished line passes on now, up to what may start a dmlc line
                starts = [m.start() for m in NATIVE_LOG_START.finditer(pending)]
                cut = starts[-1] if starts else len(pending)
                if pending[cut - 1 : cut] == b"[":  # the timestamp's own bracket
                    cut -= 1
                kept, pending = kept + pending[:cut], pending[cut:]
                if kept:
                    os.write(out, kept)
        if pending:
            os.write(out, NATIVE_LOG_LINE.sub(b"", pending))
    finally:
        os.close(out)


QUIET_NATIVE_STDERR = NativeStderrFilter()
"""Use as ``with QUIET_NATIVE_STDERR:`` around calls into decord."""
