"""dit/checkpoint.py on its own: pruning, stale temp directories, resolving paths, weights, RNG.

Fast (no training): a stand-in model writes a marker file next to a one-tensor safetensors where
``save_pretrained`` would write its weights, so each test sees exactly which step's files ended where.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dit.checkpoint import (
    load_trainer_state,
    load_weights,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


class FakeModel:
    def __init__(self, tag: str):
        self.tag = tag

    def save_pretrained(self, directory):
        directory.mkdir(parents=True)
        (directory / "weights.txt").write_text(self.tag)
        save_file({"w": torch.zeros(2)}, directory / "diffusion_pytorch_model.safetensors")


def _save(root, step, keep=3, ema=True):
    return save_checkpoint(
        root, step, FakeModel(f"model {step}"), FakeModel(f"ema {step}") if ema else None,
        {"optimizer": {}, "lr_schedule": {}, "bad_steps": step % 2}, {"seed": 1}, keep,
    )  # fmt: skip


def _steps(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "latest")


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_pruning_keeps_the_newest(tmp_path, keep):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5):
        _save(root, step, keep)
    assert _steps(root) == [f"step_{s:06d}" for s in range(6 - keep, 6)]
    assert (root / "latest").read_text() == "step_000005\n"


def test_pruning_orders_by_step_not_by_saving_order(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (30, 100, 2000):
        _save(root, step, keep=2)
    assert _steps(root) == ["step_000100", "step_002000"]


def test_stale_temp_directory_is_replaced_and_others_left_alone(tmp_path):
    """A run killed while saving leaves step_N.tmp: the next save of N starts clean; a stale .tmp of
    another step neither counts as a checkpoint nor gets pruned as one."""
    root = tmp_path / "checkpoints"
    (root / "step_000003.tmp" / "model").mkdir(parents=True)
    (root / "step_000003.tmp" / "junk").write_text("half-written")
    (root / "step_000009.tmp").mkdir()
    for step in (1, 2, 3):
        _save(root, step, keep=2)
    assert _steps(root) == ["step_000002", "step_000003", "step_000009.tmp"]
    step3 = root / "step_000003"
    assert sorted(p.name for p in step3.iterdir()) == ["config.yaml", "ema", "model", "trainer.pt"]
    assert (step3 / "model" / "weights.txt").read_text() == "model 3"
    assert resolve_checkpoint(tmp_path) == step3


def test_saving_a_step_again_replaces_it(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 4)
    save_checkpoint(root, 4, FakeModel("second"), None, {}, {}, keep=3)
    assert (root / "step_000004" / "model" / "weights.txt").read_text() == "second"
    assert not (root / "step_000004" / "ema").exists()  # nothing of the first attempt is left
    assert _steps(root) == ["step_000004"]


def test_trainer_state_round_trip(tmp_path):
    step_dir = _save(tmp_path / "checkpoints", 7)
    state = load_trainer_state(step_dir)
    assert (
        state["step"] == 7 and state["bad_steps"] == 1 and set(state["rng"]) == {"python", "numpy", "torch"}
    )
    assert (step_dir / "config.yaml").read_text() == "seed: 1\n"


def test_resolve_checkpoint_accepts_run_checkpoints_and_step_directories(tmp_path):
    _save(tmp_path / "checkpoints", 1)
    newest = _save(tmp_path / "checkpoints", 2)
    assert resolve_checkpoint(tmp_path) == newest
    assert resolve_checkpoint(str(tmp_path / "checkpoints")) == newest
    old = tmp_path / "checkpoints" / "step_000001"
    assert resolve_checkpoint(old) == old  # a step directory holds trainer.pt
    (old / "trainer.pt").unlink()
    assert resolve_checkpoint(old) == old  # ... or just model/ (an exported or copied checkpoint)


def test_resolve_checkpoint_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint path .*nowhere does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty holds no checkpoint .*checkpoints/latest"):
        resolve_checkpoint(tmp_path / "empty")


def test_load_weights_from_one_file_or_shards_and_refuses_none(tmp_path):
    model = torch.nn.Linear(3, 2)
    want = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.tensor([7.0, 8.0])}
    one = tmp_path / "one"
    one.mkdir()
    save_file(want, one / "diffusion_pytorch_model.safetensors")
    load_weights(model, one)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())

    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({"weight": want["weight"] + 1}, shards / "a.safetensors")
    save_file({"bias": want["bias"] + 1}, shards / "b.safetensors")
    index = {"weight_map": {"weight": "a.safetensors", "bias": "b.safetensors"}}
    (shards / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    load_weights(model, shards)
    assert torch.equal(model.bias, want["bias"] + 1) and torch.equal(model.weight, want["weight"] + 1)

    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="holds no safetensors weights"):
        load_weights(model, tmp_path / "none")


def test_rng_state_round_trip():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1)) == a


def test_first_save_creates_the_missing_output_directories(tmp_path):
    """A fresh run's output_dir does not exist yet: the first save creates output_dir/checkpoints."""
    root = tmp_path / "runs" / "new_run" / "checkpoints"
    final = _save(root, 1)
    assert final == root / "step_000001" and (root / "latest").read_text() == "step_000001\n"


def test_config_yaml_keeps_the_configs_key_order(tmp_path):
    """config.yaml is the resolved config as written, for a person to read: keys in the config's own
    order (model before data before train), not alphabetised."""
    config = {"model": {"width": 8}, "data": {"fps": 16}, "train": {"lr": 0.001, "batch": 2}}
    final = save_checkpoint(tmp_path, 1, FakeModel("m"), None, {"lr_schedule": {}}, config, keep=1)
    text = (final / "config.yaml").read_text()
    assert text == "model:\n  width: 8\ndata:\n  fps: 16\ntrain:\n  lr: 0.001\n  batch: 2\n"


class NotPlainData:
    """Stands for any pickled object: loading it with full unpickling would run its class's code."""

    def __init__(self, value):
        self.value = value


def test_trainer_state_with_a_pickled_object_is_refused(tmp_path):
    torch.save({"lr_schedule": {}, "step": 3, "rng": {}, "extra": NotPlainData(1)}, tmp_path / "trainer.pt")
    with pytest.raises(ValueError, match=r"holds a pickled Python object \(.*NotPlainData\)"):
        load_trainer_state(tmp_path)


def test_trainer_state_needs_exactly_the_resume_keys_and_no_more(tmp_path):
    """lr_schedule, step and rng are required; the optimizer may live elsewhere (FSDP shards)."""
    torch.save({"lr_schedule": {"last_epoch": 3}, "step": 3, "rng": {}}, tmp_path / "trainer.pt")
    assert load_trainer_state(tmp_path) == {"lr_schedule": {"last_epoch": 3}, "step": 3, "rng": {}}
    for bad in ({"lr_schedule": {}, "step": 3}, {"optimizer": {}, "step": 3, "rng": {}}, [1, 2, 3]):
        torch.save(bad, tmp_path / "trainer.pt")
        with pytest.raises(ValueError, match="is not a trainer state"):
            load_trainer_state(tmp_path)
