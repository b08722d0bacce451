"""Every checkpoint format, resumed by every launch mode: it continues, or it stops in one line and
leaves the run as it was (issue 57).

Five runs write a checkpoint at step 2: replicated files (one process), LoRA adapters (one process),
A14B's two experts (``model.expert=both``, one process), FSDP ``per_step`` DCP shards (2 ranks) and
pipeline stage files (PP 2 x 2, 4 ranks). Each is copied and resumed with ``--resume auto`` to step 3
by one process, by 2 replicated ranks and by PP 2 x 2, through ``train.resolve_resume`` (what
train.py runs on every rank before it builds anything) and the launcher train.py uses. Where the
layout reads the format (``dit/resume_checks.py``'s table), the run must resume from step 2, log
step 3, and keep every metrics line before it and the step-2 checkpoint byte for byte; where it does
not, ``resolve_resume`` stops in one line naming the checkpoint, its format and the command, and the
run directory is byte for byte what it was. (The numbers a resumed run reaches are checked where
each layout's parity lives: tests/test_pipeline.py resumes the stage checkpoint in one process, at
other pp_sizes and replicated, within the single-process bounds.)

Planted and seen to fail: the whole-checkpoint test ignoring stage files (a stage checkpoint read as
"model/ holds no safetensors weights": the one-process and replicated resumes of the stage checkpoint
start fresh and drop the metrics); the refusal check skipped (the DCP checkpoint fails inside the
trainer after the run's config.yaml was rewritten... or, for PP, after the trainer was built).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import tiny_overrides

import train
from dit.config import load_config
from dynamic_cp.runtime.testing import run_gloo

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = {"train.max_steps": 2, "train.checkpoint_every": 2, "train.val_every": 100}
DIST = {"parallel.mode": "dynamic", "parallel.plan_ahead": False, "parallel.hardware": "h100",
        "parallel.learn_costs": False}  # fmt: skip
# what each format's run sets, and on how many ranks it is written
FORMATS = {
    "replicated": ({}, 1),
    # a random base (no adaLN-zero) so that the adapters get gradients without model.pretrained
    "lora": (
        {
            "model.lora": "{rank: 4}",
            "model.overrides": "{num_layers: 2, ffn_dim: 128, adaln_zero_init: false}",
        },
        1,
    ),  # fmt: skip
    "experts": ({"model.expert": "both", "model.boundary_ratio": 0.875}, 1),
    "fsdp": ({**DIST, "parallel.fsdp": "per_step"}, 2),
    "stages": ({**DIST, "parallel.pp_size": 2, "parallel.fsdp": "none"}, 4),
}
LAYOUTS = {
    "one": ({"parallel.mode": "none", "parallel.pp_size": 1, "parallel.fsdp": "none"}, 1),
    "replicated": ({**DIST, "parallel.pp_size": 1, "parallel.fsdp": "none"}, 2),
    "pp2x2": ({**DIST, "parallel.pp_size": 2, "parallel.fsdp": "none"}, 4),
}
# (format, layout) pairs that continue; every other pair is refused in one line
CONTINUES = {
    ("replicated", "one"), ("replicated", "replicated"), ("replicated", "pp2x2"),
    ("lora", "one"), ("lora", "replicated"),
    ("experts", "one"), ("experts", "replicated"),
    ("stages", "one"), ("stages", "replicated"), ("stages", "pp2x2"),
}  # fmt: skip


def _argv(run: Path, fmt: str, layout: str | None) -> list[str]:
    """The format's run, or its resume under ``layout``: the format's model keys, the layout's parallel
    keys (free to change on a resume) and one more step."""
    items = {**STEPS, **FORMATS[fmt][0]}
    if layout is not None:
        items = {k: v for k, v in items.items() if not k.startswith("parallel.")}
        items.update(LAYOUTS[layout][0], **{"train.max_steps": 3})
    return ["--config", TINY, *tiny_overrides(run.parent, **items)]


def _launch(rank: int, world_size: int, runs: list[list[str]]) -> list:
    """train.py's run() on an already joined gloo group: resolve the resume on every rank, then train."""
    from dynamic_cp.runtime.launch import train_distributed

    os.environ["RANK"] = str(rank)  # resolve_resume reports and moves on rank 0 alone
    out = []
    for argv in runs:
        try:
            cfg = load_config(TINY, argv[2:])
            step_dir = train.resolve_resume(cfg, "auto", overwrite=False)
            trainer = train_distributed(cfg, dist.group.WORLD, resume=step_dir)
            out.append({"resumed": step_dir, "step": trainer.step})
        except Exception:
            out.append({"error": traceback.format_exc()})
    return out


