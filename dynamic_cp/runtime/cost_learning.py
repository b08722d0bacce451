"""The planner learns the cluster it runs on: observe executed micro-batches, refit, plan with the fit.

    plan(step s)  -> from the newest model whose ``effective step`` <= s (the prior at first)
    observe(s)    <- every executed micro-batch of step s: lengths, CP size, layout, node span,
                     measured seconds and collective seconds (``StepTimeline``, gathered for free in
                     the step's gradient all-reduce, so every rank holds the same numbers)
    every K steps -> ``CostModel.fit(window of observations, prior)``, used from step s + 1 + lag on
                     (and after 2, 4, 8, ... steps of the run before the first K)
    every step    -> the speed factor: median over the last ``SPEED_STEPS`` steps of measured /
                     fitted seconds of their micro-batches; plans use the fit times it
                     (``CostModel.scaled``), from step s + 1 + lag on

Why a speed factor: a fit averages its window (hundreds of micro-batches, many steps), but a
machine's speed drifts within it (clocks, thermal limits, other jobs on the node): on the CPU
bench, 10-20% for ten steps at a time, which a fit every K steps follows only K steps late. The
shape of the costs (what planning decides on) changes slowly and stays with the fit; the overall
pace is one number, cheap to follow every step. Plans do not change with it (every time scales
alike); predicted step times, the Gantt chart's planned bars and the saved profile do.

Determinism: plans must be identical on every rank, and with ``parallel.plan_ahead`` the plan of step
s+1 runs in a thread while step s computes. So nothing the thread reads changes under it: every
model (and every exploration count) is published with the step it takes effect from, s + 1 + lag
(lag = 1 with plan-ahead: the plan of s+1 was started before step s ended), and a plan of step t uses
the newest one effective at t, whenever the thread happens to run.

Exploration (dynamic mode, bounded): while a (CP size, Ulysses x ring layout) of the allowed set has
fewer than ``MIN_OBSERVATIONS`` observations, each plan may change one micro-batch to run it: a
micro-batch of that size switches layout, or one of another size moves to the aligned block of that
size nested with its group (if there is one: ``groups_layout.block_around``; and if it fits the cap).
The first missing key that some micro-batch can run is tried; the change is taken only if the model
predicts it adds at most ``explore_budget`` of the step; its predicted cost is logged (``explore_s``).
"""

from __future__ import annotations

import json
import statistics
import threading
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path

from dynamic_cp.planning.cost_fit import Observation
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.fsdp_cost import simulate_mode
from dynamic_cp.planning.groups_layout import block_around
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.rounds import lockstep_rounds
from dynamic_cp.planning.simulator import simulate, spans_nodes

MIN_OBSERVATIONS = 3  # per (CP size, layout) before exploration stops asking for it
MAX_OBSERVATIONS = 1024  # the fit's window: recent micro-batches (the cluster may drift)
SPEED_STEPS = 3  # steps whose measured / fitted ratio (median) gives the speed factor
PROFILE_FILE = "learned_profile.yaml"
TIMELINES_FILE = "timelines.jsonl"


