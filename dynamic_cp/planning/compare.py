"""Score every planner on one global batch with the same cost model and the same simulator.

Used by ``python -m dynamic_cp.simulate`` and bench/bench_planner.py. A baseline that fails (for
example Megatron's scheduler when a clip needs more GPUs than exist) is reported, not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamic_cp.planning.baselines import static_plan
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.groups_layout import normalize_cp_sizes
from dynamic_cp.planning.megatron_baseline import megatron_plan
from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.planner import check_lengths, min_cp_index, plan
from dynamic_cp.planning.simulator import lower_bound, simulate

METHODS = ("static", "static-balanced", "megatron", "dynamic-cp")


@dataclass
class Row:
    method: str
    step_s: float
    speedup: float  # static step / this step
    efficiency: float  # lower bound / this step
    solver_ms: float
    num_micro_batches: int
    cp_sizes: dict
    plan: Plan | None = None
    error: str = ""


def run_method(method: str, lengths, world_size: int, cap: float, cm: CostModel) -> Plan:
    if method == "static":
        return static_plan(lengths, world_size, cap, cm)
    if method == "static-balanced":
        return static_plan(lengths, world_size, cap, cm, balanced=True)
    if method == "megatron":
        return megatron_plan(lengths, world_size, cap, cm)
    if method == "dynamic-cp":
        return plan(lengths, world_size, cap, cm)
    raise ValueError(f"unknown method {method!r}; use one of {METHODS}")


def compare(lengths, world_size: int, cap: float, cm: CostModel, methods=METHODS) -> tuple[float, list[Row]]:
    """(lower bound, one Row per method). Every plan is re-simulated here, whoever made it.

    A clip that fits no CP size is the user's to fix, so that ValueError is raised, not tabulated.
    """
    min_cp_index(check_lengths(lengths), cap, normalize_cp_sizes(world_size))
    bound = lower_bound(lengths, cm, world_size, cap)
    rows = []
    for m in methods:
        try:
            p = run_method(m, lengths, world_size, cap, cm)
        except Exception as e:  # a baseline's own failure is a result worth showing
            rows.append(
                Row(m, float("nan"), float("nan"), float("nan"), float("nan"), 0, {}, None, repr(e)[:120])
            )
            continue
        step = simulate(p, lengths, cm, timeline=False).step_s
        rows.append(
            Row(m, step, float("nan"), bound / step, p.solver_ms, len(p.micro_batches), p.cp_histogram(), p)
        )
    static = next((r.step_s for r in rows if r.method == "static"), float("nan"))
    for r in rows:
        r.speedup = static / r.step_s
    return bound, rows


def format_rows(bound: float, rows: list[Row]) -> str:
    lines = [
        f"lower bound {bound:.3f} s",
        f"{'method':<16} {'step s':>9} {'vs static':>9} {'efficiency':>10} {'solver ms':>9} {'micro-b':>7}  cp sizes",
    ]
    for r in rows:
        if r.error:
            lines.append(f"{r.method:<16} failed: {r.error}")
            continue
        sizes = " ".join(f"{c}:{n}" for c, n in r.cp_sizes.items())
        speedup = "-" if r.speedup != r.speedup else f"{r.speedup:.2f}x"  # NaN when static was not run
        lines.append(
            f"{r.method:<16} {r.step_s:>9.3f} {speedup:>9} {r.efficiency:>10.3f} "
            f"{r.solver_ms:>9.1f} {r.num_micro_batches:>7}  {sizes}"
        )
    return "\n".join(lines)
