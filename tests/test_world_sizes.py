"""Every world size, not only powers of two: the planners and the cost learner's exploration place
every clip exactly once, on ranks that exist, in groups the runtime builds, and never raise.

At W = 3 the only aligned CP-2 block is (0, 1), so rank 2 has no CP-2 block around it; the same holds
for CP 4 at W = 6 (ranks 4-5) or CP 16 at W = 24 (ranks 16-23). Which micro-batch exploration picks
depends on the unexplored keys and on where the plan puts clips, so a pinned profile can hide a crash
that the default path (``parallel.hardware=auto``, learned costs, exploration on) hits. These tests
walk every unexplored (CP size, layout) key at every world size from 1 to 24 and at 32, 48, 64, 96.

Planted and seen to fail: ``_explore`` looking up the block with ``next(...)`` and no default (main
before issue 39: StopIteration at W = 3, 5, 6, 7, ...); ``blocks_of_size`` returning one block
fewer (the clips of the dropped block's ranks are never placed, or a group the runtime does not build
is named).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamic_cp.planning.baselines import static_plan
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import (
    allowed_groups,
    blocks_of_size,
    default_cp_sizes,
    hybrid_groups,
    hybrid_sub_groups,
)
from dynamic_cp.planning.plan_types import plan_violations
from dynamic_cp.planning.planner import plan as dynamic_plan
from dynamic_cp.planning.rounds import round_violations
from dynamic_cp.planning.rounds_planner import plan_rounds
from dynamic_cp.planning.sampling_planner import SamplingJob, plan_sampling
from dynamic_cp.runtime.cost_learning import MIN_OBSERVATIONS, CostLearner

WORLDS = list(range(1, 25)) + [32, 48, 64, 96]
CAP = 8192
# wan-1.3b has 12 heads (Ulysses degrees 1, 2, 3, 4, 6, 12 divide it), wan-14b 40 (1, 2, 4, 5, 8, ...):
# between them every CP size up to 96 has a 2-D layout to explore at some world size.
PRIORS = {name: CostModel.from_name(name, "h100") for name in ("wan-1.3b", "wan-14b")}
SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def lengths_for(world: int):
    """1 to 2W clips, from an image (256 tokens) up to what CP W can hold, most of them short."""
    short = st.integers(256, CAP)
    long = st.integers(CAP, CAP * world)
    return st.lists(st.one_of(short, short, long), min_size=1, max_size=2 * world)


def buildable_groups(world: int, cost: CostModel) -> set[tuple[int, ...]]:
    """What the runtime builds at start-up (``runtime/groups.py``): the aligned blocks of every allowed
    size and the sub-groups of the 2-D layouts."""
    sizes = default_cp_sizes(world)
    return set(allowed_groups(world, sizes)) | set(hybrid_groups(world, sizes, cost.cp_layout))


def runtime_violations(plan, lengths, cost: CostModel) -> list[str]:
    """``plan_violations`` plus the layouts: each is one of its CP size's and its sub-groups exist."""
    errors = plan_violations(plan, lengths, CAP, default_cp_sizes(plan.world_size))
    built = buildable_groups(plan.world_size, cost)
    for m, ((ranks, _), layout) in enumerate(zip(plan.micro_batches, plan.info.get("layouts", []))):
        layout = tuple(layout)
        if layout not in cost.cp_layout(len(ranks)):
            errors.append(f"micro-batch {m}: layout {layout} is not one of CP {len(ranks)}'s")
        elif layout[0] > 1 and layout[1] > 1:
            blocks, rings = hybrid_sub_groups(tuple(ranks), layout[0])
            missing = [g for g in blocks + rings if g not in built]
            if missing:
                errors.append(f"micro-batch {m}: sub-groups {missing} are not built")
    return errors


def _learner(cost: CostModel, world: int, rounds: bool) -> CostLearner:
    sizes = default_cp_sizes(world)
    planner = plan_rounds if rounds else dynamic_plan
    return CostLearner(
        cost,
        lambda model, lengths: planner(lengths, world, CAP, model, cp_sizes=sizes),
        start_step=0,
        plan_lag=0,
        explore_budget=1.0,  # every placeable move is taken: the widest search for a bad one
        cp_sizes=sizes,
        cap_tokens=CAP,
        refit_every=10**6,
    )


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("prior", sorted(PRIORS))
@SETTINGS
@given(data=st.data())
def test_exploring_any_missing_key_keeps_the_plan_valid(world, prior, data):
    """For each (CP size, layout) key that exploration may ask for, with only that key missing:
    ``CostLearner.plan`` returns a valid plan (or one without exploration) and never raises."""
    cost = PRIORS[prior]
    lengths = data.draw(lengths_for(world), label="lengths")
    for key in _learner(cost, world, rounds=False).wanted:
        learner = _learner(cost, world, rounds=False)
        first = learner.plan(lengths)
        for k in learner.wanted:
            learner._seen[k] = 0 if k == key else MIN_OBSERVATIONS
        learner.observe(0, first, lengths, [(0.0, 0.0, 0.0)] * len(first.micro_batches))  # publishes them
        plan = learner.plan(lengths)
        assert runtime_violations(plan, lengths, cost) == [], (world, key, plan.micro_batches)
        if "explored" in plan.info:
            c, (u, r) = key
            assert plan.info["explored"] == f"cp{c} {u}x{r}"