class CostLearner:
    """Online cost model of one run; ``plan`` is the runtime's plan function."""

    def __init__(
        self,
        prior: CostModel,
        make_plan: Callable[[CostModel, list[int]], Plan],
        *,
        start_step: int,
        plan_lag: int,
        learn: bool = True,
        refit_every: int = 10,
        explore: bool = True,
        explore_budget: float = 0.1,
        cp_sizes: tuple[int, ...] = (1,),
        cap_tokens: float = float("inf"),
        skip_steps: int = 1,
    ):
        self.prior = prior
        self.make_plan = make_plan
        self.learn, self.refit_every = learn, refit_every
        self.explore = explore and learn
        self.explore_budget = explore_budget
        self.cp_sizes, self.cap_tokens = cp_sizes, cap_tokens
        self.plan_lag = plan_lag
        self.first_step = start_step
        self.skip_steps = skip_steps  # first steps of a run pay one-off costs (allocation, warm-up)
        self._next_plan_step = start_step
        self._lock = threading.Lock()
        # (effective step, model) and (effective step, counts); plans read, the main thread appends
        self._models: list[tuple[int, CostModel]] = [(start_step, prior)]
        self._counts: list[tuple[int, dict]] = [(start_step, {})]
        self._speeds: list[tuple[int, float]] = [(start_step, 1.0)]
        # the last steps' observations, each with the seconds the newest fit gives them
        self._recent: deque[tuple[list[Observation], float]] = deque(maxlen=SPEED_STEPS)
        self.observations: deque[Observation] = deque(maxlen=MAX_OBSERVATIONS)
        self._seen: Counter = Counter()
        self.num_refits = 0
        self.wanted = [(c, lay) for c in cp_sizes for lay in prior.cp_layout(c)]

    # ------------------------------------------------------------------------------ planning side

    @property
    def model(self) -> CostModel:
        """Newest model: the newest fit at the newest speed factor."""
        return _at_speed(self._models[-1][1], self._speeds[-1][1])

    def model_at(self, step: int) -> CostModel:
        """The model the plan of ``step`` used (the fit effective then, at the speed factor then)."""
        return self._planning_model(step)[2]

    def _planning_model(self, step: int) -> tuple[int, float, CostModel]:
        """(effective step of the fit, speed factor, the fit at that speed) for the plan of ``step``."""
        model_step, fitted = self._at(self._models, step)
        speed = self._at(self._speeds, step)[1]
        return model_step, speed, _at_speed(fitted, speed)

    def _at(self, versions: list, step: int) -> tuple:
        """(effective step, value) of the newest version effective at ``step``."""
        with self._lock:
            return next((eff, v) for eff, v in reversed(versions) if eff <= step)

    def plan(self, lengths: list[int], experts: list[str] | None = None) -> Plan:
        """Plan of the next step (calls come in step order, from one thread at a time); with
        ``experts`` (model.expert=both, each clip's) no micro-batch mixes two experts."""
        step = self._next_plan_step
        self._next_plan_step += 1
        model_step, speed, model = self._planning_model(step)
        if experts is None:
            plan = self.make_plan(model, lengths)
        else:
            from dynamic_cp.planning.experts import plan_per_expert

            plan = plan_per_expert(lambda sub: self.make_plan(model, sub), lengths, experts)
        plan.info["layouts"] = [
            model.layout([lengths[i] for i in ids], len(r)) for r, ids in plan.micro_batches
        ]
        plan.info["model_step"] = model_step  # the fit's; the speed factor changes every step
        plan.info["speed"] = speed
        plan.info["explore_s"] = 0.0
        if self.explore:
            self._explore(plan, lengths, model, self._at(self._counts, step)[1])
        return plan

    def _explore(self, plan: Plan, lengths, model: CostModel, counts: dict) -> None:
        running = {(len(r), tuple(lay)) for (r, _), lay in zip(plan.micro_batches, plan.info["layouts"])}
        # keys this plan runs anyway get observed without help
        missing = [k for k in self.wanted if counts.get(k, 0) < MIN_OBSERVATIONS and k not in running]
        if not plan.micro_batches:
            return
        base = plan.predicted_step_s
        # The first missing key that some micro-batch can run. A key can have none this step: at a
        # world size that is not a power of two the ranks past the last aligned block of size c have
        # no block of that size (W = 3: rank 2 has no CP-2 block), and the plan may hold only those.
        for c, layout in missing:
            best = self._cheapest_move(plan, lengths, model, c, layout, base)
            if best is not None:
                break
        else:
            return
        if best[0] > self.explore_budget * base:
            return
        extra, m, ranks = best
        plan.micro_batches[m] = (ranks, plan.micro_batches[m][1])
        # The moved micro-batch may now share ranks with its round's others: per_layer trainers cut a
        # plan without rounds into greedy rounds in plan order (round order, as planned), per expert.
        plan.rounds = None
        plan.info["layouts"][m] = layout
        plan.info["explore_s"] = extra
        plan.info["explored"] = f"cp{c} {layout[0]}x{layout[1]}"
        plan.predicted_step_s = base + extra

    def _cheapest_move(self, plan: Plan, lengths, model: CostModel, c: int, layout, base: float):
        """(extra seconds, micro-batch index, ranks) of the micro-batch whose run as CP ``c`` with
        ``layout`` the model prices cheapest; None when no micro-batch can run it."""
        best = None
        gpn = model.hw.gpus_per_node
        for m, (ranks, ids) in enumerate(plan.micro_batches):
            L = [lengths[i] for i in ids]
            if len(ranks) == c:
                extra = _layout_time(model, L, c, layout, spans_nodes(ranks, gpn)) - model.micro_batch_time(
                    L, c, spans_nodes(ranks, gpn)
                )
                cand = (max(extra, 0.0), m, ranks)
            else:
                block = block_around(ranks, plan.world_size, c)
                if block is None or sum(L) > self.cap_tokens * c:
                    continue
                moved = Plan(list(plan.micro_batches), plan.world_size, plan.cap_tokens)
                moved.micro_batches[m] = (block, ids)
                step = _step_s(moved, lengths, model, plan.fsdp)
                own = model.micro_batch_time(L, c, spans_nodes(block, gpn))
                layout_extra = (
                    _layout_time(model, L, c, layout, spans_nodes(block, gpn)) - own if c > 1 else 0.0
                )
                cand = (max(step - base, 0.0) + max(layout_extra, 0.0), m, block)
            if best is None or cand[0] < best[0]:
                best = cand
        return best

    # ------------------------------------------------------------------------------ learning side

    def observe(
        self, step: int, plan: Plan, lengths: list[int], measured: list[tuple[float, float, float]]
    ) -> bool:
        """Record step ``step``'s micro-batches ((start, seconds, comm seconds) each, plan order);
        refit on schedule. Returns whether a new model was published."""
        new: list[Observation] = []
        if step - self.first_step >= self.skip_steps:
            gpn = self.prior.hw.gpus_per_node
            for (ranks, ids), layout, (_, secs, comm) in zip(
                plan.micro_batches, plan.info["layouts"], measured
            ):
                if secs <= 0:
                    continue
                obs = Observation(
                    tuple(lengths[i] for i in ids),
                    len(ranks),
                    tuple(layout),
                    spans_nodes(ranks, gpn),
                    secs,
                    comm,
                )
                new.append(obs)
                self._seen[(obs.cp, obs.layout)] += 1
            self.observations.extend(new)
        effective = step + 1 + self.plan_lag
        with self._lock:
            self._counts.append((effective, dict(self._seen)))
            del self._counts[:-4]  # a plan never looks back further than the lag
        if not self.learn or not self.observations:
            return False
        refit = self.refit_due(step + 1)
        if refit:
            fitted = self.prior.fit(list(self.observations))
            with self._lock:
                self._models.append((effective, fitted))
                del self._models[:-4]
            self.num_refits += 1
            # the speed factor is relative to the fit in use: re-price the recent steps
            self._recent = deque(((o, _seconds(fitted, o)) for o, _ in self._recent), maxlen=SPEED_STEPS)
        if new:
            self._recent.append((new, _seconds(self._models[-1][1], new)))
        ratios = [sum(o.seconds for o in obs) / pred for obs, pred in self._recent if pred > 0]
        speed = statistics.median(ratios) if ratios else 1.0
        with self._lock:
            self._speeds.append((effective, speed))
            del self._speeds[:-4]
        return refit

    def refit_due(self, steps_done: int) -> bool:  # steps of the run (absolute, so resume agrees)
        """Every ``refit_every`` steps, and at 2, 4, 8, ... steps before that: the prior is most
        wrong at the start, when a fit of few observations is also cheapest."""
        k = self.refit_every
        return steps_done % k == 0 or (
            steps_done < k and steps_done & (steps_done - 1) == 0 and steps_done > 1
        )

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """JSON-able state for exact resume: prior, published models and counts, the window."""

        def hw(m: CostModel) -> dict:
            return {k: getattr(m.hw, k) for k in m.hw.__dataclass_fields__}

        with self._lock:
            return {
                "prior": hw(self.prior),
                "models": [[eff, hw(m)] for eff, m in self._models],
                "counts": [
                    [eff, [[c, list(lay), n] for (c, lay), n in sorted(cnt.items())]]
                    for eff, cnt in self._counts
                ],
                "seen": [[c, list(lay), n] for (c, lay), n in sorted(self._seen.items())],
                "speeds": [[eff, v] for eff, v in self._speeds],
                "recent": [[[o.to_dict() for o in obs], pred] for obs, pred in self._recent],
                "observations": [o.to_dict() for o in self.observations],
                "num_refits": self.num_refits,
            }

    def load_state_dict(self, state: dict) -> None:
        def model(raw: dict) -> CostModel:
            return CostModel(self.prior.dims, Hardware(**raw), self.prior.comm)

        def counts(rows) -> dict:
            return {(int(c), tuple(lay)): int(n) for c, lay, n in rows}

        self.prior = model(state["prior"])
        with self._lock:
            self._models = [(int(eff), model(raw)) for eff, raw in state["models"]]
            self._counts = [(int(eff), counts(rows)) for eff, rows in state["counts"]]
            # (checkpoints from before the speed factor: pace 1 until the next step measures it)
            self._speeds = [(int(eff), float(v)) for eff, v in state.get("speeds", [[self.first_step, 1.0]])]
        self._recent.clear()
        self._recent.extend(
            ([Observation.from_dict(o) for o in obs], float(pred)) for obs, pred in state.get("recent", [])
        )
        self._seen = Counter(counts(state["seen"]))
        self.observations.clear()
        self.observations.extend(Observation.from_dict(o) for o in state["observations"])
        self.num_refits = int(state["num_refits"])

    # ------------------------------------------------------------------------------ files

    def save(self, run_dir: Path, step: int) -> Path:
        """Write the newest model as a hardware profile (``simulate --hardware <it>`` reads it)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / PROFILE_FILE
        header = (
            f"# Learned by the training run at step {step} from {len(self.observations)} micro-batches\n"
            f"# (prior: {self.prior.hw.name}); reloaded on --resume, usable as simulate --hardware {path}\n"
        )
        path.write_text(header + self.model.hw.to_yaml())
        return path


def _step_s(plan: Plan, lengths, model: CostModel, fsdp: str) -> float:
    """A candidate plan's step as its planner prices it: per_layer in greedy lockstep rounds."""
    if fsdp == "per_layer":
        return simulate_mode(lockstep_rounds(plan, plan.world_size), lengths, model, "per_layer").step_s
    return simulate(plan, lengths, model, timeline=False).step_s


