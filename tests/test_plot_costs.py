"""``python -m dynamic_cp.plot_costs``: predicted vs measured over the steps, and one step's Gantt
chart planned over measured; clear errors for a run without timelines. Plus the config checks of
the learning knobs."""

from __future__ import annotations

import json

import pytest

from dit.config import load_config
from dynamic_cp.plot_costs import main


def _run_dir(tmp_path):
    metrics = [{"step": 0, "val_loss": 1.0}]
    for s in range(1, 4):
        metrics.append(
            {
                "step": s,
                "compute_s": 1.0 + 0.1 * s,
                "predicted_s": 1.05,
                "step_s": 1.3,
                "explore_s": 0.02 if s == 2 else 0.0,
                **({"predicted_step_s": 1.35} if s > 1 else {}),
            }
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    mbs = [
        {"ranks": [0, 1], "lengths": [576], "layout": [2, 1], "start": 0.0, "seconds": 0.5, "comm_s": 0.1,
         "planned_start": 0.0, "planned_s": 0.45},
        {"ranks": [0], "lengths": [64, 128], "layout": [1, 1], "start": 0.5, "seconds": 0.2, "comm_s": 0.0,
         "planned_start": 0.45, "planned_s": 0.25},
        {"ranks": [1], "lengths": [256], "layout": [1, 1], "start": 0.52, "seconds": 0.3, "comm_s": 0.0,
         "planned_start": 0.45, "planned_s": 0.3},
    ]  # fmt: skip
    (tmp_path / "timelines.jsonl").write_text(
        json.dumps({"step": 2, "world_size": 2, "micro_batches": mbs}) + "\n"
    )
    return tmp_path


def test_plots_steps_and_a_gantt(tmp_path):
    run = _run_dir(tmp_path)
    assert main([str(run), "--step", "2"]) == 0
    for name in ("costs.png", "gantt_step2.png", "gantt_step2_planned.png", "gantt_step2_measured.png"):
        assert (run / name).stat().st_size > 1000


def test_missing_step_and_missing_run_are_clear_errors(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert main([str(run), "--step", "7"]) == 2
    assert "step 7 has no timeline; logged steps: [2]" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_learning_config_is_checked():
    cfg = load_config(None, [])
    assert cfg.parallel.hardware == "auto" and cfg.parallel.learn_costs
    with pytest.raises(ValueError, match="parallel.refit_every=0"):
        load_config(None, ["parallel.refit_every=0"])
    with pytest.raises(ValueError, match="parallel.explore_budget=2.0"):
        load_config(None, ["parallel.explore_budget=2.0"])


def test_auto_hardware_needs_the_runtime():
    from dynamic_cp.runtime.step_plans import build_cost_model

    cfg = load_config(None, [])

    class Dims:
        num_attention_heads, attention_head_dim, num_layers, ffn_dim = 4, 32, 2, 256

    with pytest.raises(ValueError, match="parallel.hardware=auto is resolved by the runtime"):
        build_cost_model(cfg, Dims())
