"""The 2-D (Ulysses x ring) layout's pure parts: the cost model's choice and the sub-group layout.

``CostModel.layout`` must name the split whose time ``_comm_time`` (hence every plan's price)
charges, since the runtime runs that split; the sub-groups must be the blocks and strided rings that
``make_cp_attention`` expects, and few enough per rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import allowed_groups, hybrid_groups, hybrid_sub_groups

CM = CostModel.from_dims(d=1536, layers=30, ffn=8960, heads=12, text_tokens=512, hardware="h100")


@pytest.mark.parametrize(
    "lengths, cp",
    [([200_000], 16), ([200_000], 8), ([75_600], 4), ([8_448, 256, 256], 2), ([300_000], 64), ([1_000], 8)],
)
@pytest.mark.parametrize("cross_node", [None, True, False])
def test_layout_is_the_split_comm_time_charges(lengths, cp, cross_node):
    L = np.asarray(lengths, dtype=np.float64)
    attn = CM._attn_time(L, cp).sum()
    layouts, times = CM._layout_times(L.sum(), cp, attn, cross_node)
    chosen = CM.layout(lengths, cp, cross_node)
    assert chosen in layouts
    assert times[layouts.index(chosen)] == CM._comm_time(L.sum(), cp, attn, cross_node)
    u, r = chosen
    assert u * r == cp and 12 % u == 0


def test_layout_picks_2d_where_heads_cap_ulysses():
    # 12 heads: Ulysses stops at 4, so a long clip on CP 16 needs a ring too (the README's example);
    # its K/V passes hide behind the long clip's attention
    u, r = CM.layout([200_000], 16)
    assert u > 1 and r > 1
    assert CM.layout([5_000], 1) == (1, 1)
    assert CostModel(CM.dims, CM.hw, comm="ring").layout([200_000], 16) == (1, 16)
    assert CostModel(CM.dims, CM.hw, comm="ulysses").layout([200_000], 4) == (4, 1)


def test_layout_ties_go_to_the_larger_ulysses_degree():
    free = dataclasses.replace(
        CM.hw, intra_node_latency_s=0.0, inter_node_latency_s=0.0,
        intra_node_bandwidth=float("inf"), inter_node_bandwidth=float("inf"),
    )  # fmt: skip
    cm = CostModel(CM.dims, free)
    assert cm._comm_time(10_000.0, 8, 0.0, None) == 0.0  # every split costs nothing
    assert cm.layout([10_000], 8) == (4, 2)


def test_sub_groups_are_blocks_and_strided_rings():
    blocks, rings = hybrid_sub_groups((8, 9, 10, 11, 12, 13), 2)
    assert blocks == [(8, 9), (10, 11), (12, 13)]
    assert rings == [(8, 10, 12), (9, 11, 13)]
    blocks, rings = hybrid_sub_groups(tuple(range(6)), 3)
    assert blocks == [(0, 1, 2), (3, 4, 5)] and rings == [(0, 3), (1, 4), (2, 5)]
    with pytest.raises(ValueError, match="must divide"):
        hybrid_sub_groups((0, 1, 2, 3), 3)


def test_groups_per_rank():
    """W = 64, Wan-1.3B's 12 heads: 6 CP groups (sizes 2..64), 9 rings, no extra block (docs)."""
    world = 64
    cps = allowed_groups(world)
    extra = hybrid_groups(world, splits=CM.cp_layout)
    assert not set(cps) & set(extra) and len(set(extra)) == len(extra)
    for rank in (0, 37, 63):
        mine_cp = [g for g in cps if rank in g and len(g) > 1]
        mine_extra = [g for g in extra if rank in g]
        assert len(mine_cp) == 6 and len(mine_extra) == 9
    # a Ulysses degree that is not an allowed CP size gets its own block
    extra = hybrid_groups(8, cp_sizes=[1, 8], splits=CM.cp_layout)
    assert (0, 1) in extra and (0, 1, 2, 3) in extra and (0, 2, 4, 6) in extra and (0, 4) in extra
    assert hybrid_groups(64, splits=None) == []
