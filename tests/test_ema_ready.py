"""After a short run, sampling shows what was learned: a young EMA (mostly the starting weights) is
not what ``sample.py --weights auto`` (the default) or training's validation clips sample, and one
line says why and how to choose (issue 54: 50 steps at decay 0.99 sampled noise, silently)."""

from __future__ import annotations

from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from conftest import tiny_overrides

import sample
from dit.config import load_config
from dit.ema import ema_not_ready
from dit.trainer import Trainer

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
SMALL = ["--frames", "1", "--height", "8", "--width", "8", "--steps", "2", "--grid", "--prompt", "a red circle"]  # fmt: skip


def test_ema_is_ready_once_the_starting_weights_are_under_a_tenth_of_it():
    # 0.99**50 = 0.605: the run; 0.99**229 = 0.1003 and 0.99**230 = 0.0993
    assert "after 50 steps at train.ema_decay=0.99 the EMA is still 61% the starting weights" in (
        ema_not_ready(0.99, 50) or ""
    )
    assert "from step 230" in ema_not_ready(0.99, 229)
    assert ema_not_ready(0.99, 230) is None
    assert ema_not_ready(0.5, 4) is None  # 0.0625


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """4 steps at train.ema_decay=0.99: the EMA is 96% its starting weights."""
    tmp = tmp_path_factory.mktemp("short_run")
    cfg = load_config(TINY, tiny_overrides(tmp, **{"train.max_steps": 4, "train.lr": 0.05}))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    trainer.train()
    return trainer


def _grid(run_dir: Path, out: Path, *flags) -> np.ndarray:
    assert sample.main(["--checkpoint", str(run_dir), "--out", str(out), *SMALL, *flags]) == 0
    (png,) = out.glob("*.png")
    return imageio.imread(png)


def test_sample_py_takes_the_trained_weights_while_the_ema_is_young_and_says_so(short_run, tmp_path, capsys):
    run_dir = short_run.out
    capsys.readouterr()
    auto = _grid(run_dir, tmp_path / "auto")
    said = capsys.readouterr().out
    assert (
        "sampling model/ (the trained weights), not the EMA: after 4 steps at train.ema_decay=0.99 the EMA "
        "is still 96% the starting weights" in said
    )
    assert "--weights ema to sample it" in said
    np.testing.assert_array_equal(auto, _grid(run_dir, tmp_path / "model", "--weights", "model"))
    ema = _grid(run_dir, tmp_path / "ema", "--weights", "ema")  # asked for: sampled, with a note
    assert "note: after 4 steps" in capsys.readouterr().out
    assert not np.array_equal(auto, ema)


def test_training_samples_the_live_weights_until_the_ema_is_ready(short_run):
    with short_run.sampling_weights() as model:
        assert model is short_run.model  # step 4 at decay 0.99
    short_run.step = 230
    try:
        with short_run.sampling_weights() as model:
            assert model is short_run.ema.model
    finally:
        short_run.step = 4
