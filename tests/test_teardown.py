"""A finished multi-process run leaves no process group alive for the interpreter's exit (issue 54).

1 in 15 finished 3-rank dynamic runs ended with SIGABRT on one rank: ``destroy_process_group`` only
unregisters the groups, and the trainer's reference cycles kept the gloo groups (their threads and
sockets) alive until Python finalized, when they were torn down as the peers exited
(``data.torchrun.leave_torchrun``). A real ``torchrun --nproc_per_node=2`` run of train.py; after
main returns, each rank names its live threads (``tests/_exit_threads.py``): gloo's are
``gloo_tcp_loop`` and ``pt_gloo_runloop``. Planted: ``leave_torchrun`` without its ``gc.collect()``
-> both ranks still run one group's gloo threads and this test fails.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_no_gloo_thread_outlives_a_finished_run(tmp_path):
    over = tiny_overrides(tmp_path, **{"parallel.mode": "dynamic", "train.max_steps": 2})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "_exit_threads.py"), "--config", str(ROOT / "configs" / "tiny.yaml"), *over]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [x for x in result.stdout.splitlines() if "threads after main:" in x]
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert "gloo" not in line, line