@pytest.mark.parametrize("world", [3, 5, 6, 7, 12, 24])
@SETTINGS
@given(data=st.data())
def test_a_run_of_steps_explores_with_the_defaults_and_stays_valid(world, data):
    """The runtime's loop: plan, execute (seconds from the prior), observe, for 12 steps with every key
    missing at the start, as a fresh run on the default path has them."""
    cost = PRIORS["wan-1.3b"]
    lengths = data.draw(lengths_for(world), label="lengths")
    learner = _learner(cost, world, rounds=False)
    for step in range(12):
        plan = learner.plan(lengths)
        assert runtime_violations(plan, lengths, cost) == [], (step, plan.micro_batches)
        seconds = [cost.micro_batch_time([lengths[i] for i in ids], len(r)) for r, ids in plan.micro_batches]
        learner.observe(step, plan, lengths, [(0.0, s, 0.0) for s in seconds])


@pytest.mark.parametrize("world", WORLDS)
@SETTINGS
@given(data=st.data())
def test_the_rounds_and_static_planners_place_every_clip_on_built_groups(world, data):
    """per_layer's rounds planner (every round on disjoint ranks) and static CP, at every world size."""
    cost = PRIORS["wan-1.3b"]
    lengths = data.draw(lengths_for(world), label="lengths")
    sizes = default_cp_sizes(world)
    rounds = plan_rounds(lengths, world, CAP, cost, cp_sizes=sizes)
    assert plan_violations(rounds, lengths, CAP, sizes) == []
    assert round_violations(rounds) == []
    for balanced in (False, True):
        static = static_plan(lengths, world, CAP, cost, cp_sizes=sizes, balanced=balanced)
        assert plan_violations(static, lengths, CAP, sizes) == []


@pytest.mark.parametrize("world", WORLDS)
@SETTINGS
@given(data=st.data())
def test_exploration_on_a_rounds_plan_keeps_every_clip_once_on_built_groups(world, data):
    """The learner over the rounds planner (what per_layer training would plan with)."""
    cost = PRIORS["wan-1.3b"]
    lengths = data.draw(lengths_for(world), label="lengths")
    for key in _learner(cost, world, rounds=True).wanted:
        learner = _learner(cost, world, rounds=True)
        first = learner.plan(lengths)
        for k in learner.wanted:
            learner._seen[k] = 0 if k == key else MIN_OBSERVATIONS
        learner.observe(0, first, lengths, [(0.0, 0.0, 0.0)] * len(first.micro_batches))
        assert runtime_violations(learner.plan(lengths), lengths, cost) == [], (world, key)


def _jobs(lengths: list[int], two_experts: bool) -> list[SamplingJob]:
    """Requests of one model (one plan never mixes one-expert and two-expert jobs)."""
    return [
        SamplingJob(tokens=n, steps=4 + i % 3, guided=i % 2 == 0, high_steps=2 if two_experts else None)
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("world", WORLDS)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_sampling_planner_places_every_request_once_on_built_groups(world, data):
    """Each request on one allowed group (two disjoint ones when CFG-parallel), replicated and sharded;
    a sharded plan's rounds hold pairwise disjoint placements and cover every request once."""
    cost = PRIORS["wan-1.3b"].forward()
    lengths = data.draw(st.lists(st.integers(256, 4 * CAP), min_size=1, max_size=min(world + 2, 8)))
    jobs = _jobs(lengths, two_experts=data.draw(st.booleans(), label="two experts"))
    built = set(allowed_groups(world))
    for sharded in (False, True):
        plan = plan_sampling(jobs, world, cost, sharded=sharded)
        assert sorted(p.job for p in plan.placements) == list(range(len(jobs)))
        for p in plan.placements:
            assert p.ranks in built and (p.cfg_ranks is None or p.cfg_ranks in built)
            assert not set(p.ranks) & set(p.cfg_ranks or ())
            assert all(0 <= r < world for r in p.all_ranks)
        if sharded:
            assert sorted(i for rnd in plan.rounds for i in rnd) == list(range(len(plan.placements)))
            for rnd in plan.rounds:
                ranks = [r for i in rnd for r in plan.placements[i].all_ranks]
                assert len(ranks) == len(set(ranks))


@pytest.mark.parametrize("world", [3, 5, 6, 12, 24])
def test_blocks_tile_the_aligned_prefix_and_the_rest_has_none(world):
    """The block list itself: size-c blocks cover ranks 0 .. c*(W//c) - 1 once each, and the ranks past
    them have no block of that size (what exploration must skip rather than look up)."""
    for c in default_cp_sizes(world):
        blocks = blocks_of_size(world, c)
        covered = [r for b in blocks for r in b]
        assert covered == list(range(c * (world // c)))
        assert all(len(b) == c and b[0] % c == 0 for b in blocks)
