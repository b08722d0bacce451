"""The config a user can see: ``--help`` lists every key, ``--print-config`` round-trips, ``--dry-run``
checks a config without weights or training."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from conftest import tiny_overrides

import train
from dit.config import Config, load_config
from dit.config_cli import field_docs

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _leaf_fields(cls=Config, prefix=""):
    """(dotted key, dataclass, field name) of every leaf, straight from the dataclasses."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f.name


def test_help_names_every_config_key_with_its_comment(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    keys = list(_leaf_fields())
    assert len(keys) > 50
    for key, cls, name in keys:
        doc = field_docs(cls)[name]
        assert doc, f"{key} has no comment in dit/config.py: add one beside the field"
        assert f"  {key} = " in text, f"--help does not list {key}"
        assert doc in text, f"--help does not show the comment of {key}"
    assert "  train.lr = 0.0003\n      peak learning rate" in text  # default and comment, in order
    # a comment block above a field (parallel.shard_optimizer's) is its documentation too
    assert (
        "ZeRO-1: each rank keeps the AdamW moments" in field_docs(type(Config().parallel))["shard_optimizer"]
    )


def test_print_config_round_trips(tmp_path, capsys):
    over = ["train.lr=2e-4", "train.lr_schedule=cosine", "model.overrides={num_layers: 2}",
            "train.report_to=[jsonl, tensorboard]", f"output_dir={tmp_path / 'x'}"]  # fmt: skip
    assert train.main(["--config", TINY, *over, "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(printed)
    again = load_config(tmp_path / "printed.yaml")
    assert again == load_config(TINY, over)
    assert (
        again.train.lr == 2e-4
        and again.train.lr_schedule == "cosine"
        and again.model.overrides == {"num_layers": 2}
    )
    assert not (tmp_path / "x").exists()  # printing writes nothing


def _run(*args) -> tuple[subprocess.CompletedProcess, float]:
    """train.py in a fresh interpreter; -> (result, peak RSS of that process in GB)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a small parent without torch, so that RUSAGE_CHILDREN is train.py's own peak
    code = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr)\n"
        "print('RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(r.returncode)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, sys.executable, "train.py", *args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    rss = int(result.stdout.rsplit("RSS_KB", 1)[1]) / 2**20
    return result, rss


def test_dry_run_of_the_shipped_14b_config_names_placeholders_and_counts_parameters():
    result, rss_gb = _run("--config", "configs/wan-14b-finetune.yaml", "--dry-run", "--world-size", "32")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr  # problems found
    assert "14.29B parameters" in out
    for key in ("model.pretrained", "data.source", "data.vae_path", "data.text_encoder_path"):
        assert f"{key}=/path/to/" in out and "does not exist" in out, key
    # parallel.fsdp=auto as the launcher resolves it on 32 H100s (configs/wan-14b-finetune.yaml)
    assert "memory per GPU (estimate, parallel.fsdp=auto -> per_layer): 51.7 GB of 80 GB" in out
    # 14.29B fp32 weights are 57 GB; a meta model and the imports stay far below that
    assert rss_gb < 3.0, rss_gb
    assert not (ROOT / "runs" / "wan-14b-finetune").exists()  # nothing written


def test_dry_run_of_a_runnable_config_prints_data_and_the_first_plan(tmp_path, capsys):
    over = tiny_overrides(tmp_path, **{"parallel.mode": "dynamic"})
    assert train.main(["--config", TINY, *over, "--dry-run", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "64 training clips, 2 validation clips" in out
    assert "tokens per clip: min 16 " in out and "max 72" in out  # 1x8x8 and 3x8x12 clips, patch 1x2x2
    assert "first step's plan:" in out and "ranks [" in out
    assert "no problems found" in out
    assert not (tmp_path / "run").exists()  # trains and writes nothing


def test_dry_run_reports_a_missing_path_and_a_plugin_source_is_not_one(tmp_path):
    from dynamic_cp.dry_run import missing_paths

    cfg = load_config(TINY, tiny_overrides(tmp_path, **{"data.source": "data.examples.plugin:ColourRamps"}))
    assert missing_paths(cfg) == []
    cfg = load_config(TINY, tiny_overrides(tmp_path, **{"data.source": str(tmp_path / "nope.csv")}))
    assert missing_paths(cfg) == [f"data.source={tmp_path / 'nope.csv'} does not exist"]
