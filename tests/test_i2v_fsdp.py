"""Image-to-video under FSDP2 (per_layer) with Dynamic-CP on 2 and 4 gloo ranks equals one process.

The model of tests/test_fsdp.py with image conditioning: 3 + 1 mask + 3 image-latent input channels
and CLIP tokens from a small random CLIPVisionModel through the image K/V (odd widths, no tensor
splits evenly). Each step's loss and gradient norm and every final parameter (image embedder and
add_k/add_v included) match single-process training within 1e-5 relative, as in test_fsdp.py.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
from conftest import save_small_clip
from test_fsdp import CONFIG, DATA, assert_equals_single_process, fsdp_steps, overrides

from dit.config import load_config
from dynamic_cp.runtime.testing import run_gloo

pytestmark = pytest.mark.timeout(600)
I2V = {
    "model.overrides": "{num_layers: 3, patch_size: [1, 4, 4], num_attention_heads: 2, attention_head_dim: 12, "
    "ffn_dim: 40, text_dim: 20, freq_dim: 16, in_channels: 7, out_channels: 3, image_dim: 12, "
    "added_kv_proj_dim: 24}",
    "parallel.fsdp": "per_layer",
}


def _config(out: str, world_size: int, **extra):
    clip = str(Path(out).parent / "clip")
    items = {**I2V, **DATA[world_size], "data.image_encoder_path": clip, **extra}
    return load_config(CONFIG, overrides(out, **items))


def worker(rank: int, world_size: int, root: str) -> dict:
    try:
        out = fsdp_steps(_config(f"{root}/w{world_size}", world_size))
        return out if rank == 0 else {}
    except Exception:
        return {"error": traceback.format_exc()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_i2v_fsdp_steps_equal_single_process(tmp_path, world_size):
    save_small_clip(tmp_path / "clip")
    res = run_gloo(worker, world_size, str(tmp_path), timeout_s=240)
    assert "error" not in res[0], res[0].get("error")
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}:\n{out['error']}"

    def check(clips):
        assert clips[0].condition is not None and clips[0].image is not None  # the image path runs

    cfg = _config(str(tmp_path / "ref"), world_size, **{"parallel.mode": "none", "parallel.fsdp": "none"})
    assert_equals_single_process(res[0], cfg, check, f"W={world_size}: ")
