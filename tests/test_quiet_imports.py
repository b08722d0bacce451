"""Nothing writes to stderr or reaches for the network at import or start-up (data/quiet_imports.py).

On CPUs with AVX-512 BF16, importing bitsandbytes looks for a hub kernel and logs a warning; diffusers
and peft import it whenever it is installed. These tests run in fresh interpreters under
``OMP_NUM_THREADS=1`` (what torchrun sets for its workers), as a user's command would start.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dit", "data", "dynamic_cp")


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _project_modules() -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append(".".join(parts))
    return out


@pytest.mark.parametrize(
    "command",
    [
        ["train.py", "--help"],
        ["sample.py", "--help"],
        ["-m", "data.cache", "--help"],
        ["-m", "data.scan", "--help"],
    ],
    ids=lambda c: " ".join(c),
)
def test_help_writes_nothing_to_stderr(command):
    out = _run([sys.executable, *command])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()  # the help itself
    assert out.stderr == ""


def test_no_project_module_imports_bitsandbytes_or_writes_to_stderr():
    # Every module of the three packages, then the diffusers classes the project builds: bitsandbytes must
    # stay unimported (None is the hide of data/quiet_imports.py), and nothing may print to stderr.
    code = (
        "import importlib, sys\n"
        f"for m in {_project_modules()!r}: importlib.import_module(m)\n"
        "from diffusers import AutoencoderKLWan, WanTransformer3DModel\n"
        "import peft\n"
        "print(repr(sys.modules.get('bitsandbytes', 'absent')))\n"
    )
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("None", "'absent'"), f"bitsandbytes was imported: {out.stdout}"
    assert out.stderr == ""


def test_adamw_8bit_imports_bitsandbytes_quietly():
    try:  # asked of the package metadata: importing dit hides the module in this interpreter
        importlib.metadata.distribution("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("bitsandbytes is not installed")
    code = (
        "from dit.config import TrainConfig\n"
        "from dit.optim import optimizer_class\n"
        "print(optimizer_class(TrainConfig(optimizer='adamw_8bit')).__name__)\n"
    )
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "AdamW8bit"
    assert out.stderr == ""


def test_diffusers_imported_before_the_project_still_builds_its_models():
    # A script (bench/bench_cache.py, a user's) that imports diffusers first: diffusers has already
    # decided that bitsandbytes is there, so hiding it now would break its model imports.
    code = (
        "import diffusers\n"
        "import dit, data.vaes\n"
        "from diffusers import AutoencoderKLWan\n"
        "AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False])\n"
        "print('built')\n"
    )
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0 and out.stdout.strip() == "built", out.stderr[-2000:]
