"""Issue 54's smaller frictions of a new user's first hour, each checked as the user meets it: what
the run says at start, at each validation and at the end; sample.py's grid names, help and the line
saying what it samples; config typos and the file they are in; the data commands' messages."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _data_media import make_clips
from conftest import tiny_overrides

import sample
import train
from data.failures import too_many_failures
from dit.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = ["--frames", "1", "--height", "8", "--width", "8", "--steps", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``train.py`` as a user runs it: 2 steps of the tiny config; -> (output_dir, its console)."""
    tmp = tmp_path_factory.mktemp("first_hour")
    over = tiny_overrides(tmp, **{"train.max_steps": 2, "train.checkpoint_every": 2})
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", TINY, *over],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return tmp / "run", out.stdout


def test_the_run_says_it_started_each_validation_loss_and_where_its_checkpoint_is(run):
    out_dir, console = run
    lines = console.splitlines()
    assert lines[0] == f"{out_dir}: building the model and the data (synthetic), then step 0"
    assert re.search(r"^step 0: validation loss \d+\.\d{4}$", console, flags=re.M), console
    assert re.search(r"^step 2: validation loss \d+\.\d{4}$", console, flags=re.M), console
    assert lines[-1] == (
        f"done: checkpoint {out_dir}/checkpoints/step_000002; sample it with: python sample.py "
        f'--checkpoint {out_dir} --prompt "your caption" --grid'
    )


def test_sample_says_what_it_samples_and_each_queue_gets_its_own_grid(run, tmp_path, capsys):
    out_dir, _ = run
    out = tmp_path / "clips"
    for prompt in ("a red circle", "a blue square"):
        assert sample.main(["--checkpoint", str(out_dir), *SMALL, "--grid", "--prompt", prompt, "--out", str(out)]) == 0  # fmt: skip
    said = capsys.readouterr().out
    weights = out_dir / "checkpoints" / "step_000002" / "model"  # 2 steps: the EMA is not ready
    assert (
        f"sampling 1 clip(s) with {weights.resolve()}: 1x8x8 (frames x height x width), 2 steps, "
        "guidance 4.0, shift 3.0, seed 0"
    ) in said
    assert len(list(out.glob("grid_seed0_*.png"))) == 2  # the second grid did not overwrite the first


def test_sample_help_gives_the_shape_seed_and_fps_flags_their_defaults(capsys):
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ["frames per clip (default 9)", "clip height in pixels (default 16)",
                  "clip width in pixels (default 16)", "request i takes seed + i (default 0)",
                  "frame rate written into the mp4s (default 8)"]:  # fmt: skip
        assert words in text, words


def test_a_run_directory_as_model_pretrained_names_its_checkpoint(run):
    from dit.wan_pipeline_folders import transformer_folder

    out_dir, _ = run
    step = out_dir / "checkpoints" / "step_000002"
    with pytest.raises(ValueError, match=re.escape(f"pass one checkpoint's weights, e.g. its newest: model.pretrained={step / 'ema'} (or {step / 'model'})")):  # fmt: skip
        transformer_folder(out_dir)


def test_config_typos_get_the_nearest_key_and_the_file_they_are_in(tmp_path):
    with pytest.raises(
        ValueError, match=r"unknown config key train\.max_step; .*; did you mean train\.max_steps\?$"
    ):
        load_config(TINY, ["train.max_step=5"])
    bad = tmp_path / "my.yaml"
    bad.write_text("train:\n  max_step: 5\n")
    with pytest.raises(
        ValueError, match=rf"unknown config key train\.max_step \(in config file {re.escape(str(bad))}\)"
    ):
        load_config(bad)
    bad.write_text("train:\n  max_steps: many\n")
    with pytest.raises(
        ValueError,
        match=rf"train\.max_steps='many' must be of type int \(in config file {re.escape(str(bad))}\)",
    ):
        load_config(bad)
    load_config(bad, ["train.max_steps=5"])  # an override of the file's key: its value counts
    assert load_config(TINY, ["train.report_to=jsonl"]).train.report_to == ["jsonl"]


def test_too_many_failures_is_one_line_naming_where_the_key_goes():
    text = too_many_failures(1, 7, 0.05, {"clips/broken.mp4": "not_a_video_or_corrupt"})
    assert "\n" not in text
    assert text.startswith("1 of 7 files failed (14.3%), above max_failure_share=5.0% (clips/broken.mp4")
    # 14.3% passes at the next 5% step, 0.15
    assert "train.py 'data.options={max_failure_share: 0.15}', python -m data.cache --option max_failure_share=0.15" in text  # fmt: skip


def test_dry_run_says_the_80_gb_are_an_assumed_profile(tmp_path, capsys):
    assert train.main(["--config", TINY, f"output_dir={tmp_path / 'run'}", "--dry-run"]) == 0
    assert "GB of 80 GB (an assumed h100: set parallel.hardware or parallel.memory_gb for yours)" in (
        capsys.readouterr().out
    )


def test_data_commands_write_clean_paths_and_keep_warnings_off_the_progress_bar(tmp_path):
    videos = tmp_path / "videos"
    make_clips(str(videos))
    (videos / "broken.mp4").write_bytes(b"not a video\n" * 20)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "data.scan", str(videos), "--out", str(tmp_path / "m.csv")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    skips = [ln for ln in done.stderr.split("\n") if "data: skipping" in ln]
    assert len(skips) == 1, done.stderr
    # tqdm redraws the bar after "\r": the warning must start its own line, not follow the bar's text
    assert skips[0].split("\r")[-1].startswith("data: skipping"), repr(skips[0])
    cmd = [sys.executable, "-m", "data.cache", "--source", "m.csv", "--out", "cache/", "--vae", "identity"]
    cmd += ["--text-encoder", "hashed", "--resolution", "16", "--max-frames", "5", "--option", "max_failure_share=0.5"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote cache/index.json" in done.stdout.splitlines()
