"""Wan2.2 TI2V under FSDP2 (per_layer) with Dynamic-CP on 2 gloo ranks equals one process.

The model of tests/test_fsdp.py with per-token timesteps (``expand_timesteps``) and every multi-frame
clip trained image-to-video (frame 0 clean at t = 0, out of the loss): each step's loss and gradient
norm and every final parameter match single-process training within 1e-5 relative, as in
test_fsdp.py. Planted: the clip's image-to-video flag lost in routing -> the loss differs.
"""

from __future__ import annotations

import traceback

import pytest
from test_fsdp import CONFIG, DATA, assert_equals_single_process, fsdp_steps, overrides

from dit.config import load_config
from dynamic_cp.runtime.testing import run_gloo

pytestmark = pytest.mark.timeout(600)
TI2V = {
    "model.overrides": "{num_layers: 3, patch_size: [1, 4, 4], num_attention_heads: 2, attention_head_dim: 12, "
    "ffn_dim: 40, text_dim: 20, freq_dim: 16, expand_timesteps: true}",
    "flow.clean_first_frame": 1.0,
    "parallel.fsdp": "per_layer",
}
WORLD = 2


def _config(out: str, **extra):
    return load_config(CONFIG, overrides(out, **{**TI2V, **DATA[WORLD], **extra}))


def worker(rank: int, world_size: int, root: str) -> dict:
    try:
        out = fsdp_steps(_config(f"{root}/w{world_size}"))
        return out if rank == 0 else {}
    except Exception:
        return {"error": traceback.format_exc()}


def test_ti2v_fsdp_steps_equal_single_process(tmp_path):
    res = run_gloo(worker, WORLD, str(tmp_path), timeout_s=240)
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}:\n{out['error']}"

    def check(clips):
        assert any(c.clean_first for c in clips)  # the image-to-video path runs

    cfg = _config(str(tmp_path / "ref"), **{"parallel.mode": "none", "parallel.fsdp": "none"})
    assert_equals_single_process(res[0], cfg, check, "")
