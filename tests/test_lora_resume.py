"""A 2-rank dynamic LoRA run on the 24 GB recipe resumes bitwise (issue 41's last acceptance line).

The run of tests/test_lora_parallel.py (rank-4 adapters on a random Wan model, fp8_scaled base,
every block offloaded, gradient checkpointing, Dynamic-CP on 2 gloo ranks), here with an adapter
EMA, trains 3 steps through ``train_distributed`` once uninterrupted, and once stopped by
``train.max_steps=2`` after its step-2 checkpoint and resumed from that step directory by a fresh
trainer for step 3. Both step-3 checkpoints must be bitwise equal: the adapters, their EMA, the
AdamW moments and step counts, the LR schedule; and so must the step-3 loss and grad norm in
metrics.jsonl. Bitwise, not within a tolerance: the resumed trainer re-derives the fp8 scales from
the same pretrained weights and restores everything else, so nothing may differ by even one bit.

``parallel.deterministic=true``: with the defaults the planner prices from a CPU measurement at
start-up and from its own step timings, so the resumed run could pack step 3's clips differently
and differ by the order of fp32 sums (docs/faults.md "Bitwise or not").

Planted and seen to fail: the resume not restoring the AdamW moments (``Trainer._resume`` with its
``self.optimizer.load_state_dict`` skipped): step 3's loss still agrees (it is computed before the
update), and the step-3 adapters differ.

Also torch's global generator: it continues exactly, as the data iterator's DataLoader no longer
seeds its workers from it (planted: ``list_loader`` without its generator -> that check fails).
Python's and numpy's global generators are not compared (see the comment at the comparison).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_lora import make_wan
from test_lora_parallel import CONFIG, LOWMEM, overrides

from dit.config import load_config
from dit.wan_import import import_wan_state_dict

RUN = {
    "parallel.mode": "dynamic",
    "parallel.deterministic": "true",
    **LOWMEM,
    "model.offload_blocks": 2,  # every block (train_distributed resolves auto to 0 here)
    "train.ema_decay": 0.5,  # on, and far from 1, so that a wrong EMA shows after one step
    "train.checkpoint_every": 2,
    "train.keep_checkpoints": 4,
    "train.log_every": 1,
}


def worker(rank: int, world_size: int, root: str, out: str, max_steps: int, resume: str | None) -> dict:
    import torch.distributed as dist

    from dynamic_cp.runtime.launch import train_distributed

    try:
        cfg = load_config(CONFIG, overrides(root, out, **{**RUN, "train.max_steps": max_steps}))
        trainer = train_distributed(cfg, dist.group.WORLD, resume=resume)
        assert all(o.swapped for o in trainer.offloaders), "the offloader was not installed"
        return {"ok": True}
    except Exception:  # the spawn error shows only the last frame; keep the whole trace
        return {"error": traceback.format_exc()}


def _train(root: Path, out: str, max_steps: int, resume: Path | None = None) -> None:
    from dynamic_cp.runtime.testing import run_gloo

    res = run_gloo(worker, 2, str(root), out, max_steps, resume and str(resume), timeout_s=240)
    assert res == [{"ok": True}] * 2, res


def _state(run: Path) -> dict:
    """Step 3's checkpoint (LoRA runs save adapters only), the export, and the logged steps."""
    step = run / "checkpoints" / "step_000003"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        "model": load_file(str(step / "model" / "pytorch_lora_weights.safetensors")),
        "ema": load_file(str(step / "ema" / "pytorch_lora_weights.safetensors")),
        "export": load_file(str(run / "pytorch_lora_weights.safetensors")),
        "trainer": torch.load(step / "trainer.pt", map_location="cpu", weights_only=True),
        "steps": {r["step"]: r for r in rows if "loss" in r},
    }


def _equal(a, b, where: str) -> None:
    """Bitwise equality of nested trainer state (tensors compared with ``equal``, not a tolerance)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.equal(b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.timeout(600)
def test_lowmem_lora_resume_is_bitwise(tmp_path):
    wan = make_wan()  # our format, no caption padding (see test_lora_parallel's fixture)
    import_wan_state_dict(wan.config, wan.state_dict(), text_pad_len=None).save_pretrained(tmp_path / "wan")
    _train(tmp_path, "whole", max_steps=3)
    _train(tmp_path, "resumed", max_steps=2)
    step2 = tmp_path / "resumed" / "checkpoints" / "step_000002"
    assert step2.is_dir() and not (tmp_path / "resumed" / "checkpoints" / "step_000003").exists()
    _train(tmp_path, "resumed", max_steps=3, resume=step2)
    whole, resumed = _state(tmp_path / "whole"), _state(tmp_path / "resumed")
    assert sorted(whole["steps"]) == [1, 2, 3] and sorted(resumed["steps"]) == [1, 2, 3]
    # not vacuous: some step ran a micro-batch under CP 2, and the adapters moved
    assert any(r["cp_hist"].get("2") for r in whole["steps"].values()), whole["steps"]
    for key in ("loss", "grad_norm", "cp_hist"):
        assert resumed["steps"][3][key] == whole["steps"][3][key], f"step-3 {key}"
    lora_b = [v for n, v in whole["model"].items() if "lora_B" in n]
    assert lora_b and any(float(v.abs().max()) > 0 for v in lora_b)
    assert whole["trainer"]["optimizer"]["state"], "no AdamW moments in trainer.pt"
    assert whole["trainer"]["step"] == resumed["trainer"]["step"] == 3
    # trainer.pt's "rng": torch's global generator continues exactly (the data iterator's workers
    # are seeded from the data seed, dit.batching.list_loader, not from it). Python's and numpy's
    # are left out: they are never seeded, so they differ between any two runs, and no step draws
    # from them (clips and noise come from per-step generators, dit/clips.py, dit/flow.py)
    for run in (whole, resumed):
        run["rng"] = run["trainer"].pop("rng")["torch"]
    assert torch.equal(whole["rng"], resumed["rng"]), "torch's global generator after the resume"
    for key in ("model", "ema", "export", "trainer"):  # trainer: AdamW moments, LR schedule, step
        _equal(whole[key], resumed[key], key)
