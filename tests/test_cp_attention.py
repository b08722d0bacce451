"""CP attention (Ulysses, ring, 2-D Ulysses x ring) on gloo CPU processes equals single-process
PackedAttention.

One spawn of 6 processes runs every case; groups of 2, 3 and 4 ranks are subgroups of that world,
including groups that do not start at rank 0, as the Dynamic-CP runtime uses them. The 2-D layouts
2x2 (4 ranks), 2x3 and 3x2 (6 ranks) run on sub-groups from ``build_cp_groups``. Each rank checks
its own shard of the output and of dQ/dK/dV against the single-process reference, which every rank
computes itself from the same seed.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from dit.attention import PackedAttention
from dynamic_cp.attention.cp_attention import check_layout, choose_layout, make_cp_attention
from dynamic_cp.attention.sharding import gather_shards
from dynamic_cp.runtime.groups import build_cp_groups
from dynamic_cp.runtime.testing import run_gloo_cases

WORLD = 6
GROUPS = {"g01": [0, 1], "g23": [2, 3], "g123": [1, 2, 3], "g0123": [0, 1, 2, 3], "g012345": list(range(6))}
PACKINGS = {
    "one_long": [37],
    "many_short": [5, 3, 7, 4, 6, 2, 5, 3],
    "mix_tiny_and_empty": [1, 2, 17, 0, 1, 9, 3],  # clips shorter than c, an empty clip, odd total
    "fewer_tokens_than_ranks": [1, 2],  # some shards are empty
}
HEAD_DIM = 8
TOL = 1e-5
# Ulysses needs heads divisible by c: 12 divides 2, 3 and 4. Ring gets 3 heads, which 2 and 4 do not divide.
CASES = [
    (group, method, packing, 12 if method == "ulysses" else 3)
    for group in GROUPS
    for method in ("ulysses", "ring")
    for packing in PACKINGS
]
# 2-D layouts "u x r" with 6 heads (u in {2, 3} divides them). On [1, 2] a 2x3 split has an empty
# block (shards 1, 1, 1, 0, 0, 0 -> blocks 2, 1, 0), and "one_long" spans every block.
HYBRID = {"g0123": ["2x2"], "g012345": ["2x3", "3x2"]}
CASES += [
    (group, layout, packing, 6)
    for group, layouts in HYBRID.items()
    for layout in layouts
    for packing in PACKINGS
]
GATHER_CASES = [
    ("g123", "ring", "mix_tiny_and_empty", 3),
    ("g0123", "ulysses", "many_short", 12),
    ("g012345", "3x2", "mix_tiny_and_empty", 6),
]


def hybrid_splits(c: int) -> list[tuple[int, int]]:
    """What the runtime's cost model lists for 6 heads (CostModel.cp_layout): u divides c and 6."""
    return [(u, c // u) for u in range(1, c + 1) if c % u == 0 and 6 % u == 0]


def case_id(case) -> str:
    return "-".join(str(x) for x in case)


def _inputs(case, seq_lens):
    gen = torch.Generator().manual_seed(sum(map(ord, case_id(case))))
    n, h = sum(seq_lens), case[3]
    return [torch.randn(n, h, HEAD_DIM, generator=gen) for _ in range(4)]  # q, k, v, output weights


def _reference(q, k, v, w, seq_lens):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = PackedAttention(seq_lens)(q, k, v)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _layout_args(case, cp_groups) -> dict:
    """make_cp_attention's keywords for a case: a method, or a 2-D layout and this rank's sub-groups."""
    group, method, _, heads = case
    if "x" not in method:
        return {"method": method, "num_heads": heads}
    u, r = map(int, method.split("x"))
    return {"num_heads": heads, "layout": (u, r), "sub_groups": cp_groups.sub_groups(GROUPS[group], u)}


def _run_case(case, group, gather: bool, cp_groups) -> dict[str, float]:
    packing = case[2]
    seq_lens = PACKINGS[packing]
    q, k, v, w = _inputs(case, seq_lens)
    ref = _reference(q, k, v, w, seq_lens)
    attention, info = make_cp_attention(group, seq_lens, **_layout_args(case, cp_groups))
    local = [info.shard(x).clone().requires_grad_() for x in (q, k, v)]
    out = attention(*local)
    if gather:  # the loss is computed on the gathered output, identically on every rank
        out = gather_shards(out, group, info)
        (out * w).sum().backward()
        got = [out.detach()] + [x.grad for x in local]
        want = [ref[0]] + [info.shard(x) for x in ref[1:]]
    else:  # each rank's loss covers its own tokens; the collectives' backward adds the rest
        (out * info.shard(w)).sum().backward()
        got = [out.detach()] + [x.grad for x in local]
        want = [info.shard(x) for x in ref]
    return {
        name: float((a - b).abs().max()) if a.numel() else 0.0
        for name, a, b in zip("o q k v".split(), got, want)
    }


def _sub_group_errors(cp_groups) -> list[str]:
    """make_cp_attention's messages for a 2-D layout with no sub-groups and with swapped ones."""
    group, u = cp_groups.get(GROUPS["g0123"]), 2
    block, ring = cp_groups.sub_groups(GROUPS["g0123"], u)
    messages = []
    for sub in (None, (ring, block)):
        try:
            make_cp_attention(group, [5, 4], num_heads=6, layout=(u, 2), sub_groups=sub)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def worker(rank: int, world_size: int) -> dict[str, object]:
    # every rank creates every group, in the same order
    groups = {name: dist.new_group(ranks) for name, ranks in GROUPS.items() if len(ranks) < world_size}
    groups["g012345"] = dist.group.WORLD
    cp_groups = build_cp_groups(dist.group.WORLD, cp_sizes=[4, 6], splits=hybrid_splits)
    results = {}
    for gather, case in [(False, c) for c in CASES] + [(True, c) for c in GATHER_CASES]:
        if rank not in GROUPS[case[0]]:
            continue
        key = ("gather-" if gather else "") + case_id(case)
        try:
            results[key] = _run_case(case, groups[case[0]], gather, cp_groups)
        except Exception:  # report it per case; the other ranks time out on the collective
            results[key] = traceback.format_exc()
    if rank in GROUPS["g0123"]:
        results["sub_group_errors"] = _sub_group_errors(cp_groups)
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, list]:
    return run_gloo_cases(worker, WORLD)


def _check(results, key, num_ranks):
    assert key in results, f"no rank ran {key}"
    assert len(results[key]) == num_ranks
    for value in results[key]:
        assert isinstance(value, dict), value  # a traceback string otherwise
        assert max(value.values()) <= TOL, value


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cp_attention_matches_single_process(results, case):
    _check(results, case_id(case), len(GROUPS[case[0]]))


@pytest.mark.parametrize("case", GATHER_CASES, ids=case_id)
def test_gather_shards_forward_and_backward(results, case):
    _check(results, "gather-" + case_id(case), len(GROUPS[case[0]]))


def test_missing_or_wrong_sub_groups_are_value_errors(results):
    for missing, swapped in results["sub_group_errors"]:
        assert "got None" in missing and "sub_groups=CPGroups.sub_groups" in missing
        assert "Ulysses block, ring group" in swapped and "got [[" in swapped


def test_choose_layout():
    assert choose_layout("auto", 12, 1) == (1, 1)
    assert choose_layout("auto", 12, 4) == (4, 1)
    assert choose_layout("auto", 6, 4) == (1, 4)
    assert choose_layout("ring", 12, 4) == (1, 4)
    assert choose_layout("ulysses", 12, 3) == (3, 1)
    assert choose_layout("ring", None, 3) == (1, 3)


@pytest.mark.parametrize(
    "layout, heads, size, match",
    [
        ((2, 3), 6, 4, "multiply to the CP group size 4"),
        ((4, 1), 6, 4, "divisible by 4"),
        ((2, 2), None, 4, "heads"),
    ],
)
def test_check_layout_errors(layout, heads, size, match):
    with pytest.raises(ValueError, match=match):
        check_layout(layout, heads, size)


@pytest.mark.parametrize(
    "method, heads, size, match",
    [
        ("ulysses", 6, 4, "use method='ring'"),
        ("auto", None, 2, "needs num_heads"),
        ("bogus", 4, 2, "not one of"),
    ],
)
def test_choose_layout_errors(method, heads, size, match):
    with pytest.raises(ValueError, match=match):
        choose_layout(method, heads, size)


def test_no_group_is_packed_attention():
    attention, info = make_cp_attention(None, [3, 4], num_heads=2)
    assert isinstance(attention, PackedAttention)
    assert (info.start, info.end) == (0, 7) and info.local_seq_lens.tolist() == [3, 4]