def _at_speed(fitted: CostModel, speed: float) -> CostModel:
    return fitted if speed == 1.0 else fitted.scaled(speed)


def _seconds(fitted: CostModel, observations: list[Observation]) -> float:
    """Seconds ``fitted`` gives ``observations``, each at the layout it ran."""
    return sum(_layout_time(fitted, o.lengths, o.cp, o.layout, o.cross_node) for o in observations)


def _layout_time(model: CostModel, L, c: int, layout, cross: bool) -> float:
    """Micro-batch seconds when it runs ``layout`` rather than the cheapest one."""
    import numpy as np

    base = model.micro_batch_time(L, c, cross)
    if c <= 1:
        return base
    Ls = np.asarray(L, dtype=np.float64)
    attn = model._attn_time(Ls, c).sum()
    layouts, times = model._layout_times(Ls.sum(), c, attn, cross)
    cheapest = float(times.min())
    return base - cheapest + float(times[layouts.index(tuple(layout))])


def write_timeline(run_dir: Path, step: int, plan: Plan, lengths, model: CostModel, measured) -> None:
    """Planned and measured start/seconds of every micro-batch of ``step`` (for the Gantt chart)."""
    planned = simulate(plan, lengths, model)
    starts = {i: s for segs in planned.rank_segments for s, _, i in segs}
    rows = []
    for m, ((ranks, ids), (start, secs, comm)) in enumerate(zip(plan.micro_batches, measured)):
        rows.append(
            {
                "ranks": list(ranks),
                "lengths": [int(lengths[i]) for i in ids],
                "layout": list(plan.info.get("layouts", [(1, 1)] * len(measured))[m]),
                "start": round(start, 6),
                "seconds": round(secs, 6),
                "comm_s": round(comm, 6),
                "planned_start": round(starts.get(m, 0.0), 6),
                "planned_s": round(planned.mb_times[m], 6),
            }
        )
    record = {"step": step, "world_size": plan.world_size, "micro_batches": rows}
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / TIMELINES_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def load_prior(hardware: str, run_dir: Path, resume: bool) -> Hardware | None:
    """The learned profile of this run when resuming with ``hardware: auto``, else None."""
    path = run_dir / PROFILE_FILE
    if resume and hardware == "auto" and path.exists():
        return Hardware.load(str(path))
    return None


