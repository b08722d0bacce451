"""Wan2.2 TI2V under FSDP2 (per_layer) with Dynamic-CP on 2 gloo ranks equals one process.

The model of tests/test_fsdp.py with per-token timesteps (``expand_timesteps``) and every multi-frame
clip trained image-to-video (frame 0 clean at t = 0, out of the loss): each step's loss and gradient
norm and every final parameter match single-process training within 1e-5 relative, as in
test_fsdp.py. Planted: the clip's image-to-video flag lost in routing -> the loss differs.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from test_fsdp import CONFIG, DATA, REL_TOL, STEPS, PerturbedFSDP, PerturbedTrainer, _rel, overrides

from dit.batching import GlobalBatchSampler
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
        trainer = PerturbedFSDP(_config(f"{root}/w{world_size}"), dist.group.WORLD)
        batches = trainer.data_iterator()
        steps = []
        for _ in range(STEPS):
            metrics = trainer.train_step(next(batches))
            trainer.step += 1
            steps.append({k: metrics[k] for k in ("loss", "grad_norm")})
        batches.close()
        full = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}  # collective
        return {"steps": steps, "params": full} if rank == 0 else {}
    except Exception:
        return {"error": traceback.format_exc()}


def test_ti2v_fsdp_steps_equal_single_process(tmp_path):
    res = run_gloo(worker, WORLD, str(tmp_path), timeout_s=240)
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}:\n{out['error']}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = _config(str(tmp_path / "ref"), **{"parallel.mode": "none", "parallel.fsdp": "none"})
        trainer = PerturbedTrainer(cfg, device=torch.device("cpu"))
        sampler = GlobalBatchSampler(trainer.train_indices, cfg.train.global_batch_size, cfg.data.seed)
        ref_steps = []
        for s in range(STEPS):
            clips = trainer.prepare([trainer.train_set[i] for i in sampler.batch(s)], s)
            assert any(c.clean_first for c in clips)  # the image-to-video path runs
            ref_steps.append(trainer.train_step(clips))
    finally:
        torch.set_num_threads(threads)
    for s, (got, ref) in enumerate(zip(res[0]["steps"], ref_steps)):
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL_TOL), f"step {s + 1} loss"
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL_TOL), f"step {s + 1} grad norm"
    for name, p in trainer.model.named_parameters():
        err = _rel(res[0]["params"][name], p.detach())
        assert err < REL_TOL, f"{name} differs from single process by {err:.2e}"
