import os

import pytest
import torch

# Two cores: one thread per process keeps spawned-process tests from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# ...and it stays so: train.main and sample.main, called in this process, would otherwise choose
# their threads from the machine's load (data/cpu_threads.py), so a reference run and the run compared
# with it bitwise could compute with different thread counts. OMP_NUM_THREADS is the user's choice
# they keep; spawned commands inherit it (tests that need 1, as torchrun sets, still set it).
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


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


def save_small_clip(path) -> str:
    """A small random CLIPVisionModel (12 wide, 32 px, 16 px patches: 5 tokens) and its processor, saved
    where data.image_encoder_path can point: a stand-in for Wan2.1 I2V's ViT-H/14."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=12,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
    )
    CLIPVisionModel(config).save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        path
    )
    return str(path)
