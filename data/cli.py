"""How every command line reports a user's mistake: ``error: <message>`` on stderr and exit code 2,
with no traceback. A traceback still appears for anything else, since that is a bug, and with ``--debug``.

Shared by train.py, sample.py, data.scan, data.cache, dynamic_cp.simulate and dynamic_cp.calibrate.
It lives in ``data/`` because that package imports nothing else of the project: dit/ and dynamic_cp/
can import it without a cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

from data.failures import TooManyFailures


class RunStopped(RuntimeError):
    """A run stopped for a reason the user must fix, not a bug (e.g. a loss that keeps diverging)."""


# A user's mistake: a bad value or path (ValueError, by the project's rule), too many broken files, a
# run stopped on purpose, or a file the user named that cannot be opened. Everything else is a bug
# and keeps its traceback.
USER_ERRORS = (
    ValueError,
    TooManyFailures,
    RunStopped,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the full traceback of user errors too")


def message(err: BaseException) -> str:
    """The user-facing text of ``err``: no traceback, even when a DataLoader worker raised it."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or err}"
    text = str(err)
    if "Original Traceback" in text:
        # torch re-raises a worker's exception with the worker's traceback in its message; what the
        # user needs is the original message after the last "<ExceptionType>: ".
        name = type(err).__name__ + ": "
        text = text[text.rfind(name) + len(name) :] if name in text else text.splitlines()[0]
    return text.strip()


def record_for_torchrun(text: str, callstack: str | None = None) -> None:
    """Write ``text`` to torchelastic's error file, so torchrun's summary shows it as the root cause
    (instead of ``error_file: <N/A>``). torchrun names one file per worker in TORCHELASTIC_ERROR_FILE;
    outside torchrun there is none and this does nothing. The format is the one torch's own
    ``ErrorHandler.record_exception`` writes; torchrun prints ``py_callstack``, so a user error puts
    its one line there rather than a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": callstack or text, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": text, "extraInfo": extra}}, f)
    except OSError:
        pass  # the error itself still reaches stderr and the exit code; this file is a courtesy


def says_errors() -> bool:
    """Whether this process prints a user error. Under torchrun every rank usually meets the same
    mistake: rank 0 says it once, and every rank records it in its error file, so a rank that fails
    alone is still named in torchrun's summary. Without torchrun's error file every process prints."""
    return not os.environ.get("TORCHELASTIC_ERROR_FILE") or os.environ.get("RANK", "0") == "0"


def run_cli(body: Callable[[], int], debug: bool = False) -> int:
    """Run a command line's ``body``; a user error becomes one message on stderr and exit code 2."""
    try:
        return body()
    except USER_ERRORS as err:
        if debug:
            raise
        text = f"error: {message(err)}"
        record_for_torchrun(text)
        if says_errors():
            print(text, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug: its traceback goes to stderr as before, and to torchrun's summary
        record_for_torchrun(f"{type(err).__name__}: {err}", traceback.format_exc())
        raise
