"""Every command line reports a user's mistake as one message, exit code 2, no traceback (issue 14).

The commands that import no torch (``data.scan``, ``dynamic_cp.simulate``) run as real ``python -m``
launches in a subprocess. The others (train.py, sample.py, ``data.cache``, ``dynamic_cp.calibrate``)
run their ``main(argv)`` in this process, the exit status being its return value and the messages
read from file descriptor 2 (``capfd``: decord's native writes too): a fresh interpreter would only add
a torch import (about 10 s each under the CI machine's load) and the one line ``sys.exit(main())``,
whose real exit status ``test_train.py`` keeps for train.py and sample.py. Planted: ``run_cli``
printing a second stderr line -> the in-process resume case fails; the native stderr filter made a
no-op -> the in-process broken-files case fails (decord's C++ lines reach fd 2).
"""

import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _data_media import make_broken, make_clips
from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _run(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=180
    )


def _main(module: str, argv: list[str], capfd) -> subprocess.CompletedProcess:
    """``module.main(argv)`` in this process, as a CompletedProcess: its return value and fd 1 and 2."""
    main = importlib.import_module(module).main
    capfd.readouterr()  # drop what earlier set-up wrote
    code = main(argv)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([module, *argv], code, out, err)


def _user_error(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"error: {message}" in result.stderr, result.stderr


def _lines_naming(path: str, text: str) -> int:
    return sum(path in line for line in text.splitlines())


@pytest.fixture(scope="module")
def broken_folder(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Two good clips and four broken files: most of the folder is broken."""
    root = tmp_path_factory.mktemp("broken")
    good = make_clips(str(root / "good"))
    folder = root / "videos"
    folder.mkdir()
    for p in good[:2]:
        os.link(p, folder / os.path.basename(p))
    return folder, make_broken(str(folder), good[0])


def test_train_too_many_broken_files(broken_folder, tmp_path, capfd, caplog):
    folder, broken = broken_folder
    over = tiny_overrides(tmp_path, **{"data.source": str(folder), "data.vae": "none"})
    with caplog.at_level(logging.WARNING, logger="data"):
        result = _main("train", ["--config", TINY, *over], capfd)
    _user_error(result, "4 of 6 files failed")
    # every broken file named once in the log and once in the stop message. In this process pytest's
    # handler takes the "data" logger's records (a user's process prints them through logging's
    # last-resort handler to the same stderr), so the log is read from caplog.
    log = "\n".join(r.getMessage() for r in caplog.records if r.name == "data")
    for path in broken:
        assert _lines_naming(path, log) == 1, log
        assert _lines_naming(path, result.stderr) == 1, result.stderr
    assert "video_reader.cc" not in result.stderr  # decord's own C++ lines are dropped
    # one line holds every file and where the key goes (4 of 6 = 66.7%: the next 5% step is 0.7)
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert all(path in line for path in broken), line
    assert "train.py 'data.options={max_failure_share: 0.7}'" in line, line


def test_train_refuses_one_process_training_under_torchrun(tmp_path, capfd, monkeypatch):
    """torchrun with the default parallel.mode=none would start WORLD_SIZE independent trainers that
    write one output_dir (seen: a 3-rank tiny run whose checkpoint writes collided). Planted: the
    check skipped -> the run starts and this test fails."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    out = str(tmp_path / "run")
    result = _main("train", ["--config", TINY, f"output_dir={out}", "train.max_steps=1"], capfd)
    _user_error(result, "parallel.mode=none under torchrun with 3 processes: each would train the whole")
    assert "set parallel.mode=dynamic (or static), or run one process" in result.stderr
    assert not Path(out).exists()


def test_scan_names_each_broken_file_once(broken_folder, tmp_path):
    folder, broken = broken_folder
    result = _run("-m", "data.scan", str(folder), "--out", str(tmp_path / "m.csv"), "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert "video_reader.cc" not in result.stderr and "ERROR opening" not in result.stderr
    for path in broken:
        assert _lines_naming(path, result.stderr) == 1, (
            result.stderr
        )  # "data: skipping <path>: <reason> (...)"
    assert "6 files, 4 failed" in result.stdout


def test_scan_missing_source_and_debug_traceback(tmp_path):
    args = ("-m", "data.scan", str(tmp_path / "none.csv"), "--out", str(tmp_path / "m.csv"))
    _user_error(_run(*args), f"manifest {tmp_path / 'none.csv'} does not exist")
    debug = _run(*args, "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ValueError" in debug.stderr


def test_cache_unknown_source(tmp_path, capfd):
    result = _main("data.cache", ["--source", str(tmp_path / "nothing"), "--out", str(tmp_path / "c"),
                   "--vae", "identity", "--text-encoder", "hashed"], capfd)  # fmt: skip
    _user_error(result, f"data source '{tmp_path / 'nothing'}' is neither 'synthetic', an existing folder")
    assert not (tmp_path / "c").exists()


def test_sample_missing_prompts_file(tmp_path, capfd):
    result = _main(
        "sample", ["--checkpoint", str(tmp_path), "--prompts-file", str(tmp_path / "p.txt")], capfd
    )
    _user_error(result, f"--prompts-file {tmp_path / 'p.txt'}: no such file")


def test_simulate_missing_lengths_file(tmp_path):
    result = _run("-m", "dynamic_cp.simulate", "--lengths", str(tmp_path / "l.txt"), "--gpus", "4")
    _user_error(result, f"lengths file {tmp_path / 'l.txt'} does not exist")
    (tmp_path / "hw.yaml").write_text("name: [broken\n")
    result = _run(
        "-m", "dynamic_cp.simulate", "--workload", "opensora", "--hardware", str(tmp_path / "hw.yaml")
    )
    _user_error(result, f"hardware profile '{tmp_path / 'hw.yaml'}' is not valid YAML at line 2")


def test_calibrate_unknown_profile_and_device(tmp_path, capfd):
    out = str(tmp_path / "p.yaml")
    _user_error(
        _main("dynamic_cp.calibrate", ["--out", out, "--base", "nope"], capfd),
        "unknown hardware profile 'nope'",
    )
    _user_error(
        _main("dynamic_cp.calibrate", ["--out", out, "--device", "gpu0"], capfd),
        "--device 'gpu0' is not a device",
    )
    assert not os.path.exists(out)


class _Payload:
    """Unpickling this creates ``marker``: proof that code in a checkpoint ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_refuses_a_trainer_state_that_carries_code(tmp_path, capfd):
    step = tmp_path / "shared" / "step_000003"
    step.mkdir(parents=True)
    marker = tmp_path / "code_ran"
    import torch

    state = {
        "optimizer": {},
        "lr_schedule": {},
        "step": 3,
        "bad_steps": 0,
        "rng": {},
        "x": _Payload(str(marker)),
    }
    torch.save(state, step / "trainer.pt")
    result = _main("train", ["--config", TINY, *tiny_overrides(tmp_path), "--resume", str(step)], capfd)
    _user_error(result, f"{step / 'trainer.pt'} holds a pickled Python object (io.open)")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not marker.exists()


def test_run_cli_reports_user_errors_and_keeps_bugs_loud(capsys):
    from data.cli import RunStopped, run_cli

    def stop():
        raise RunStopped("20 steps in a row had a non-finite loss; lower train.lr")

    assert run_cli(stop) == 2
    assert capsys.readouterr().err == "error: 20 steps in a row had a non-finite loss; lower train.lr\n"
    # torch re-raises a DataLoader worker's exception with the worker's traceback in the message
    worker = ValueError("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent "
                        "call last):\n  File \"x.py\", line 1\nValueError: clip 3: bad metadata")  # fmt: skip

    def from_worker():
        raise worker

    assert run_cli(from_worker) == 2
    assert capsys.readouterr().err == "error: clip 3: bad metadata\n"
    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_cli(lambda: {}["missing"])
    with pytest.raises(RunStopped):  # --debug shows the user error's traceback too
        run_cli(stop, debug=True)


@pytest.mark.parametrize("extra", [{}, {"model.expert": "both", "model.boundary_ratio": 0.875}])
def test_train_refuses_lora_on_an_untrained_base(tmp_path, capfd, extra):
    """model.lora without model.pretrained trains adapters on the seeded init, whose adaLN-zero output
    layer is zero: every adapter gradient is exactly zero and the loss never moves. Refused in one line
    naming the fix, before the output folder is made; a random base (``adaln_zero_init: false``, whose
    gradients flow) is let through. Planted: the check skipped -> the run starts and this test fails;
    the override ignored -> the random base is refused and this test fails."""
    out = tmp_path / "run"
    over = tiny_overrides(tmp_path, **{"model.lora": "{rank: 4}", "train.max_steps": 1, **extra})
    result = _main("train", ["--config", TINY, *over], capfd)
    _user_error(result, "model.lora without model.pretrained: LoRA on an untrained base gets zero gradients")
    assert "set model.pretrained=PATH to a diffusers Wan folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()
    random_base = "{num_layers: 2, ffn_dim: 128, adaln_zero_init: false}"
    over = tiny_overrides(tmp_path, **{"model.lora": "{rank: 4}", "model.overrides": random_base,
                                       "train.max_steps": 1, "train.val_every": 100, **extra})  # fmt: skip
    assert _main("train", ["--config", TINY, *over], capfd).returncode == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] > 0 for r in rows if "loss" in r] == [True]


def test_run_cli_under_torchrun_says_it_once_and_records_it(tmp_path, monkeypatch, capsys):
    """torchrun names each worker's error file in TORCHELASTIC_ERROR_FILE: every rank records the line
    there (torchrun's summary shows it as the root cause), only rank 0 prints it. Planted: the error
    file left unwritten, and every rank printing -> this test fails (and tests/test_torchrun_errors.py)."""
    from data.cli import run_cli

    def bad():
        raise ValueError("parallel.static_cp_size=3 must divide the number of ranks (2)")

    line = "error: parallel.static_cp_size=3 must divide the number of ranks (2)"
    for rank, printed in (("0", line + "\n"), ("1", "")):
        error_file = tmp_path / f"error{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        monkeypatch.setenv("RANK", rank)
        assert run_cli(bad) == 2
        assert capsys.readouterr().err == printed
        recorded = json.loads(error_file.read_text())["message"]
        assert recorded["message"] == recorded["extraInfo"]["py_callstack"] == line
    with pytest.raises(KeyError):  # a bug: raised as before, its traceback recorded for torchrun's summary
        run_cli(lambda: {}["missing"])
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "KeyError: 'missing'"
    assert "Traceback" in recorded["extraInfo"]["py_callstack"]
