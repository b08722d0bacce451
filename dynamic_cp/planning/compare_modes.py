"""Every weight-sharding mode side by side: memory per GPU, whether it fits, and each method's step.

For each mode the token cap is what the mode's memory leaves (``memory.mode_token_cap``) unless a
cap is given; static CP, Megatron's scheduler and Dynamic-CP are all planned under that cap and
priced under that mode (``fsdp_cost.simulate_mode``): barrier-free plans plus step-end collectives
for none and per_step, greedy lockstep rounds for the baselines under per_layer (Megatron already
runs barrier-separated groups; static CP cut into rounds), ``plan_rounds`` for Dynamic-CP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamic_cp.planning.baselines import static_plan
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.fsdp_cost import mode_lower_bound, simulate_mode
from dynamic_cp.planning.megatron_baseline import megatron_plan
from dynamic_cp.planning.memory import FSDP_MODES, choose_fsdp_mode, memory_breakdown, mode_token_cap
from dynamic_cp.planning.rounds_planner import plan_for_mode

MODE_METHODS = ("static", "static-balanced", "megatron", "dynamic-cp")


@dataclass
class ModeRow:
    mode: str
    states_bytes: float
    total_bytes: float  # states + activations at the cap
    cap: int
    fits: bool
    bound_s: float = float("nan")
    steps: dict = field(default_factory=dict)  # method -> step seconds (NaN when it failed)
    rounds: dict = field(default_factory=dict)  # method -> lockstep rounds (per_layer)
    errors: dict = field(default_factory=dict)

    def speedup(self, baseline: str) -> float:
        return self.steps.get(baseline, float("nan")) / self.steps.get("dynamic-cp", float("nan"))


def _method_plan(method, lengths, world, cap, cm, mode):
    if method == "static":
        return static_plan(lengths, world, cap, cm)
    if method == "static-balanced":
        return static_plan(lengths, world, cap, cm, balanced=True)
    if method == "megatron":
        return megatron_plan(lengths, world, cap, cm)
    return plan_for_mode(lengths, world, cap, cm, mode)


def compare_modes(
    lengths,
    world_size: int,
    cm: CostModel,
    activation_checkpointing: bool = False,
    cap: float | None = None,
    modes=FSDP_MODES,
    methods=MODE_METHODS,
    memory_fraction: float = 0.9,
) -> tuple[str | None, list[ModeRow]]:
    """(mode ``auto`` picks for this cap, or None if none fits; one row per mode)."""
    need = None if cap is None else int(cap)
    try:
        chosen = choose_fsdp_mode(
            cm.dims,
            world_size,
            need,
            cm.hw.memory_bytes,
            activation_checkpointing,
            memory_fraction=memory_fraction,
        )[0]
    except ValueError:
        chosen = None
    longest = max(lengths) if len(lengths) else 0
    rows = []
    for mode in modes:
        mem = memory_breakdown(cm.dims, mode, world_size, 0.0, activation_checkpointing)
        room = mode_token_cap(mem, cm.hw.memory_bytes, memory_fraction)
        use = room if cap is None else int(cap)
        # fits: states and the cap's activations fit, and the longest clip fits on all ranks
        fits = 1 <= use <= room and longest <= use * world_size
        row = ModeRow(mode, mem.states, mem.states + use * mem.activations_per_token, use, fits)
        rows.append(row)
        if not fits:
            continue
        row.bound_s = mode_lower_bound(lengths, cm, world_size, use, mode)
        for m in methods:
            try:
                p = _method_plan(m, lengths, world_size, use, cm, mode)
            except Exception as e:  # a baseline's own failure is a result worth showing
                row.steps[m] = float("nan")
                row.errors[m] = repr(e)[:120]
                continue
            s = simulate_mode(p, lengths, cm, mode)
            row.steps[m] = s.step_s
            row.rounds[m] = s.num_rounds
    return chosen, rows


def format_mode_rows(chosen: str | None, rows: list[ModeRow], memory_bytes: float) -> str:
    gb = 1e9
    lines = [
        f"weight sharding (parallel.fsdp); auto picks {chosen or 'nothing: no mode fits'}; "
        f"GB/GPU = states + activations at the cap, HBM {memory_bytes / gb:.0f} GB",
        f"{'fsdp':<10} {'GB/GPU':>7} {'states':>7} {'fits':>4} {'cap tok':>8} {'bound s':>8} {'static':>8} "
        f"{'st-bal':>8} {'megatron':>8} {'dyn-cp':>8} {'x static':>8} {'x megatron':>10} {'eff dyn':>7} {'rounds':>6}",
    ]
    for r in rows:
        head = (
            f"{r.mode + ('*' if r.mode == chosen else ''):<10} {r.total_bytes / gb:>7.1f} "
            f"{r.states_bytes / gb:>7.1f} {'yes' if r.fits else 'no':>4} {r.cap:>8,}"
        )
        if not r.fits:
            lines.append(head)
            continue
        step = {m: r.steps.get(m, float("nan")) for m in MODE_METHODS}
        rounds = r.rounds.get("dynamic-cp", 0)
        lines.append(
            f"{head} {r.bound_s:>8.2f} {step['static']:>8.2f} {step['static-balanced']:>8.2f} {step['megatron']:>8.2f} "
            f"{step['dynamic-cp']:>8.2f} {r.speedup('static'):>7.2f}x {r.speedup('megatron'):>9.2f}x "
            f"{r.bound_s / step['dynamic-cp']:>7.3f} {rounds if r.mode == 'per_layer' else '-':>6}"
        )
        for m, e in r.errors.items():
            lines.append(f"    {m} failed: {e}")
    lines.append("(* = auto's choice; step times include each mode's weight collectives)")
    return "\n".join(lines)
