"""How far apart two runs end with the default learned costs, and with ``parallel.deterministic``.

    PYTHONPATH=$PWD python bench/bench_determinism.py --steps 12            # the defaults
    PYTHONPATH=$PWD python bench/bench_determinism.py --steps 12 --deterministic

Runs a, b (uninterrupted) and c (killed at steps/2, resumed) of the tiny config on 2 spawned gloo
ranks with Dynamic-CP, and prints the largest weight and loss difference of b and c against a.
The run settings are tests/test_deterministic.py's, so the figure describes what that test runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import test_deterministic as runs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _final(out: Path, steps: int):
    run = out / "run"
    weights = load_file(
        str(run / "checkpoints" / f"step_{steps:06d}" / "model" / "diffusion_pytorch_model.safetensors")
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return weights, [r["loss"] for r in rows if "loss" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    runs.RUN.update(
        {
            "parallel.deterministic": str(args.deterministic).lower(),
            "train.max_steps": args.steps,
            "train.checkpoint_every": args.steps // 2,
            "train.keep_checkpoints": 4,
        }
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_determinism_"))
    runs._train(tmp / "a", args.steps)
    runs._train(tmp / "b", args.steps)
    runs._train(tmp / "c", args.steps // 2)
    runs._train(tmp / "c", args.steps, resume=True)
    (wa, la), *others = (_final(tmp / name, args.steps) for name in "abc")
    for tag, (w, losses) in zip(("b, uninterrupted", "c, killed and resumed"), others):
        dw = max((wa[k] - w[k]).abs().max().item() for k in wa)
        dl = max(abs(x - y) for x, y in zip(la, losses))
        print(f"a vs {tag}: max |dw| = {dw:.3g}, max |dloss| = {dl:.3g} over {len(losses)} steps")


if __name__ == "__main__":
    main()
