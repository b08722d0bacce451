"""Cost model: the published FLOP ratios, monotonicity, communication, memory and profiles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.hardware import Hardware, builtin_profiles
from dynamic_cp.planning.memory import activation_bytes_per_token
from dynamic_cp.planning.model_dims import MODELS, ModelDims

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


def test_decode_rate_is_optional_and_scales_with_the_cluster():
    """``vae_decode_s_per_pixel`` (sampling's VAE decode): absent from a profile -> 0, decodes not
    priced; ``scaled`` multiplies it as it does every other time. Planted: a default of 1, and the
    rate left out of ``scaled``: both fail."""
    assert TOY.vae_decode_s_per_pixel == 0  # TOY (below) is built without the key
    hw = dataclasses.replace(TOY, vae_decode_s_per_pixel=2e-7)
    assert CostModel(TOY_DIMS, hw).scaled(3.0).hw.vae_decode_s_per_pixel == pytest.approx(6e-7)


# A made-up GPU with round numbers, so the docstring's formulas can be worked by hand below.
TOY = Hardware(
    name="toy", peak_flops=1e12, gemm_efficiency=0.5, gemm_half_tokens=1000.0, attention_efficiency=0.25,
    attention_half_tokens=1000.0, intra_node_bandwidth=1e9, inter_node_bandwidth=1e8,
    intra_node_latency_s=1e-3, inter_node_latency_s=1e-2, gpus_per_node=4, micro_batch_overhead_s=0.1,
    memory_bytes=1e6, clip_overhead_s=0.01,
)  # fmt: skip
# d=10, 2 layers, FFN 40, 4 heads, 1000 text tokens. Per the module docstring (training = 3x / 3.5x forward):
#   linear     3 * 2 * (12 * 10^2 + 4 * 10 * 40) = 16_800 FLOPs per token
#   text k/v   3 * 2 * 4 * 1000 * 10^2 = 2.4e6 FLOPs per clip
#   attention  3.5 * 2 * 4 * 10 = 280 FLOPs per (L^2 + L * 1000) of a clip of L tokens
TOY_DIMS = ModelDims(d=10, layers=2, ffn=40, heads=4, text_tokens=1000)
LIN, TEXT, ATT = 16_800, 2.4e6, 280


def gemm(n):  # peak * best * n / (n + half)
    return 1e12 * 0.5 * n / (n + 1000)


def attn_rate(q):
    return 1e12 * 0.25 * q / (q + 1000)


def compute(lengths, cp):
    """Overheads + linear + text + attention seconds per rank (the docstring's first three lines)."""
    n, b = sum(lengths) / cp, len(lengths)
    attention = sum(ATT * (L * L + L * 1000) / cp / attn_rate(L / cp) for L in lengths)
    return 0.1 + 0.01 * b + LIN * n / gemm(n) + TEXT * b / gemm(1000 * b) + attention


def test_micro_batch_time_worked_by_hand_on_one_rank():
    toy = CostModel(TOY_DIMS, TOY)
    # one clip of 1000 tokens: gemm rate 2.5e11, attention rate 1.25e11
    one = 0.1 + 0.01 + 16_800 * 1000 / 2.5e11 + 2.4e6 / 2.5e11 + 280 * 2e6 / 1.25e11
    assert toy.micro_batch_time([1000], 1) == pytest.approx(one, rel=1e-12)
    assert compute([1000], 1) == pytest.approx(one, rel=1e-12)
    # 1000 + 3000 packed: one GEMM over 4000 tokens, text GEMMs over 2 x 1000 tokens, attention per clip
    two = (
        0.1 + 2 * 0.01 + 16_800 * 4000 / 4e11 + 2 * 2.4e6 / (0.5e12 * 2000 / 3000)
        + 280 * 2e6 / 1.25e11 + 280 * (9e6 + 3e6) / 1.875e11
    )  # fmt: skip
    assert toy.micro_batch_time([1000, 3000], 1) == pytest.approx(two, rel=1e-12)
    # vectorised, with an empty micro-batch in the middle
    many = toy.micro_batch_times([[1000], [], [1000, 3000]], [1, 2, 1])
    assert many.tolist() == pytest.approx([one, 0.0, two], rel=1e-12)
    assert toy.micro_batch_times([[], []], [1, 2]).tolist() == [0.0, 0.0]
    assert toy.micro_batch_times([], []).tolist() == []
    with pytest.raises(ValueError, match="cp=0"):
        toy.micro_batch_time([1000], 0)


def ulysses(u, r, n, cp, cross):
    """8 all-to-alls per layer moving (u-1)/u of the rank's n x d bf16 activations; across nodes when
    u spans nodes, or when the group spans nodes and there is no ring (u = cp)."""
    if u == 1:
        return 0.0
    far = u > 4 or (cross is True and r == 1)
    lat, bw = (1e-2, 1e8) if far else (1e-3, 1e9)
    return 8 * 2 * (lat + n * 10 * 2 * (u - 1) / u / bw)


def ring(r, n, cp, cross, attention):
    """r - 1 passes of K and V (4 n d bytes) per layer, 3x for fwd+bwd, hidden behind attention."""
    if r == 1:
        return 0.0
    far = cp > 4 if cross is None else cross
    lat, bw = (1e-2, 1e8) if far else (1e-3, 1e9)
    return max(3 * 2 * (r - 1) * (lat + 4 * n * 10 / bw) - attention, 0.0)


@pytest.mark.parametrize(
    "lengths, cp, comm, cross, layouts",
    [
        ([4000], 2, "ulysses", None, [(2, 1)]),
        ([4000], 2, "ulysses", True, [(2, 1)]),
        ([4000], 2, "ring", True, [(1, 2)]),
        ([4000], 2, "ring", None, [(1, 2)]),  # intra-node ring fully hidden behind attention
        ([4000], 4, "ulysses", None, [(4, 1)]),  # u = gpus_per_node: still inside a node
        ([1000, 3000], 4, "auto", True, [(1, 4), (2, 2), (4, 1)]),
        ([1000], 4, "auto", None, [(1, 4), (2, 2), (4, 1)]),
        ([8000], 8, "auto", None, [(1, 8), (2, 4), (4, 2)]),  # ring spans nodes, Ulysses does not
        ([8000], 8, "auto", False, [(1, 8), (2, 4), (4, 2)]),
        ([8000], 8, "ring", False, [(1, 8)]),
        ([64000], 8, "auto", True, [(1, 8), (2, 4), (4, 2)]),
    ],
)
def test_micro_batch_time_charges_the_cheapest_documented_layout(lengths, cp, comm, cross, layouts):
    toy = CostModel(TOY_DIMS, TOY, comm=comm)
    assert toy.cp_layout(cp) == layouts
    n = sum(lengths) / cp
    attention = sum(ATT * (L * L + L * 1000) / cp / attn_rate(L / cp) for L in lengths)
    exposed = {(u, r): ulysses(u, r, n, cp, cross) + ring(r, n, cp, cross, attention) for u, r in layouts}
    best = min(exposed.values())
    assert toy.micro_batch_time(lengths, cp, cross) == pytest.approx(compute(lengths, cp) + best, rel=1e-12)
    # layout() names the split that was charged, ties going to the larger Ulysses degree
    assert toy.layout(lengths, cp, cross) == max(lay for lay, t in exposed.items() if t == best)


def test_comm_worked_by_hand_for_two_ranks():
    # 4000 tokens on 2 ranks: 2000 per rank; attention per rank 280 * 2e7 / 2 / (0.25e12 * 2000 / 3000)
    attention = 280 * 2e7 / 2 / (0.25e12 * 2000 / 3000)
    assert attention == pytest.approx(0.0168)
    uly_in = 16 * (1e-3 + 2000 * 10 * 2 * 0.5 / 1e9)  # 0.01632 s
    ring_across = 6 * (1e-2 + 4 * 2000 * 10 / 1e8) - attention  # 0.0648 - 0.0168 s
    base = compute([4000], 2)
    assert CostModel(TOY_DIMS, TOY, "ulysses").micro_batch_time([4000], 2) == pytest.approx(base + uly_in)
    assert CostModel(TOY_DIMS, TOY, "ring").micro_batch_time([4000], 2, True) == pytest.approx(base + 0.048)
    assert ring_across == pytest.approx(0.048)
    assert CostModel(TOY_DIMS, TOY, "ring").micro_batch_time([4000], 2) == pytest.approx(base)  # hidden


def test_layout_is_what_the_forced_comm_setting_would_charge():
    """1000 tokens on 4 ranks: the ring (latency 3 x 3 calls per layer, hidden partly) beats Ulysses."""
    auto = CostModel(TOY_DIMS, TOY)
    assert auto.layout([1000], 4) == (1, 4)
    assert auto.micro_batch_time([1000], 4) == pytest.approx(
        CostModel(TOY_DIMS, TOY, "ring").micro_batch_time([1000], 4)
    )
    assert auto.micro_batch_time([1000], 4) < CostModel(TOY_DIMS, TOY, "ulysses").micro_batch_time([1000], 4)
    assert auto.layout([1000], 1) == (1, 1)
    # free links: every split costs nothing and the tie goes to the larger Ulysses degree
    free = CostModel(TOY_DIMS, dataclasses.replace(
        TOY, intra_node_latency_s=0.0, inter_node_latency_s=0.0, intra_node_bandwidth=float("inf"),
        inter_node_bandwidth=float("inf")))  # fmt: skip
    assert free.layout([8000], 8) == (4, 2) and free.layout([8000], 2) == (2, 1)
    assert free.micro_batch_time([8000], 8) == pytest.approx(compute([8000], 8))


def test_cp_layout_lists_every_ulysses_degree_dividing_cp_and_heads():
    assert CM.cp_layout(2) == [(1, 2), (2, 1)]
    assert CM.cp_layout(4) == [(1, 4), (2, 2), (4, 1)]
    assert CM.cp_layout(6) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert CM.cp_layout(8) == [(1, 8), (2, 4), (4, 2)]  # 12 heads: no Ulysses 8
    assert CM.cp_layout(16) == [(1, 16), (2, 8), (4, 4)]
    assert CostModel(CM.dims, CM.hw, comm="ulysses").cp_layout(4) == [(4, 1)]
    for comm in ("auto", "ring", "ulysses"):
        for pair in CostModel(CM.dims, CM.hw, comm).cp_layout(4):
            assert all(type(x) is int for x in pair)  # the runtime builds process groups of these sizes


def test_sample_times_worked_by_hand():
    toy = CostModel(TOY_DIMS, TOY, "ulysses")
    # 1000 tokens in packs of 4000 on one rank: a quarter of the overhead, the pack's GEMM rate
    quarter = 0.1 * 0.25 + 0.01 + 16_800 * 1000 / 4e11 + 2.4e6 / 2.5e11 + 280 * 2e6 / 1.25e11
    assert toy.sample_times([1000], 1, 4000)[0] == pytest.approx(quarter, rel=1e-12)
    # 2000 tokens on 2 Ulysses ranks in packs of 2000 per rank: half the overhead and half the latency
    half = (
        0.1 * 0.5 + 0.01 + 16_800 * 1000 / gemm(2000) + 2.4e6 / 2.5e11
        + 280 * (4e6 + 2e6) / 2 / 1.25e11 + 16 * (0.5 * 1e-3 + 1000 * 10 * 2 * 0.5 / 1e9)
    )  # fmt: skip
    assert toy.sample_times([2000], 2, 2000)[0] == pytest.approx(half, rel=1e-12)
    # 8000 tokens on a ring of 8 ranks across nodes, in packs of 2000 per rank: half the overhead and
    # half of each ring pass's latency; 7 passes x 3 per layer, partly hidden behind 0.02016 s of attention
    ring8 = CostModel(TOY_DIMS, TOY, "ring")
    attention = 280 * (64e6 + 8e6) / 8 / 1.25e11
    across = (
        0.1 * 0.5 + 0.01 + 16_800 * 1000 / gemm(2000) + 2.4e6 / 2.5e11 + attention
        + 3 * 2 * 7 * (0.5 * 1e-2 + 4 * 1000 * 10 / 1e8) - attention
    )  # fmt: skip
    assert ring8.sample_times([8000], 8, 2000)[0] == pytest.approx(across, rel=1e-12)
    # a clip larger than the pack is a whole micro-batch: one overhead, its own GEMM rate
    assert toy.sample_times([8000], 1, 4000)[0] == pytest.approx(toy.micro_batch_time([8000], 1), rel=1e-12)


@pytest.mark.parametrize("length, cp, packed", [(1, 1, 0), (1000, 1, 1000), (4000, 2, 2000), (8000, 8, 1000)])
def test_a_clip_alone_in_its_pack_costs_its_micro_batch(length, cp, packed):
    for comm in ("auto", "ring"):
        toy = CostModel(TOY_DIMS, TOY, comm)
        assert toy.sample_times([length], cp, packed)[0] == pytest.approx(
            toy.micro_batch_time([length], cp), rel=1e-12
        )


def test_ideal_time_worked_by_hand():
    toy = CostModel(TOY_DIMS, TOY)
    want = [(16_800 * L + 2.4e6) / 5e11 + 280 * (L * L + L * 1000) / 2.5e11 for L in (1000, 3000)]
    assert toy.ideal_time([1000, 3000]).tolist() == pytest.approx(want, rel=1e-12)


def test_hardware_field_checks():
    for ok in (
        dict(gemm_efficiency=1.0), dict(attention_efficiency=1.0), dict(gpus_per_node=1),
        dict(intra_node_latency_s=0.0), dict(clip_overhead_s=0.0), dict(gemm_half_tokens=0.0),
    ):  # fmt: skip
        assert dataclasses.replace(TOY, **ok).name == "toy"  # accepted
    for bad, match in (
        (dict(gemm_efficiency=0.0), "must be in \\(0, 1\\]"),
        (dict(gemm_efficiency=1.5), "must be in \\(0, 1\\]"),
        (dict(attention_efficiency=0.0), "must be in \\(0, 1\\]"),
        (dict(attention_efficiency=1.5), "must be in \\(0, 1\\]"),
        (dict(gpus_per_node=0), "gpus_per_node=0 must be at least 1"),
        (dict(inter_node_latency_s=-1e-6), "non-negative number"),
        (dict(peak_flops="fast"), "non-negative number"),
    ):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(TOY, **bad)


def test_profiles_are_frozen_and_written_in_field_order(tmp_path):
    with pytest.raises(dataclasses.FrozenInstanceError):
        TOY.peak_flops = 2e12  # a profile is shared by every cost model built from it
    with pytest.raises(dataclasses.FrozenInstanceError):
        TOY_DIMS.d = 20
    text = TOY.to_yaml()
    # fields in declaration order, as in the shipped profiles
    assert list(yaml.safe_load(text)) == [f.name for f in dataclasses.fields(Hardware)]
    assert text.startswith("name: toy\npeak_flops: 1000000000000.0\n")
    path = tmp_path / "toy.profile"  # any existing file loads, whatever its suffix
    path.write_text(text)
    assert Hardware.load(str(path)) == TOY
    path.write_text("- h100\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        Hardware.load(str(path))


def test_model_dims_checks_defaults_and_parameter_count():
    assert ModelDims(10, 2, 40, 4).text_tokens == 512  # Wan pads captions to 512 umT5 tokens
    assert CostModel.from_dims(10, 2, 40, 4).dims.text_tokens == 512
    assert all(m.text_tokens == 512 for m in MODELS.values())
    assert ModelDims(1, 1, 1, 1, text_tokens=0).layers == 1  # the smallest shape, no text
    for bad in (dict(d=0), dict(layers=0), dict(heads=0), dict(ffn=0), dict(text_tokens=-1)):
        with pytest.raises(ValueError, match="must be positive"):
            ModelDims(**{**dict(d=10, layers=2, ffn=40, heads=4), **bad})
    # per block: self-attention 4 d^2, cross-attention 4 d^2, FFN 2 d f
    assert TOY_DIMS.num_params == 2 * (4 * 100 + 4 * 100 + 2 * 10 * 40) == 3200
    # plus the patch embedding and output projection: 4 * (16 + 16) values in and out per token
    assert MODELS["wan-1.3b"].num_params == 30 * (8 * 1536**2 + 2 * 1536 * 8960) + 128 * 1536  # 1.39e9
    # Wan2.2 TI2V-5B: 48 channels in and out of (1, 2, 2) patches, 3x Wan2.1's patch values; the
    # blocks plus patch layers are 4.91B of its 5.00B (text and time embeddings left out)
    ti2v = MODELS["wan2.2-ti2v-5b"]
    assert ti2v.patch_values == 4 * (48 + 48) == 384
    assert ti2v.num_params == 30 * (8 * 3072**2 + 2 * 3072 * 14336) + 384 * 3072
    linear = CostModel(ti2v, TOY)._lin_per_token
    assert linear == 3 * (30 * (12 * 3072**2 + 4 * 3072 * 14336) + 2 * 3072 * 384)  # per token, training


def test_activation_bytes_worked_by_hand():
    # a block keeps 16 d + 2 f bf16 values per token: (160 + 80) * 2 = 480 bytes
    assert activation_bytes_per_token(TOY_DIMS) == 2 * 480
    assert activation_bytes_per_token(TOY_DIMS, activation_checkpointing=True) == 2 * 10 * 2 + 480
    toy = CostModel(TOY_DIMS, TOY)
    assert toy.activation_bytes_per_token() == 960 and toy.activation_bytes_per_token(True) == 520


def test_token_cap_worked_by_hand():
    toy = CostModel(TOY_DIMS, TOY)
    # 3200 params: bf16 weights 2 B/param + fp32 master and Adam 14 B/param = 51_200 B unsharded
    assert toy.token_cap() == (0.9 * 1e6 - 51_200) // 960 == 884
    assert toy.token_cap(shard_world=4) == (0.9 * 1e6 - 6400 - 14 * 3200 / 4) // 960 == 919
    assert toy.token_cap(activation_checkpointing=True) == (0.9 * 1e6 - 51_200) // 520 == 1632
    assert toy.token_cap(memory_fraction=1.0) == (1e6 - 51_200) // 960 == 988
    exact = CostModel(TOY_DIMS, dataclasses.replace(TOY, memory_bytes=51_200 + 960))
    assert exact.token_cap(memory_fraction=1.0) == 1  # one token fits exactly
    tight = CostModel(TOY_DIMS, dataclasses.replace(TOY, memory_bytes=51_200 + 959))
    with pytest.raises(ValueError, match="do not fit"):
        tight.token_cap(memory_fraction=1.0)
    with pytest.raises(ValueError, match="memory_fraction"):
        toy.token_cap(memory_fraction=1.5)
    with pytest.raises(ValueError, match="shard_world=0"):
        toy.token_cap(shard_world=0)


def test_fit_without_observations_keeps_the_prior():
    toy = CostModel(TOY_DIMS, TOY, comm="ring")
    learned = toy.fit([])
    assert learned.hw.name == "learned-toy" and learned.comm == "ring" and learned.dims == TOY_DIMS
    for f in dataclasses.fields(Hardware):
        if f.name != "name":
            assert getattr(learned.hw, f.name) == pytest.approx(getattr(TOY, f.name), rel=1e-12), f.name
    assert learned.fit([]).hw.name == "learned-toy"  # refitting does not stack prefixes
    other = CostModel(TOY_DIMS, Hardware.load("h100"))
    from_prior = toy.fit([], prior=other)
    assert from_prior.hw.name == "learned-h100" and from_prior.hw.peak_flops == pytest.approx(989e12)
    assert from_prior.hw.gemm_efficiency == pytest.approx(0.7) and from_prior.comm == "ring"


def test_links_that_never_deliver_make_cp_infinitely_slow_not_nan():
    """Infinite latency (a profile may say so: it only checks >= 0) prices every CP > 1 split at inf,
    so a planner's min over splits still works; CP 1 needs no link and stays finite."""
    inf = float("inf")
    dead = dataclasses.replace(TOY, intra_node_latency_s=inf, inter_node_latency_s=inf)
    for comm in ("auto", "ulysses", "ring"):
        toy = CostModel(TOY_DIMS, dead, comm)
        assert toy.micro_batch_time([4000], 2) == inf and toy.micro_batch_time([4000], 4, True) == inf
        assert toy.micro_batch_time([4000], 1) == pytest.approx(compute([4000], 1))


def test_a_model_without_text_has_no_text_term():
    """text_tokens=0 is a valid shape (ModelDims allows it): no cross-attention k/v GEMMs to time.
    Was nan (0 FLOPs / a 0 rate) from micro_batch_time and ZeroDivisionError from sample_times."""
    toy = CostModel(dataclasses.replace(TOY_DIMS, text_tokens=0), TOY)
    one = 0.1 + 0.01 + 16_800 * 1000 / 2.5e11 + 280 * 1e6 / 1.25e11
    assert toy.micro_batch_time([1000], 1) == pytest.approx(one, rel=1e-12)
    assert toy.sample_times([1000], 1, 1000)[0] == pytest.approx(one, rel=1e-12)
    # one text token: 3 * 2 * 4 * 1 * 10^2 = 2400 FLOPs at the rate of a 1-token GEMM
    toy1 = CostModel(dataclasses.replace(TOY_DIMS, text_tokens=1), TOY)
    one_text = 0.1 + 0.01 + 16_800 * 1000 / 2.5e11 + 2400 / gemm(1) + 280 * (1e6 + 1000) / 1.25e11
    assert toy1.micro_batch_time([1000], 1) == pytest.approx(one_text, rel=1e-12)
    assert toy1.sample_times([1000], 1, 1000)[0] == pytest.approx(one_text, rel=1e-12)


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


@pytest.mark.parametrize("comm", ["auto", "ring"])
def test_scaled_model_is_the_same_cluster_slower(comm):
    """``scaled(f)``: every micro-batch time (compute, Ulysses and ring traffic, across nodes or not)
    is f times the original, and the layouts it picks do not change."""
    hw = dataclasses.replace(Hardware.load("h100"), clip_overhead_s=2e-4, gpus_per_node=4)
    base = CostModel.from_dims(d=1536, layers=30, ffn=8960, heads=12, hardware=hw, comm=comm)
    slow = base.scaled(1.7)
    for lengths, cp in [([700], 1), ([9000, 300, 77], 2), ([33000], 4), ([75000, 1200], 8)]:
        for cross in (False, True) if cp > 1 else (None,):
            assert slow.micro_batch_time(lengths, cp, cross) == pytest.approx(
                1.7 * base.micro_batch_time(lengths, cp, cross), rel=1e-12
            )
            assert slow.layout(lengths, cp, cross) == base.layout(lengths, cp, cross)
    faster = base.scaled(0.5)  # a factor below 1: the cluster sped up
    assert faster.micro_batch_time([9000], 2, False) == pytest.approx(
        0.5 * base.micro_batch_time([9000], 2, False)
    )
    with pytest.raises(ValueError, match="positive"):
        base.scaled(0.0)


def test_image_kv_is_priced_like_text_context():
    """Wan I2V: 257 CLIP tokens (FLF2V 514) per clip go through add_k/add_v and their own attention,
    which cost what as many more text tokens cost; the dims come from the model config."""
    i2v, flf2v, t2v = MODELS["wan-i2v-14b"], MODELS["wan-flf2v-14b"], MODELS["wan-14b"]
    assert (i2v.image_tokens, flf2v.image_tokens, t2v.image_tokens) == (257, 514, 0)
    assert i2v.context_tokens == 512 + 257
    # per block the image K/V add 2 d^2 parameters
    # (and the 20 extra input channels of (1, 2, 2) patches 80 values per token of patch embedding)
    assert i2v.num_params - t2v.num_params == 40 * 2 * 5120**2 + 80 * 5120
    hw = Hardware.load("h100")
    priced = CostModel(i2v, hw)
    # the same patch values: only the context may differ
    as_text = CostModel(dataclasses.replace(t2v, text_tokens=512 + 257, patch_values=i2v.patch_values), hw)
    for lengths, cp in (([32760], 4), ([4096, 1024, 300], 1)):
        assert priced.micro_batch_time(lengths, cp) == as_text.micro_batch_time(lengths, cp)
        assert priced.micro_batch_time(lengths, cp) > CostModel(t2v, hw).micro_batch_time(lengths, cp)
    assert priced.ideal_time([32760]) == pytest.approx(as_text.ideal_time([32760]))
