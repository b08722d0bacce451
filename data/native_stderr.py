"""Drop the log lines a native library writes straight to file descriptor 2.

decord logs ``[09:34:38] .../video_reader.cc:83: ERROR opening: <path>, ...`` to stderr just before it
raises (dmlc's LOG_BEFORE_THROW, fixed at compile time; ``decord.logging.set_level`` only sets FFmpeg's
level). The exception already carries that reason, and ``data/failures.py`` reports each broken file
once, so the C++ line is noise that doubles every report.

While decord runs, fd 2 points at a pipe. A thread forwards everything else from the pipe to the real
stderr as it arrives (progress bars and other threads' warnings keep flowing) and drops only dmlc's
lines. Windows from several threads nest: the pipe stays until the last one ends.

dmlc's stream is unit-buffered: one line reaches fd 2 as a dozen writes ("[", "19:13:03", "] ", the
source file, ":", "83", ": ", the message in pieces, "\n"), and two threads' lines interleave write by
write with each other and with Python's own writes (seen in CI: two corrupt files probed at once). A
byte stream cannot be untangled, so on Linux the pipe is in packet mode (O_DIRECT): each read returns
one write. Python writes whole lines (stderr is line-buffered) or tqdm's "\r<bar>"; dmlc's pieces
have no newline but their last. So: a "[" piece opens a native line, a lone "\n" closes one, and
while any is open every piece without a newline that is not a progress bar is dropped. logging,
warnings and tqdm write whole; ``print(..., file=sys.stderr)`` writes its text and its newline apart,
so another thread's print in the microseconds a native line is open would be cut: report through
logging where decord may run at the same time.
"""

from __future__ import annotations

import os
import re
import sys
import threading

# dmlc's line as one piece, or a whole chunk where pipes have no packet mode (not Linux); the "["
# is optional for a chunk that began after it
NATIVE_LOG_LINE = re.compile(rb"\[?\d\d:\d\d:\d\d\] \S+\.(?:cc|cpp|h):\d+: [^\n]*\n?")
# the first piece of a dmlc line: "[", or "[" and the time where the stream joins them
NATIVE_LOG_OPEN = re.compile(rb"\[(?:\d\d:\d\d:\d\d(?:\] )?)?")


class NativeLogDropper:
    """Feed it the pipe's writes one at a time (packet mode); it returns what stderr should get."""

    def __init__(self) -> None:
        self.open = 0  # native lines begun and not yet ended

    def feed(self, piece: bytes) -> bytes:
        if piece == b"\n" and self.open:
            self.open -= 1
            return b""
        if NATIVE_LOG_OPEN.fullmatch(piece):
            self.open += 1
            return b""
        if self.open and b"\n" not in piece and not piece.startswith(b"\r"):
            return b""  # a piece of an open native line
        return NATIVE_LOG_LINE.sub(b"", piece)  # Python's writes, and native lines written at once


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

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._start()
            self._depth += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._stop()

    def _start(self) -> None:
        _flush()
        self._saved = os.dup(2)
        read_end, write_end = _packet_pipe()
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


def _packet_pipe() -> tuple[int, int]:
    try:  # Linux: each read returns one write (up to PIPE_BUF bytes; longer writes come in pieces)
        return os.pipe2(os.O_DIRECT)
    except (AttributeError, OSError):  # elsewhere a read returns what has piled up
        return os.pipe()


def _forward(read_end: int, out: int) -> None:
    dropper = NativeLogDropper()
    try:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while piece := pipe.read(65536):  # larger than a packet: a read never cuts one
                if kept := dropper.feed(piece):
                    os.write(out, kept)
    finally:
        os.close(out)


QUIET_NATIVE_STDERR = NativeStderrFilter()
"""Use as ``with QUIET_NATIVE_STDERR:`` around calls into decord."""
