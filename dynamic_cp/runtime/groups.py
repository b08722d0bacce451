"""Torch process groups for every CP group the planner may use, built once at start-up.

The planner names groups as tuples of global ranks (``dynamic_cp.planning.groups_layout.allowed_groups``:
aligned contiguous blocks of each allowed CP size, plus the whole world). ``build_cp_groups`` turns
that pure list into a ``CPGroups`` object that the runtime passes around explicitly; nothing here is
module-level state.

``torch.distributed.new_group`` is a collective over the *whole* world: every rank must call it for
every group, in the same order, even for groups it is not in. Building them all here, from one
deterministic list, is what guarantees that. Because the blocks are laminar, a rank is a member of
at most one CP group per CP size, i.e. log2(W) + 1 groups (NCCL buffers are allocated lazily, on a
group's first collective, and only on its members).

2-D (Ulysses x ring) layouts add sub-groups (``groups_layout.hybrid_groups``): for each CP group of
size c and each split u x r with u, r > 1 that ``splits`` allows, one ring group per rank (stride u)
and one Ulysses block (u contiguous ranks). A block is the same aligned run of u ranks for every CP
group and split, and already a CP group when u is an allowed size, so it is reused. A rank is
therefore in at most one CP process group per allowed size c > 1 + sum over those c of
#{u : u | c, u | heads, 1 < u < c} ring groups + one extra block per Ulysses degree u that is not an
allowed CP size. For W = 64 and Wan-1.3B's 12 heads (u in {2, 4}): 6 + 9 + 0 = 15 process groups;
at most 6 + 15 + 0 = 21 for any head count (tests/test_hybrid_layout.py counts them).
"""

from __future__ import annotations

import torch.distributed as dist

from dynamic_cp.planning.groups_layout import (
    allowed_groups,
    hybrid_groups,
    hybrid_sub_groups,
    normalize_cp_sizes,
)


class CPGroups:
    """ranks tuple -> ProcessGroup for every allowed group of more than one rank, and the sub-groups
    of the 2-D layouts (``sub_groups``).

    A single rank needs no communicator: ``get((r,))`` returns None, which ``make_cp_attention``
    treats as "no context parallelism".
    """

    def __init__(self, world_size: int, cp_sizes: tuple[int, ...], groups: dict, rank: int, sub: dict):
        self.world_size = world_size
        self.cp_sizes = cp_sizes
        self.rank = rank  # this process's global rank
        self._groups = groups
        self._sub = sub  # ranks tuple -> ProcessGroup: 2-D blocks and rings that are not CP groups

    def get(self, ranks) -> dist.ProcessGroup | None:
        ranks = tuple(ranks)
        if len(ranks) == 1:
            return None
        if ranks not in self._groups:
            raise ValueError(
                f"no process group was built for ranks {ranks}; the plan may only use groups from "
                f"dynamic_cp.planning.groups_layout.allowed_groups({self.world_size}, {list(self.cp_sizes)})"
            )
        return self._groups[ranks]

    def sub_groups(self, ranks, ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(Ulysses block, ring group) of this rank for CP group ``ranks`` split ``ulysses`` x ring."""
        ranks = tuple(ranks)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in CP group {ranks}")
        blocks, rings = hybrid_sub_groups(ranks, ulysses)
        pos = ranks.index(self.rank)
        block, ring = blocks[pos // ulysses], rings[pos % ulysses]
        found = [self._groups.get(g, self._sub.get(g)) for g in (block, ring)]
        if None in found:
            raise ValueError(
                f"no 2-D sub-groups were built for CP group {ranks} split {ulysses} x {len(ranks) // ulysses}; "
                "pass the layouts the runtime may pick to build_cp_groups(splits=CostModel.cp_layout)"
            )
        return found[0], found[1]

    def __contains__(self, ranks) -> bool:
        ranks = tuple(ranks)
        return len(ranks) == 1 or ranks in self._groups

    def __len__(self) -> int:
        return len(self._groups)


def build_cp_groups(world: dist.ProcessGroup, cp_sizes=None, splits=None, pp_size: int = 1) -> CPGroups:
    """Create one process group per allowed multi-rank group of ``world``; call on every rank.

    world: the process group of all training ranks (reused as-is for the whole-world CP group).
    cp_sizes: allowed CP sizes, None for the default (powers of two up to the world size, and it).
    splits: cp -> (ulysses, ring) pairs the runtime may run on a CP group of that size, e.g.
        ``CostModel.cp_layout``; their 2-D sub-groups are built too. None: 1-D layouts only.
    pp_size: pipeline stages (``dynamic_cp/runtime/pipeline.py``): the groups are those of one plan
        over R = W / pp_size ranks, built once per stage (plan rank r of stage p is global rank
        p*R + r); the returned ``CPGroups`` holds this rank's stage's, keyed by plan ranks.
    """
    world_size = dist.get_world_size(world)
    plan_size = world_size // pp_size
    sizes = normalize_cp_sizes(plan_size, cp_sizes)
    world_ranks = tuple(range(world_size))
    if dist.get_process_group_ranks(world) != list(world_ranks):
        # Groups are addressed by global rank; a world that is itself a subgroup would need a
        # translation table, and nothing launches training that way.
        raise ValueError("build_cp_groups needs the default (global) process group as `world`")
    rank = dist.get_rank(world)
    mine = rank // plan_size
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    sub: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for stage in range(pp_size):
        base = stage * plan_size
        for ranks in allowed_groups(plan_size, sizes):
            if len(ranks) == 1:
                continue
            # Every rank reaches this line for every group in the same order (see module docstring).
            group = world if len(ranks) == world_size else dist.new_group([base + r for r in ranks])
            if stage == mine:
                groups[ranks] = group
        # new_group sorts its ranks; ring groups are listed in block order, which is ascending, so a
        # rank's index in its ring group is its block's index.
        for ranks in hybrid_groups(plan_size, sizes, splits):
            group = dist.new_group([base + r for r in ranks])
            if stage == mine:
                sub[ranks] = group
    return CPGroups(plan_size, sizes, groups, rank - mine * plan_size, sub)