def _run_in_process(argv: list[str]) -> dict:
    cfg = load_config(TINY, argv[2:])
    step_dir = train.resolve_resume(cfg, "auto", overwrite=False)
    assert train.main([*argv, "--resume", "auto"]) == 0
    return {"resumed": step_dir, "step": None}


def _launch_all(runs: list[list[str]], world_size: int) -> list[dict]:
    if not runs:
        return []
    if world_size == 1:
        return [_run_in_process(argv) for argv in runs]
    results = run_gloo(_launch, world_size, runs, timeout_s=300)
    for r, per_rank in enumerate(results):
        for res in per_rank:
            assert "error" not in res, f"rank {r}:\n{res['error']}"
    return results[0]


def _files(run: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


def _rows(run: Path) -> list[str]:
    return (run / "metrics.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """{format: the run directory of its 2-step run}, each holding checkpoints/step_000002."""
    root = tmp_path_factory.mktemp("written")
    runs = {fmt: root / fmt / "run" for fmt in FORMATS}
    for world_size in (1, 2, 4):
        _launch_all([_argv(runs[f], f, None) for f, (_, w) in FORMATS.items() if w == world_size], world_size)
    for fmt, run in runs.items():
        assert (run / "checkpoints" / "step_000002" / "trainer.pt").is_file(), fmt
    return runs


def test_every_format_resumes_or_is_refused_under_every_layout(written, tmp_path, capsys):
    copies, before = {}, {}
    for fmt, run in written.items():
        for layout in LAYOUTS:
            copy = tmp_path / f"{fmt}-{layout}" / "run"
            shutil.copytree(run, copy)
            copies[fmt, layout], before[fmt, layout] = copy, _files(copy)

    # the refused pairs: one line naming the checkpoint, its format and the command; nothing touched
    for (fmt, layout), copy in copies.items():
        if (fmt, layout) in CONTINUES:
            continue
        cfg = load_config(TINY, _argv(copy, fmt, layout)[2:])
        with pytest.raises(ValueError) as err:
            train.resolve_resume(cfg, "auto", overwrite=False)
        line = str(err.value)
        assert "\n" not in line and "step_000002" in line and "train.py --config" in line, line
        assert ("FSDP shards" if fmt == "fsdp" else "replicated weights") in line, line
        assert ("LoRA" in line) == (fmt == "lora") and ("both experts" in line) == (fmt == "experts"), line
        assert _files(copy) == before[fmt, layout], f"{fmt} under {layout}: a refused resume changed the run"
        # the same refusal through train.py's command line: one line, exit 2
        assert train.main([*_argv(copy, fmt, layout), "--resume", "auto"]) == 2
        assert _files(copy) == before[fmt, layout]
    capsys.readouterr()

    # the continued pairs, one launch per layout
    for layout, (_, world_size) in LAYOUTS.items():
        pairs = [(fmt, lay) for fmt, lay in CONTINUES if lay == layout]
        results = _launch_all([_argv(copies[p], p[0], layout) for p in pairs], world_size)
        for (fmt, _), res in zip(pairs, results):
            copy = copies[fmt, layout]
            where = f"{fmt} resumed under {layout}"
            assert res["resumed"] == str(copy / "checkpoints" / "step_000002"), where
            rows = _rows(copy)
            old = _rows(written[fmt])
            assert rows[: len(old)] == old, f"{where}: a metrics line before step 2 changed or went"
            new_steps = [json.loads(r)["step"] for r in rows[len(old) :]]
            assert new_steps and set(new_steps) == {3}, f"{where}: logged {new_steps} after step 2"
            now = _files(copy)
            kept = {k: v for k, v in before[fmt, layout].items() if k.startswith("checkpoints/step_000002/")}
            assert {k: now.get(k) for k in kept} == kept, f"{where}: the step-2 checkpoint changed"
            assert (copy / "checkpoints" / "step_000003").is_dir(), where
