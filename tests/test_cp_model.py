"""A DiT block and the whole tiny VideoDiT under CP equal the single-process run, outputs and gradients.

One spawn of 4 gloo processes runs every case. Each rank builds the same model from the same seed,
runs the reference on the full packed micro-batch, then its own shard under CP. Parameter gradients
are summed over the CP group (what the step's gradient all-reduce does) before the comparison.
The 2-D layout (Ulysses 2 x ring 2 on 4 ranks) runs on sub-groups from ``build_cp_groups``.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from dit.attention import PackedAttention, cu_seqlens_from_lengths
from dit.blocks import DiTBlock, RotaryEmbedding3D
from dit.model import VideoDiT
from dit.packing import pack
from dynamic_cp.attention.cp_attention import make_cp_attention
from dynamic_cp.runtime.groups import build_cp_groups
from dynamic_cp.runtime.testing import run_gloo_cases

WORLD = 4
GROUPS = {"g12": [1, 2], "g012": [0, 1, 2], "g0123": [0, 1, 2, 3]}
DIM = 48
# (what, group, method, heads): with 6 heads "auto" is Ulysses on 2 and 3 ranks; with 3 heads and
# 2 ranks it is ring. "2x2" is the 2-D layout (6 heads: 2 per Ulysses rank, 3 per ring step).
CASES = [
    ("block", "g0123", "2x2", 6),
    ("model", "g0123", "2x2", 6),
    ("block", "g12", "ulysses", 6),
    ("block", "g012", "ring", 6),
    ("model", "g12", "auto", 6),
    ("model", "g012", "auto", 6),
    ("model", "g012", "ring", 6),
    ("model", "g12", "auto", 3),
]
# (frames, height, width) in patches; patch (1, 2, 2). 12 + 4 + 12 + 1 = 29 tokens: odd, a one-token
# clip shorter than any group, and shard boundaries inside clips.
GRIDS = [(2, 2, 3), (1, 2, 2), (3, 2, 2), (1, 1, 1)]
TEXT_LENS = [3, 5, 2, 4]
TEXT_DIM = 32
REL_TOL = 1e-4


def case_id(case) -> str:
    return "-".join(str(x) for x in case)


def _batch(gen: torch.Generator) -> dict:
    clips = [torch.randn(4, f, 2 * h, 2 * w, generator=gen) for f, h, w in GRIDS]
    packed = pack(clips, (1, 2, 2))
    return dict(
        tokens=packed.tokens,
        positions=packed.positions,
        seq_lens=packed.seq_lens,
        timesteps=torch.rand(len(GRIDS), generator=gen) * 1000,
        text=torch.randn(sum(TEXT_LENS), TEXT_DIM, generator=gen),
        text_lens=torch.tensor(TEXT_LENS),
    )


def _build(what: str, heads: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    if what == "block":
        return DiTBlock(DIM, 2 * DIM, heads, eps=1e-6, qk_norm=True, cross_attn_norm=True)
    return VideoDiT(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=DIM // heads,
        in_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=2 * DIM,
        num_layers=2,
        adaln_zero_init=False,  # zero gates would hide attention from the outputs and the gradients
    )


def _run(what, module, batch, extra, shard, seq_lens, attention):
    """Forward on the tokens ``shard`` selects; ``seq_lens`` are the clip lengths held there."""
    if what == "block":
        x, text, modulation, rope = extra
        return module(
            shard(x),
            text,
            modulation,
            tuple(shard(r) for r in rope),
            seq_lens,
            cu_seqlens_from_lengths(seq_lens),
            cu_seqlens_from_lengths(batch["text_lens"]),
            attention,
        )
    return module(
        shard(batch["tokens"]),
        shard(batch["positions"]),
        seq_lens,
        batch["timesteps"],
        batch["text"],
        batch["text_lens"],
        attention,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if b.numel() else 0.0


def _run_case(case, group, cp_groups) -> dict[str, float]:
    what, group_name, method, heads = case
    gen = torch.Generator().manual_seed(sum(map(ord, case_id(case))))
    batch = _batch(gen)
    n = int(batch["seq_lens"].sum())
    extra = None
    if what == "block":
        rope = RotaryEmbedding3D(DIM // heads)(batch["positions"])
        extra = (
            torch.randn(n, DIM, generator=gen),
            torch.randn(sum(TEXT_LENS), DIM, generator=gen),
            torch.randn(len(GRIDS), 6, DIM, generator=gen),
            rope,
        )
    out_w = torch.randn(n, DIM if what == "block" else 16, generator=gen)

    ref_model = _build(what, heads)
    ref = _run(
        what, ref_model, batch, extra, lambda x: x, batch["seq_lens"], PackedAttention(batch["seq_lens"])
    )
    (ref * out_w).sum().backward()

    model = _build(what, heads)
    if "x" in method:  # a 2-D layout, as the runtime passes it
        u, r = map(int, method.split("x"))
        layout = {"layout": (u, r), "sub_groups": cp_groups.sub_groups(GROUPS[group_name], u)}
    else:
        layout = {"method": method}
    attention, info = make_cp_attention(group, batch["seq_lens"], num_heads=heads, **layout)
    out = _run(what, model, batch, extra, info.shard, info.local_seq_lens, attention)
    (out * info.shard(out_w)).sum().backward()

    errors = {"output": _rel(out.detach(), info.shard(ref.detach()))}
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        assert p_ref.grad is not None and p_ref.grad.abs().max() > 0, (
            f"{name} gets no gradient: a vacuous check"
        )
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)  # the step's gradient all-reduce
        errors[name] = _rel(grad, p_ref.grad)
    return errors


def worker(rank: int, world_size: int) -> dict[str, object]:
    groups = {name: dist.new_group(ranks) for name, ranks in GROUPS.items() if len(ranks) < world_size}
    groups["g0123"] = dist.group.WORLD
    cp_groups = build_cp_groups(dist.group.WORLD, cp_sizes=[4], splits=lambda c: [(2, 2)])
    results = {}
    for case in CASES:
        if rank in GROUPS[case[1]]:
            try:
                results[case_id(case)] = _run_case(case, groups[case[1]], cp_groups)
            except Exception:  # report it per case
                results[case_id(case)] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, list]:
    return run_gloo_cases(worker, WORLD)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cp_model_matches_single_process(results, case):
    key = case_id(case)
    assert len(results.get(key, [])) == len(GROUPS[case[1]]), f"not every rank ran {key}"
    for errors in results[key]:
        assert isinstance(errors, dict), errors  # a traceback string otherwise
        worst = max(errors, key=errors.get)
        assert errors[worst] <= REL_TOL, f"{worst}: relative error {errors[worst]:.2e}"
        assert len(errors) > 10  # the output and every parameter were compared
