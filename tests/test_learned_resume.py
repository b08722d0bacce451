"""A resumed run keeps its learned cost model, in every checkpoint format (issue 40).

Two gloo ranks train 2 dynamic steps with the default learning (``hardware=auto``,
``learn_costs=true``) and save at step 2, in each format the one checkpoint path
(``DistributedTrainer.save``) writes: FSDP per_step by the sync and by the async (DCP ``async_save``)
path, replicated weights (rank 0's checkpoint), and pipeline stages (PP 2 x 1, stage files). The checkpoint must hold the learner's state (``cost_learning.json``) with the
micro-batches it observed, and a trainer resumed from it must start with exactly that state: the
same observations, refit count and prices, so it plans as the uninterrupted run would.

Planted and seen to fail: ``FSDPTrainer.save`` dropping ``checkpoint_extras`` (main before this test:
no ``cost_learning.json`` in FSDP checkpoints, so a resume restarted learning from the prior); the
async path's ``_write_export`` ignoring its extra files; the stage checkpoint skipping the extras.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
from conftest import tiny_overrides

from dit.config import load_config
from dynamic_cp.runtime.cost_learning import PROFILE_FILE, STATE_FILE

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


FORMATS = {
    "fsdp-sync": {"parallel.fsdp": "per_step"},
    "fsdp-async": {"parallel.fsdp": "per_step", "train.async_checkpoint": "true"},
    "replicated": {"parallel.fsdp": "none"},
    # one rank a stage: no CP, so the cap must hold the largest clip (72 tokens)
    "stages": {"parallel.fsdp": "none", "parallel.pp_size": 2, "parallel.cap_tokens": 96},
}


def worker(rank: int, world_size: int, out: str, case: str) -> dict:
    import torch.distributed as dist

    from dynamic_cp.runtime.launch import train_distributed, trainer_class

    try:
        items = {
            "parallel.mode": "dynamic",
            "parallel.cap_tokens": 48,  # a 3-frame 8x12 clip is 72 tokens: some micro-batches need CP 2
            "train.max_steps": 2,
            "train.checkpoint_every": 2,
            **FORMATS[case],
        }
        cfg = load_config(TINY, tiny_overrides(Path(out), **items))
        train_distributed(cfg, dist.group.WORLD)  # waits for an async save before it returns
        step_dir = Path(out) / "run" / "checkpoints" / "step_000002"
        saved = json.loads((step_dir / STATE_FILE).read_text())
        resumed = trainer_class(cfg, dist.group.WORLD)(cfg, dist.group.WORLD, resume=str(step_dir))
        return {"saved": saved, "resumed": resumed.learner.state_dict(), "step": resumed.step}
    except Exception:  # the spawn error shows only the last frame; keep the whole trace
        return {"error": traceback.format_exc()}


@pytest.mark.parametrize("case", list(FORMATS))
def test_a_resumed_run_starts_from_the_saved_learned_costs(tmp_path, case):
    from dynamic_cp.runtime.testing import run_gloo

    results = run_gloo(worker, 2, str(tmp_path), case, timeout_s=300)
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["saved"]["observations"], "the run observed no micro-batch: the test would be vacuous"
        assert r["step"] == 2
        assert r["resumed"] == r["saved"]
    assert (tmp_path / "run" / PROFILE_FILE).exists()  # the newest learned profile, for simulate --hardware