STATE_FILE = "cost_learning.json"  # in each checkpoint directory: the learner's state for exact resume


def build_learner(
    cfg, model_config, world, device, start_step: int, resume_dir: Path | None, fsdp: str = "none"
) -> CostLearner:
    """The run's learner: prior from ``parallel.hardware`` ('auto', a name or a path), state restored
    from the checkpoint being resumed (so a resumed run plans exactly as the uninterrupted one).
    ``fsdp``: the resolved weight-sharding mode the plans are made for."""
    from dynamic_cp.runtime.auto_hardware import auto_hardware
    from dynamic_cp.runtime.step_plans import build_cost_model, cap_tokens_of, cp_sizes_of, make_plan_fn

    p = cfg.parallel
    # the plan's world: the ranks of one pipeline stage (all of them without a pipeline)
    world_size = (world.size() if world is not None else 1) // p.pp_size
    saved = resume_dir / STATE_FILE if resume_dir is not None else None
    hw = None
    if p.hardware == "auto":
        learned = Path(cfg.output_dir) / PROFILE_FILE
        if saved is not None and saved.exists():
            hw = None  # restored below with the rest of the state
        elif resume_dir is not None and learned.exists():
            hw = Hardware.load(str(learned))
        elif p.deterministic and device.type != "cuda":
            # the CPU measurement times kernels, and its prices differ run to run
            hw = Hardware.load("h100")
        else:
            base = build_cost_model(cfg, model_config, Hardware.load("h100"))
            hw = auto_hardware(base.dims, device, world)
    prior = build_cost_model(
        cfg, model_config, hw or (Hardware.load("h100") if p.hardware == "auto" else None)
    )
    learner = CostLearner(
        prior,
        lambda model, lengths: make_plan_fn(cfg, model, world_size, fsdp)(lengths),
        start_step=start_step,
        plan_lag=1 if p.plan_ahead else 0,
        learn=p.learn_costs and not p.deterministic,
        refit_every=p.refit_every,
        explore=p.mode == "dynamic" and p.explore_budget > 0 and not p.deterministic,
        explore_budget=p.explore_budget,
        cp_sizes=cp_sizes_of(cfg, world_size),
        cap_tokens=cap_tokens_of(cfg),
    )
    if saved is not None and saved.exists():
        learner.load_state_dict(json.loads(saved.read_text()))
    return learner
