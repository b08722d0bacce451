import os

import pytest
import torch

# Two cores: one thread per process keeps spawned-process tests from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def tiny_overrides(tmp_path, **extra) -> list[str]:
    """Overrides that make configs/tiny.yaml run in seconds."""
    items = {
        "output_dir": str(tmp_path / "run"),
        "model.overrides": "{num_layers: 2, ffn_dim: 128}",
        "data.num_clips": 64,
        "data.num_val_clips": 2,
        "data.frame_counts": "[1, 3]",
        "data.resolutions": "[[8, 8], [8, 12]]",
        "train.global_batch_size": 4,
        "train.micro_batch_tokens": 64,
        "train.log_every": 1,
        "train.val_every": 2,
        "train.warmup_steps": 1,
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


@pytest.fixture
def tiny_overrides_fn():
    return tiny_overrides
