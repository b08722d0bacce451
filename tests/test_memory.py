"""Memory model per FSDP mode: DESIGN.md's Wan2.1-14B figures, monotonicity, and auto's choice."""

from __future__ import annotations

import pytest

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.memory import (
    FSDP_MODES,
    choose_fsdp_mode,
    lora_params,
    memory_breakdown,
    mode_token_cap,
)
from dynamic_cp.planning.model_dims import MODELS

GB = 1e9
P14 = MODELS["wan-14b"].num_params


def test_wan14b_matches_design():
    assert P14 / GB == pytest.approx(14.0, abs=0.06)
    # replicated, no ZeRO: bf16 28, fp32 master 56, AdamW 112, fp32 grads 56 GB
    none = memory_breakdown("wan-14b", "none", 64, shard_optimizer=False)
    assert none.compute_weights / GB == pytest.approx(28.1, abs=0.1)
    assert none.master_weights / GB == pytest.approx(56.2, abs=0.2)
    assert none.optimizer / GB == pytest.approx(112.4, abs=0.3)
    assert none.gradients / GB == pytest.approx(56.2, abs=0.2)
    for mode in ("per_step", "per_layer"):
        m = memory_breakdown("wan-14b", mode, 64)
        resting = m.master_weights + m.optimizer + 4 * P14 / 64  # (4 + 8 + 4) bytes x P / W
        assert resting / GB == pytest.approx(3.5, abs=0.02)
    # per_layer gathers two layers of bf16 weights, ~0.7 GB each over 40 layers
    assert memory_breakdown("wan-14b", "per_layer", 64).compute_weights / GB == pytest.approx(1.4, abs=0.01)
    # per_step holds all 28 GB of bf16 weights plus an fp32 (56 GB) or bf16 (28 GB) accumulator
    ps = memory_breakdown("wan-14b", "per_step", 64)
    assert ps.compute_weights / GB == pytest.approx(28.1, abs=0.1)
    assert (ps.gradients - 4 * P14 / 64) / GB == pytest.approx(56.2, abs=0.2)
    ps2 = memory_breakdown("wan-14b", "per_step", 64, grad_accum_bytes=2)
    assert (ps2.gradients - 4 * P14 / 64) / GB == pytest.approx(28.1, abs=0.1)


def test_activations_match_cost_model_and_cap():
    cm = CostModel.from_name("wan-14b", "h100")
    for ckpt in (False, True):
        m = memory_breakdown("wan-14b", "per_layer", 64, 1000, ckpt)
        assert m.activations == pytest.approx(1000 * cm.activation_bytes_per_token(ckpt))
        cap = mode_token_cap(m, 80 * GB)
        fill = memory_breakdown("wan-14b", "per_layer", 64, cap, ckpt).total
        assert fill <= 0.9 * 80 * GB < fill + m.activations_per_token


def test_sharding_only_saves_memory():
    for W in (4, 8, 64):  # at W=2 per_step (8P + 6P) only ties none with ZeRO-1 (10P + 4P)
        for ckpt in (False, True):
            s = [memory_breakdown("wan-1.3b", m, W, 4096, ckpt).total for m in FSDP_MODES]
            assert s[0] > s[1] > s[2], (W, ckpt, s)
    # more ranks, fewer bytes each
    assert (
        memory_breakdown("wan-14b", "per_layer", 128).total
        < memory_breakdown("wan-14b", "per_layer", 64).total
    )


def test_lora_is_frozen_base_plus_small_adapters():
    m = memory_breakdown("wan-14b", "lora", 64, lora_rank=16)
    assert lora_params(MODELS["wan-14b"], 16) < 0.01 * P14
    assert 2 * P14 < m.states < 2 * P14 + 20 * lora_params(MODELS["wan-14b"], 16)


def test_choose_fsdp_mode():
    # 14B on 80 GB: neither replicated nor per_step (fp32 accumulator) fits; per_layer does
    mode, nbytes, cap = choose_fsdp_mode("wan-14b", 64, None, 80 * GB, True)
    assert mode == "per_layer" and nbytes <= 0.9 * 80 * GB and cap > 50_000
    mode, nbytes, cap = choose_fsdp_mode("wan-14b", 32, 16384, 80 * GB, True)
    assert (mode, cap) == ("per_layer", 16384)
    assert nbytes == pytest.approx(memory_breakdown("wan-14b", "per_layer", 32, 16384, True).total)
    # 1.3B fits replicated; a cap too large for replication moves to sharding
    assert choose_fsdp_mode("wan-1.3b", 8, 4096, 80 * GB, False)[0] == "none"
    none_cap = mode_token_cap(memory_breakdown("wan-1.3b", "none", 8), 80 * GB)
    assert choose_fsdp_mode("wan-1.3b", 8, none_cap + 1, 80 * GB, False)[0] == "per_step"
    # one rank: nothing to shard
    with pytest.raises(ValueError, match="no fsdp mode fits"):
        choose_fsdp_mode("wan-14b", 1, None, 80 * GB, True)


def test_errors():
    with pytest.raises(ValueError, match="fsdp mode"):
        memory_breakdown("wan-14b", "zero3", 8)
    with pytest.raises(ValueError, match="unknown model"):
        memory_breakdown("wan-99b", "none", 8)
    with pytest.raises(ValueError, match="token_cap"):
        choose_fsdp_mode("wan-14b", 8, 0, 80 * GB, True)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        choose_fsdp_mode("wan-14b", 8, 10**7, 80 * GB, False)


def test_wan14b_config_fits_80gb_h100s():
    from dit.config import load_config
    from dynamic_cp.planning.hardware import Hardware

    cfg = load_config("configs/wan-14b-finetune.yaml")
    hw = Hardware.load(cfg.parallel.hardware)
    cap = cfg.parallel.cap_tokens or cfg.train.micro_batch_tokens
    for world in (32, 64):  # the launch comment's 4 x 8 GPUs, and 8 x 8
        mode, nbytes, got = choose_fsdp_mode(
            cfg.model.size, world, cap, hw.memory_bytes, cfg.model.gradient_checkpointing
        )
        assert (mode, got) == ("per_layer", cap) and nbytes <= 0.9 * hw.memory_bytes == 0.9 * 80 * GB
