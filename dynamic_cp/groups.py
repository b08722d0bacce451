"""Torch process groups for every CP group the planner may use, built once at start-up.

The planner names groups as tuples of global ranks (``dynamic_cp.groups_layout.allowed_groups``:
aligned contiguous blocks of each allowed CP size, plus the whole world). ``build_cp_groups`` turns
that pure list into a ``CPGroups`` object that the runtime passes around explicitly; nothing here is
module-level state.

``torch.distributed.new_group`` is a collective over the *whole* world: every rank must call it for
every group, in the same order, even for groups it is not in. Building them all here, from one
deterministic list, is what guarantees that. Because the blocks are laminar, a rank is a member of
at most one group per CP size, i.e. log2(W) + 1 groups, which bounds per-rank communicator memory
(NCCL buffers are allocated lazily, on a group's first collective, and only on its members).
"""

from __future__ import annotations

import torch.distributed as dist

from dynamic_cp.groups_layout import allowed_groups, normalize_cp_sizes


class CPGroups:
    """ranks tuple -> ProcessGroup for every allowed group of more than one rank.

    A single rank needs no communicator: ``get((r,))`` returns None, which ``make_cp_attention``
    treats as "no context parallelism".
    """

    def __init__(self, world_size: int, cp_sizes: tuple[int, ...], groups: dict):
        self.world_size = world_size
        self.cp_sizes = cp_sizes
        self._groups = groups

    def get(self, ranks) -> dist.ProcessGroup | None:
        ranks = tuple(ranks)
        if len(ranks) == 1:
            return None
        if ranks not in self._groups:
            raise ValueError(
                f"no process group was built for ranks {ranks}; the plan may only use groups from "
                f"dynamic_cp.groups_layout.allowed_groups({self.world_size}, {list(self.cp_sizes)})"
            )
        return self._groups[ranks]

    def __contains__(self, ranks) -> bool:
        ranks = tuple(ranks)
        return len(ranks) == 1 or ranks in self._groups

    def __len__(self) -> int:
        return len(self._groups)


def build_cp_groups(world: dist.ProcessGroup, cp_sizes=None) -> CPGroups:
    """Create one process group per allowed multi-rank group of ``world``; call on every rank.

    world: the process group of all training ranks (reused as-is for the whole-world CP group).
    cp_sizes: allowed CP sizes, None for the default (powers of two up to the world size, and it).
    """
    world_size = dist.get_world_size(world)
    sizes = normalize_cp_sizes(world_size, cp_sizes)
    world_ranks = tuple(range(world_size))
    if dist.get_process_group_ranks(world) != list(world_ranks):
        # Groups are addressed by global rank; a world that is itself a subgroup would need a
        # translation table, and nothing launches training that way.
        raise ValueError("build_cp_groups needs the default (global) process group as `world`")
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in allowed_groups(world_size, sizes):
        if len(ranks) == 1:
            continue
        if ranks == world_ranks:
            groups[ranks] = world
            continue
        # Every rank reaches this line for every group in the same order (see module docstring).
        groups[ranks] = dist.new_group(list(ranks))
    return CPGroups(world_size, sizes, groups)
