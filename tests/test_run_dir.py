"""A new run never mixes with an old one in the same output_dir: refused, resumed, or moved aside."""

import json
from pathlib import Path

import pytest
from conftest import tiny_overrides

import train
from dit.run_dir import prepare_output_dir

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")


def _old_run(out: Path) -> None:
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 1.0}) + "\n")


def test_fresh_or_empty_dirs_are_fine(tmp_path):
    assert prepare_output_dir(str(tmp_path / "new"), None, False, True) is None
    (tmp_path / "empty" / "samples").mkdir(parents=True)  # no run files: not a run
    assert prepare_output_dir(str(tmp_path / "empty"), None, False, True) is None


def test_used_dir_is_refused_unless_resumed(tmp_path):
    out = tmp_path / "run"
    _old_run(out)
    with pytest.raises(ValueError, match="already holds a run .*--resume.*output_dir=.*--overwrite"):
        prepare_output_dir(str(out), None, False, True)
    with pytest.raises(ValueError, match="already holds a run"):  # resuming another run into this one
        prepare_output_dir(str(out), str(tmp_path / "other"), False, True)
    assert prepare_output_dir(str(out), str(out), False, True) is None
    assert prepare_output_dir(str(out), str(out / "checkpoints" / "step_000002"), False, True) is None
    with pytest.raises(ValueError, match="drop one of the two"):
        prepare_output_dir(str(out), str(out), True, True)


def test_overwrite_moves_the_old_run_aside_on_the_main_rank_only(tmp_path):
    out = tmp_path / "run"
    _old_run(out)
    assert prepare_output_dir(str(out), None, True, False) is None and out.exists()  # rank 1: untouched
    assert prepare_output_dir(str(out), None, True, True) == tmp_path / "run.old-1"
    _old_run(out)
    assert prepare_output_dir(str(out), None, True, True) == tmp_path / "run.old-2"
    assert not out.exists()
    assert (tmp_path / "run.old-1" / "metrics.jsonl").is_file()  # moved whole, nothing deleted
    assert (tmp_path / "run.old-2" / "checkpoints" / "step_000002").is_dir()


def test_train_refuses_then_overwrites(tmp_path, capsys):
    over = tiny_overrides(tmp_path, **{"train.max_steps": 1, "train.checkpoint_every": 1})
    _old_run(tmp_path / "run")
    assert train.main(["--config", TINY, *over]) == 2
    assert "already holds a run (metrics.jsonl and checkpoints)" in capsys.readouterr().err
    assert train.main(["--config", TINY, *over, "--overwrite"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # one step-0 validation row: the new run's alone
    assert (tmp_path / "run.old-1" / "metrics.jsonl").read_text().count("\n") == 1
