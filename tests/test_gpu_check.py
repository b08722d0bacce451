"""bench/gpu_check.py runs on a machine without CUDA: it lists what it would measure and exits 0; its
fp8 and offload cases skip off a GPU with the reason, and train.fp8's rows say why they skip.

Plants seen to fail: check_offload without its CUDA guard (it raises on CPU); fp8_training_skip
returning None on CPU; the fp8 line dropped from the plan."""

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
    assert "fp8: LoRA r32 step on an fp8_scaled base vs a bf16 base, 4 layers at 8448 tokens" in out
    assert "train.fp8 tensorwise and rowwise" in out
    assert "offload: checkpointed LoRA step, every one of 4 blocks offloaded" in out


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_and_offload_cases_skip_off_a_gpu_with_why():
    gc = _gpu_check()
    cpu = torch.device("cpu")
    for section, check in (("fp8", gc.check_fp8), ("offload", gc.check_offload)):
        rows = check(cpu, 2, 64, 1)
        assert rows == [{"section": section, "item": "all", "skipped": "needs a CUDA device, not cpu"}]
    assert gc.needs_cuda("fp8", torch.device("cuda", 0)) is None
    assert "device is cpu: set train.fp8=false" in gc.fp8_training_skip(cpu)


def test_train_fp8_rows_skip_below_8_9_or_without_torchao(monkeypatch):
    gc = _gpu_check()
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    assert "compute capability 8.0" in gc.fp8_training_skip(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert "needs torchao: pip install" in gc.fp8_training_skip(cuda)


def test_the_new_sections_can_be_skipped_by_name(capsys):
    assert _gpu_check().main(["--dry-run", "--skip", "fp8", "offload", "--layers", "3"]) == 0
    assert "every one of 3 blocks" in capsys.readouterr().out
