"""How every command line reports a user's mistake: ``error: <message>`` on stderr and exit code 2,
with no traceback. A traceback still appears for anything else, since that is a bug, and with ``--debug``.

Shared by train.py, sample.py, data.scan, data.cache, dynamic_cp.simulate and dynamic_cp.calibrate.
It lives in ``data/`` because that package imports nothing else of the project: dit/ and dynamic_cp/
can import it without a cycle.
"""

from __future__ import annotations

import argparse
import sys
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


def run_cli(body: Callable[[], int], debug: bool = False) -> int:
    """Run a command line's ``body``; a user error becomes one message on stderr and exit code 2."""
    try:
        return body()
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"error: {message(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
