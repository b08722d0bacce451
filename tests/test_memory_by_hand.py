"""memory.py's bytes per GPU worked by hand on a round-number model (the module docstring's table).

dims: d = 10, 3 layers, ffn 20 -> P = 3 * (8 * 10 * 10 + 2 * 10 * 20) = 3600 parameters.
Activations per token (bf16): 3 * (16 * 10 + 2 * 20) * 2 = 1200; with checkpointing 3 * 10 * 2 + 400 = 460.
Every value is an exact binary float (sums and products of small integers), so equality is exact.
"""

from __future__ import annotations

import dataclasses

import pytest

from dynamic_cp.planning.memory import (
    MemoryBreakdown,
    choose_fsdp_mode,
    memory_breakdown,
    mode_token_cap,
    resolve_dims,
)
from dynamic_cp.planning.model_dims import MODELS, ModelDims

DIMS = ModelDims(d=10, layers=3, ffn=20, heads=2, text_tokens=0)
P = 3600.0


def _parts(m: MemoryBreakdown) -> tuple:
    return (m.master_weights, m.gradients, m.optimizer, m.compute_weights, m.ema)


@pytest.mark.parametrize(
    "mode, kwargs, parts",
    [
        # none: fp32 master and grads, ZeRO-1 moments 8P/W, bf16 copies 2P, fp32 EMA 4P
        ("none", {}, (4 * P, 4 * P, 8 * P / 4, 2 * P, 4 * P)),
        ("none", {"shard_optimizer": False}, (4 * P, 4 * P, 8 * P, 2 * P, 4 * P)),
        # per_step: sharded master / moments / EMA, plus an unsharded fp32 (or bf16) accumulator
        ("per_step", {}, (P, P + 4 * P, 2 * P, 2 * P, P)),
        ("per_step", {"grad_accum_bytes": 2}, (P, P + 2 * P, 2 * P, 2 * P, P)),
        # per_layer: one layer's unsharded grad in flight (2 + 4) P / L, two bf16 layers gathered
        ("per_layer", {}, (P, P + 6 * P / 3, 2 * P, 4 * P / 3, P)),
        # lora rank 2: A = 3 layers * 8 adapters * 2 * 10 * 2 = 960 adapter parameters on a bf16 base
        ("lora", {"lora_rank": 2}, (3840.0, 3840.0, 7680.0, 2 * P + 1920, 3840.0)),
    ],
)
def test_states_per_mode_worked_by_hand(mode, kwargs, parts):
    m = memory_breakdown(DIMS, mode, 4, 5, ema=True, **kwargs)
    assert (m.mode, _parts(m)) == (mode, parts)
    assert m.states == sum(parts)
    assert (m.activations_per_token, m.tokens, m.activations) == (1200.0, 5, 6000.0)
    assert m.total == sum(parts) + 6000.0
    no_ema = memory_breakdown(DIMS, mode, 4, 5, ema=False, **kwargs)
    assert no_ema.ema == 0.0 and _parts(no_ema)[:4] == parts[:4]


def test_defaults_checkpointing_and_rows():
    m = memory_breakdown(DIMS, "per_step", 4)  # fp32 accumulator, no EMA, no tokens by default
    assert (m.gradients, m.ema, m.tokens, m.activations) == (5 * P, 0.0, 0.0, 0.0)
    assert memory_breakdown(DIMS, "none", 4).optimizer == 2 * P  # ZeRO-1 by default
    assert memory_breakdown(DIMS, "lora", 4).master_weights == 4 * 3 * 8 * 2 * 10 * 16  # rank 16
    assert memory_breakdown(DIMS, "none", 4, activation_checkpointing=True).activations_per_token == 460.0
    assert MemoryBreakdown("none", 1, 2, 3, 4, 5, 6).tokens == 0.0
    rows = memory_breakdown(DIMS, "none", 4, 1000, ema=True).rows()
    assert rows == [
        ("master weights (fp32)", 4 * P),
        ("gradients", 4 * P),
        ("optimizer moments", 2 * P),
        ("compute-dtype weights (bf16)", 2 * P),
        ("EMA (fp32)", 4 * P),
        ("activations (1,000 tokens)", 1.2e6),
        ("total", 16 * P + 1.2e6),
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.tokens = 1.0


def test_resolve_dims_and_argument_checks():
    assert resolve_dims("wan-14b") is MODELS["wan-14b"] and resolve_dims(DIMS) is DIMS
    for bad, match in [
        ({"mode": "zero3"}, "fsdp mode 'zero3'"),
        ({"world_size": 0}, "world_size=0"),
        ({"grad_accum_bytes": 8}, "grad_accum_bytes=8"),
        ({"tokens": -1}, "tokens=-1"),
        ({"mode": "lora", "lora_rank": 0}, "lora_rank=0"),
    ]:
        args = {"model": DIMS, "mode": "none", "world_size": 4, **bad}
        with pytest.raises(ValueError, match=match):
            memory_breakdown(**args)
    for ok in [{"world_size": 1}, {"grad_accum_bytes": 2}, {"tokens": 0}, {"mode": "lora", "lora_rank": 1}]:
        memory_breakdown(**{"model": DIMS, "mode": "none", "world_size": 4, **ok})


def test_token_cap_is_the_free_fraction_over_bytes_per_token():
    m = memory_breakdown(DIMS, "none", 4)  # states 12 P = 43200, 1200 bytes per token
    assert mode_token_cap(m, (43200 + 5 * 1200 + 600) / 0.9) == 5  # 90% of HBM by default; floored
    assert mode_token_cap(m, 43200 + 7 * 1200, memory_fraction=1.0) == 7  # the whole of it, exactly
    assert mode_token_cap(m, 1000.0) == 0  # the states alone do not fit: 0, not negative
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="memory_fraction"):
            mode_token_cap(m, 1e9, memory_fraction=bad)


