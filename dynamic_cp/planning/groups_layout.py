"""Which rank groups exist: aligned contiguous blocks of each allowed CP size, plus the whole world.

The runtime builds one torch process group per entry of ``allowed_groups`` at start-up, and the
planner only ever uses those entries. Blocks are aligned (a block of size c starts at a multiple of c),
so the groups form a laminar family: two groups are either disjoint or one contains the other. That
is what keeps a rank in only log2(W) + 1 groups and lets plan-ordered execution run without holes.

The 2-D (Ulysses x ring) layout also needs, inside a CP group, blocks of contiguous ranks and ring
groups that stride over them (``hybrid_sub_groups``, ``hybrid_groups``); the planner never names those.
"""

from __future__ import annotations


def default_cp_sizes(world_size: int) -> tuple[int, ...]:
    """Powers of two up to the world size, plus the world size itself when it is not one."""
    check_world_size(world_size)
    sizes = []
    c = 1
    while c <= world_size:
        sizes.append(c)
        c *= 2
    if sizes[-1] != world_size:
        sizes.append(world_size)
    return tuple(sizes)


def check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")


def normalize_cp_sizes(world_size: int, cp_sizes=None) -> tuple[int, ...]:
    """Sorted, de-duplicated CP sizes; each must be a power of two <= world size, or the world size."""
    if cp_sizes is None:
        return default_cp_sizes(world_size)
    sizes = sorted({int(c) for c in cp_sizes})
    if not sizes:
        raise ValueError("cp_sizes is empty; pass None for the default (powers of two up to the world size)")
    for c in sizes:
        pow2 = c >= 1 and c & (c - 1) == 0
        if c != world_size and (not pow2 or c > world_size):
            raise ValueError(
                f"CP size {c} is not allowed for world size {world_size}: use powers of two up to "
                f"{world_size} or the world size itself, e.g. {default_cp_sizes(world_size)}"
            )
    return tuple(sizes)


def blocks_of_size(world_size: int, cp: int) -> list[tuple[int, ...]]:
    """Aligned contiguous blocks of ``cp`` ranks that fit in the world (one block when cp == world)."""
    if cp == world_size:
        return [tuple(range(world_size))]
    return [tuple(range(s, s + cp)) for s in range(0, world_size - cp + 1, cp)]


def block_around(ranks: tuple[int, ...], world_size: int, cp: int) -> tuple[int, ...] | None:
    """The allowed block of ``cp`` ranks nested with the group ``ranks`` (inside it when ``cp`` is
    smaller, around it when larger) that holds its first rank, or None when there is none.

    Blocks are aligned, so past the last whole block of size ``cp`` there is none: at W = 3 rank 2 has
    no CP-2 block, at W = 6 ranks 4-5 have no CP-4 block. Callers skip such a group.
    """
    group = set(ranks)
    for block in blocks_of_size(world_size, cp):
        if ranks[0] in block and (group <= set(block) or set(block) <= group):
            return block
    return None


def allowed_groups(world_size: int, cp_sizes=None) -> list[tuple[int, ...]]:
    """Every rank group the planner may use, smallest size first, then by first rank.

    Single ranks are included (CP size 1 needs no process group, but listing it keeps the planner's
    view and the runtime's in one place).
    """
    check_world_size(world_size)
    groups: list[tuple[int, ...]] = []
    for c in normalize_cp_sizes(world_size, cp_sizes):
        groups.extend(blocks_of_size(world_size, c))
    return groups


def groups_of_rank(rank: int, world_size: int, cp_sizes=None) -> list[tuple[int, ...]]:
    """The allowed groups that contain ``rank``: one per CP size at most."""
    return [g for g in allowed_groups(world_size, cp_sizes) if rank in g]


def hybrid_sub_groups(
    ranks: tuple[int, ...], ulysses: int
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(Ulysses blocks, ring groups) of the 2-D split of CP group ``ranks`` with ``ulysses`` ranks per block.

    Blocks are contiguous runs of ``ulysses`` ranks: on aligned groups they are aligned, so they stay
    inside a node (as the cost model assumes) and are the CP groups of that size when it is allowed.
    Ring group j holds the j-th rank of every block (stride ``ulysses``), in block order.
    """
    c = len(ranks)
    if ulysses < 1 or c % ulysses:
        raise ValueError(f"Ulysses degree {ulysses} must divide the CP group size {c}")
    blocks = [tuple(ranks[s : s + ulysses]) for s in range(0, c, ulysses)]
    rings = [tuple(ranks[j::ulysses]) for j in range(ulysses)]
    return blocks, rings


def hybrid_groups(world_size: int, cp_sizes=None, splits=None) -> list[tuple[int, ...]]:
    """Every Ulysses block and ring group the 2-D layouts need, in a fixed order, without repeats.

    splits: cp -> the (ulysses, ring) pairs a CP group of that size may run (``CostModel.cp_layout``);
    None: no 2-D layouts. Only pairs with both degrees > 1 need sub-groups. Blocks that are already
    in ``allowed_groups`` are left out (the runtime reuses those).
    """
    if splits is None:
        return []
    have = set(allowed_groups(world_size, cp_sizes))
    out: list[tuple[int, ...]] = []
    for group in allowed_groups(world_size, cp_sizes):
        for u, r in splits(len(group)):
            if u == 1 or r == 1:
                continue
            blocks, rings = hybrid_sub_groups(group, u)
            for g in blocks + rings:
                if g not in have:
                    have.add(g)
                    out.append(g)
    return out
