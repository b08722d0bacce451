"""Cost model: the published FLOP ratios, monotonicity, communication, memory and profiles."""

from __future__ import annotations

import numpy as np
import pytest

from dynamic_cp.planning.cost_model import MODELS, CostModel, Hardware, builtin_profiles

CM = CostModel.from_dims(d=1536, layers=30, ffn=8960, heads=12, text_tokens=512, hardware="h100")


@pytest.mark.parametrize("tokens, share", [(8_192, 0.26), (33_000, 0.58), (75_000, 0.76)])
def test_attention_share_matches_design_at_wan14b_width(tokens, share):
    """DESIGN.md: at Wan-14B width attention is 26% / 58% / 76% of training FLOPs."""
    cm = CostModel(MODELS["wan-14b"], Hardware.load("h100"))
    linear = cm._lin_per_token * tokens
    attn = cm._attn_coef * tokens * tokens
    assert attn / (attn + linear) == pytest.approx(share, abs=0.03)


def test_profiles_load_and_round_trip(tmp_path):
    assert {"h100", "h200", "a100"} <= set(builtin_profiles())
    hw = Hardware.load("h100")
    assert hw.peak_flops == pytest.approx(989e12) and hw.gpus_per_node == 8
    assert Hardware.load("h200").memory_bytes > hw.memory_bytes
    path = tmp_path / "mine.yaml"
    path.write_text(hw.to_yaml())
    assert Hardware.load(str(path)) == hw
    assert CostModel.from_dims(1536, 30, 8960, 12, hardware=str(path)).hw == hw


def test_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware profile 'h900'"):
        Hardware.load("h900")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\npeak_flops: 1.0\n")
    with pytest.raises(ValueError, match="lacks keys"):
        Hardware.load(str(bad))
    with pytest.raises(ValueError, match="unknown model"):
        CostModel.from_name("wan-99b")


def test_time_grows_with_length_and_is_superlinear():
    t = [CM.micro_batch_time([n], 1) for n in (1_000, 10_000, 100_000)]
    assert t[0] < t[1] < t[2]
    assert t[2] / t[1] > 10  # quadratic attention


def test_packing_beats_one_by_one_and_cp_splits_work():
    short = [256] * 16
    assert CM.micro_batch_time(short, 1) < sum(CM.micro_batch_time([n], 1) for n in short)
    assert CM.micro_batch_time([75_600], 4) < CM.micro_batch_time([75_600], 1) / 3
    # short clips gain little from CP and pay communication: CP on 8 ranks wastes rank-seconds
    assert 8 * CM.micro_batch_time(short, 8) > CM.micro_batch_time(short, 1)


def test_node_boundary_cliff():
    inside = CM.micro_batch_time([50_000], 8, cross_node=False)
    across = CM.micro_batch_time([50_000], 8, cross_node=True)
    assert across > inside
    assert CM.micro_batch_time([50_000], 16) > CM.micro_batch_time([50_000], 16, cross_node=False)


def test_comm_layouts():
    assert CM.cp_layout(1) == [(1, 1)]
    assert (4, 2) in CM.cp_layout(8) and (8, 1) not in CM.cp_layout(8)  # 12 heads: Ulysses <= 4
    ring = CostModel(CM.dims, CM.hw, comm="ring")
    assert ring.cp_layout(8) == [(1, 8)]
    with pytest.raises(ValueError, match="does not divide heads=12"):
        CostModel(CM.dims, CM.hw, comm="ulysses").cp_layout(8)
    with pytest.raises(ValueError, match="comm="):
        CostModel(CM.dims, CM.hw, comm="nccl")


def test_vectorized_matches_scalar():
    batches = [[256, 8448], [75_600], [32_760, 256, 256]]
    cps = [1, 4, 2]
    many = CM.micro_batch_times(batches, cps)
    assert many == pytest.approx([CM.micro_batch_time(b, c) for b, c in zip(batches, cps)])
    assert CM.micro_batch_time([], 2) == 0.0


def test_sample_times_add_up_for_a_full_pack():
    clips = [8448] * 3
    cap = sum(clips)
    assert CM.sample_times(clips, 1, cap).sum() == pytest.approx(CM.micro_batch_time(clips, 1), rel=0.02)


def test_ideal_time_is_a_floor():
    for n in (256, 8448, 75_600):
        assert CM.ideal_time([n])[0] < CM.micro_batch_time([n], 1)
    assert np.all(CM.ideal_time([256, 512]) > 0)


def test_token_cap():
    cap = CM.token_cap()
    assert 5_000 < cap < 60_000  # Wan-1.3B on 80 GB without checkpointing: tens of thousands
    assert CM.token_cap(activation_checkpointing=True) > 5 * cap
    assert CM.token_cap(shard_world=64) > cap
    big = CostModel.from_name("wan-14b")
    with pytest.raises(ValueError, match="do not fit"):
        big.token_cap(shard_world=1)
    assert big.token_cap(shard_world=64) > 0
    with pytest.raises(ValueError, match="memory_fraction"):
        CM.token_cap(memory_fraction=0)


def test_fit_saturating_recovers_curve():
    from dynamic_cp.calibrate import fit_saturating

    n = np.array([64, 256, 1024, 4096, 16384])
    best, half = fit_saturating(n, 5e12 * n / (n + 700))
    assert best == pytest.approx(5e12, rel=1e-6) and half == pytest.approx(700, rel=1e-6)


def test_per_clip_overhead_is_charged_once_per_clip():
    import dataclasses

    with_clip = CostModel(CM.dims, dataclasses.replace(CM.hw, clip_overhead_s=0.01), CM.comm)
    for lengths, cp in (([4096], 1), ([256] * 5, 1), ([30_000, 256, 256], 4)):
        extra = with_clip.micro_batch_time(lengths, cp) - CM.micro_batch_time(lengths, cp)
        assert extra == pytest.approx(0.01 * len(lengths))
    L = np.array([256, 4096, 30_000])
    np.testing.assert_allclose(with_clip.sample_times(L, 2, 8000) - CM.sample_times(L, 2, 8000), 0.01)
    assert Hardware.load("h100").clip_overhead_s == 0  # older profiles without the key still load


def test_calibrate_writes_a_loadable_profile(tmp_path):
    from dynamic_cp.calibrate import main

    out = tmp_path / "cpu.yaml"
    assert (
        main(["--out", str(out), "--quick", "--d", "64", "--heads", "2", "--layers", "2", "--device", "cpu"])
        == 0
    )
    hw = Hardware.load(str(out))
    assert hw.peak_flops > 0 and 0 < hw.gemm_efficiency <= 1 and hw.micro_batch_overhead_s > 0
    assert hw.clip_overhead_s > 0  # CPU attention makes one SDPA call per clip: each clip costs time
    cm = CostModel.from_dims(64, 2, 256, 2, hardware=str(out))
    assert cm.micro_batch_time([512], 1) > 0
    assert main(["--out", str(out), "--d", "65", "--heads", "2"]) == 2
