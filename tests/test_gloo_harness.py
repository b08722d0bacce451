"""``run_gloo`` ends every process it started, whatever happens to a rank or to the caller (issue 58).

Each rank starts a child of its own (as DataLoader workers or a subprocess would be), records its pid
and its child's, and then blocks where no collective timeout will free it: only the harness can end
it. Rank 0 ignores SIGTERM, so the harness must not stop at a polite request.
"""

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from dynamic_cp.runtime.testing import run_gloo


def _running(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (ended, not yet reaped by a parent that is not us) has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_all_ended(folder) -> None:
    """Every rank and every rank's child recorded in ``folder`` has ended; those that have not are
    killed here, after the check, so that a failing run leaves nothing behind either."""
    pids = [int(open(os.path.join(folder, name)).read()) for name in sorted(os.listdir(folder))]
    running = [p for p in pids if _running(p)]
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    assert len(pids) == 4 and not running, f"still running after run_gloo: {running} of {pids}"


def _block_forever(rank, world_size, folder, then):
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    for name, pid in ((f"rank{rank}", os.getpid()), (f"child{rank}", child.pid)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(str(pid))
    dist.barrier()  # every pid is on disk before anything ends
    if rank == 1 and then == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    if rank == 0 and then == "interrupt":
        os.kill(os.getppid(), signal.SIGUSR1)  # the caller is interrupted while it waits for the ranks
    threading.Event().wait()  # in C, as a rank stuck in a decoder or a collective would be


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_failed_rank_takes_its_peers_and_what_they_started_with_it(tmp_path):
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        run_gloo(_block_forever, 2, str(tmp_path), "raise")
    _assert_all_ended(tmp_path)


class _Interrupted(Exception):
    pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_interrupted_caller_ends_every_rank_and_what_they_started(tmp_path):
    """As pytest-timeout or Ctrl-C interrupt a test that waits for hung ranks."""

    def interrupt(signum, frame):
        raise _Interrupted

    before = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with pytest.raises(_Interrupted):
            run_gloo(_block_forever, 2, str(tmp_path), "interrupt")
    finally:
        signal.signal(signal.SIGUSR1, before)
    _assert_all_ended(tmp_path)
