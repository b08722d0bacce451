"""A user's mistake under torchrun: said once, and named as torchrun's root cause (issue 54, item 4).

Before: every rank printed the same ``error:`` line, then torchrun's ChildFailedError summary ended
in ``error_file: <N/A>``. Now rank 0 prints the line and every rank writes it to the error file
torchrun names in TORCHELASTIC_ERROR_FILE (``data.cli.run_cli``). Real ``torchrun --nproc_per_node=2``
launches: one mistake found before the process group starts (a CP size the world cannot hold), one
found after it (a data source that does not exist, met by every rank's trainer).

Planted: ``says_errors`` returning True on every rank -> the count of ``error:`` lines is 2 in both
cases; ``record_for_torchrun`` made a no-op -> the summary says ``<N/A>``; ``check_world_size``
called after ``init_torchrun`` -> ``test_world_size_checked_before_the_process_group`` fails.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_ERROR_FILE", None)  # torchrun names one per worker
    return subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)


@pytest.mark.parametrize(
    "extra, line",
    [
        (
            {"parallel.mode": "static", "parallel.static_cp_size": 3},
            "error: parallel.static_cp_size=3 must divide the number of ranks (2); use one of [1, 2]",
        ),
        ({"parallel.mode": "dynamic", "data.source": "/nonexistent/clips"}, "error: "),
    ],
    ids=["before-process-group", "after-process-group"],
)
def test_user_error_said_once_and_named_as_root_cause(tmp_path, extra, line):
    result = _torchrun(["--config", TINY, *tiny_overrides(tmp_path, **extra)])
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    said = [x for x in text.splitlines() if x.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith(line), text  # once, by rank 0
    assert text.count("Traceback (most recent call last)") == 1, text  # torchrun's own, none from a rank
    root = text.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {said[0]}" in root, text
    assert "<N/A>" not in text, text


def test_world_size_checked_before_the_process_group(tmp_path, monkeypatch):
    """A mistake that needs only the world size stops before any process group starts."""
    from dit.config import load_config
    from dynamic_cp.runtime import launch

    def started(*args, **kwargs):
        raise AssertionError("the process group started before the world-size checks")

    monkeypatch.setattr(launch, "init_torchrun", started)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    cases = {
        "parallel.static_cp_size=2 must divide the number of ranks (3)": {
            "parallel.mode": "static",
            "parallel.static_cp_size": 2,
        },
        "parallel.pp_size=2 does not divide the world of 3 ranks": {"parallel.pp_size": 2},
        "CP size 3 is not allowed for world size 2": {"parallel.pp_size": 2, "parallel.cp_sizes": "[3]"},
        "parallel.fsdp=per_step with model.lora": {
            "parallel.fsdp": "per_step",
            "model.lora": "{rank: 4}",
        },
    }
    for message, over in cases.items():
        if "world size 2" in message:
            monkeypatch.setenv("WORLD_SIZE", "4")
        extra = {"parallel.mode": "dynamic", **over}
        cfg = load_config(TINY, tiny_overrides(tmp_path, **extra))
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            launch.run_distributed(cfg)
