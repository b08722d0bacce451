"""bench/gpu_check.py runs on a machine without CUDA: it lists what it would measure and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_without_cuda_lists_its_sections():
    args = [] if not torch.cuda.is_available() else ["--dry-run"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "would run" in out
    for section in ("attention: backends", "'sdpa'", "step: bf16 training step", "8448", "32760"):
        assert section in out, f"{section!r} missing from:\n{out}"
    assert "python -m dynamic_cp.calibrate" in out