def test_auto_picks_the_first_mode_that_fits_and_prices_its_cap():
    # states: none 12P = 43200 (ZeRO-1), per_step 10P = 36000, per_layer 6P + 4P/3 = 26400
    hbm = 36000 + 3 * 1200  # memory_fraction 1: none fits nothing, per_step 3 tokens, per_layer 11
    assert choose_fsdp_mode(DIMS, 4, None, hbm, False, memory_fraction=1.0) == ("per_step", hbm, 3)
    assert choose_fsdp_mode(DIMS, 4, 2, hbm, False, memory_fraction=1.0) == ("per_step", 36000 + 2400, 2)
    assert choose_fsdp_mode(DIMS, 4, 4, hbm, False, memory_fraction=1.0) == ("per_layer", 26400 + 4800, 4)
    assert choose_fsdp_mode(DIMS, 4, 1, 1e9, False) == ("none", 43200 + 1200, 1)
    # the options reach the breakdowns: an EMA (sharded: P), a bf16 accumulator (-2P), no ZeRO-1 (+6P)
    assert choose_fsdp_mode(DIMS, 4, 2, 1e9, False, ema=True)[1] == 43200 + 4 * P + 2400
    assert choose_fsdp_mode(DIMS, 4, 2, hbm, False, memory_fraction=1.0, ema=True)[0] == "per_layer"
    got = choose_fsdp_mode(DIMS, 4, 2, 34000 + 2400, False, memory_fraction=1.0, grad_accum_bytes=2)
    assert got == ("per_step", 36000 - 2 * P + 2400, 2)  # a bf16 accumulator: 2P less
    assert (
        choose_fsdp_mode(DIMS, 4, 2, 45600, False, memory_fraction=1.0, shard_optimizer=False)[0]
        == "per_step"
    )
    assert choose_fsdp_mode(DIMS, 4, 2, 45600, False, memory_fraction=1.0)[0] == "none"
    # checkpointing shrinks activations to 460 bytes per token
    assert choose_fsdp_mode(DIMS, 4, None, hbm, True, memory_fraction=1.0)[2] == 3600 // 460
    with pytest.raises(ValueError, match=r"none: 43\.2|no fsdp mode fits 1 tokens"):  # one rank: none only
        choose_fsdp_mode(DIMS, 1, None, hbm, False, memory_fraction=1.0)
    for bad, match in [({"memory_bytes": 0.0}, "memory_bytes=0.0"), ({"token_cap": 0}, "token_cap=0")]:
        args = {
            "model": DIMS,
            "world_size": 4,
            "token_cap": 1,
            "memory_bytes": 1e9,
            "gradient_checkpointing": False,
        }
        with pytest.raises(ValueError, match=match):
            choose_fsdp_mode(**{**args, **bad})


def test_auto_shards_from_two_ranks_and_any_positive_memory_is_a_question():
    # two ranks can shard: per_step states on W = 2 are 4P/2 + (4P/2 + 4P) + 8P/2 + 2P = 14P = 50400,
    # while none without ZeRO-1 needs 4P + 4P + 8P + 2P = 18P
    got = choose_fsdp_mode(DIMS, 2, 1, 50400 + 1200, False, memory_fraction=1.0, shard_optimizer=False)
    assert got == ("per_step", 50400 + 1200, 1)
    with pytest.raises(ValueError, match="no fsdp mode fits"):  # 1 byte is a (too small) memory, not an error
        choose_fsdp_mode(DIMS, 4, None, 1.0, False)


def test_one_rank_tries_only_the_replicated_mode():
    # 30 layers: per_layer's states on one rank (4P + 4P + 6P/30 + 8P + 4P/30 = 16.33P) would be
    # below none's 18P, but one rank has nothing to shard with: no mode fits
    deep = ModelDims(d=10, layers=30, ffn=20, heads=2, text_tokens=0)  # P = 36000
    with pytest.raises(ValueError, match=r"on 1 ranks \(none: "):
        choose_fsdp_mode(deep, 1, None, 600000.0, False, memory_fraction=1.0)
