"""Predicted against measured step times of a run, and one step's Gantt chart planned beside measured.

    python -m dynamic_cp.plot_costs runs/x                 # runs/x/costs.png
    python -m dynamic_cp.plot_costs runs/x --step 40       # and runs/x/gantt_step40.png

Reads ``metrics.jsonl`` (predicted_s / compute_s: the compute window; predicted_step_s / step_s:
the whole step; cost_speed: the learner's speed factor, on a right-hand axis) and
``timelines.jsonl`` (every micro-batch of the logged steps: planned start and seconds under the
cost model the step was planned with, measured start and seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dynamic_cp.planning.plan_types import Plan
from dynamic_cp.planning.simulator import Schedule, gantt


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        raise ValueError(
            f"{path} does not exist; is this the output_dir of a parallel.mode=dynamic/static run?"
        )
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def plot_steps(metrics: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in metrics if "compute_s" in r]
    if not rows:
        raise ValueError("metrics.jsonl has no step with compute_s: run with parallel.mode=dynamic or static")
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(steps, [r["compute_s"] for r in rows], "o-", ms=3, label="compute window, measured")
    ax.plot(steps, [r["predicted_s"] for r in rows], "o--", ms=3, label="compute window, predicted")
    with_step = [r for r in rows if "predicted_step_s" in r]
    ax.plot(steps, [r["step_s"] for r in rows], "s-", ms=3, alpha=0.6, label="step, measured")
    ax.plot(
        [r["step"] for r in with_step],
        [r["predicted_step_s"] for r in with_step],
        "s--",
        ms=3,
        alpha=0.6,
        label="step, predicted",
    )
    for r in rows:
        if r.get("explore_s", 0) > 0:
            ax.axvline(r["step"], color="grey", lw=0.5, alpha=0.4)
    ax.set_xlabel("step (grey lines: a micro-batch ran an exploratory CP size or layout)")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    with_speed = [r for r in rows if "cost_speed" in r]
    if with_speed:  # the learner's pace factor on its fit (cost_learning.py): drift made visible
        ax2 = ax.twinx()
        (line,) = ax2.plot(
            [r["step"] for r in with_speed], [r["cost_speed"] for r in with_speed], ":", color="grey"
        )
        ax2.set_ylabel("speed factor (measured / fitted)")
        handles, labels = [*handles, line], [*labels, "speed factor, right axis"]
    ax.legend(handles, labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_gantt(record: dict, out: Path) -> None:
    """Two charts stacked in one file: planned (cost model) over measured."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import image
    from matplotlib import pyplot as plt

    world, mbs = record["world_size"], record["micro_batches"]
    plan = Plan([(tuple(m["ranks"]), [i]) for i, m in enumerate(mbs)], world, float("inf"))
    lengths = [sum(m["lengths"]) for m in mbs]
    parts = []
    for kind, start, secs in (("planned", "planned_start", "planned_s"), ("measured", "start", "seconds")):
        segs: list[list] = [[] for _ in range(world)]
        for i, m in enumerate(mbs):
            for r in m["ranks"]:
                segs[r].append((m[start], m[start] + m[secs], i))
        step_s = max((e for s in segs for _, e, _ in s), default=0.0)
        path = out.with_name(f"{out.stem}_{kind}.png")
        title = f"step {record['step']} {kind}: {step_s:.3f} s"
        gantt(Schedule(step_s, segs, [m[secs] for m in mbs]), plan, lengths, str(path), title)
        parts.append(path)
    fig, axes = plt.subplots(2, 1, figsize=(12, 8))
    for ax, p in zip(axes, parts):
        ax.imshow(image.imread(p))
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dynamic_cp.plot_costs", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="a training run's output_dir")
    ap.add_argument("--step", type=int, help="also draw this step's Gantt chart (a logged step)")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    try:
        plot_steps(_lines(run / "metrics.jsonl"), run / "costs.png")
        print(f"wrote {run / 'costs.png'}")
        if args.step is not None:
            records = {r["step"]: r for r in _lines(run / "timelines.jsonl")}
            if args.step not in records:
                raise ValueError(f"step {args.step} has no timeline; logged steps: {sorted(records)[:20]}")
            out = run / f"gantt_step{args.step}.png"
            plot_gantt(records[args.step], out)
            print(f"wrote {out}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
