"""The command lines stop on a user's mistake with a non-zero exit and a message that names it.

Only the exit status and the words that name the problem are checked, not the layout of the message
(one line or more), so the message format can evolve without touching these tests. Each command runs
in this process through its ``main(argv)``: a ValueError that escapes counts as exit 1 with its text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _run(main, argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    except ValueError as e:
        code, text = 1, str(e)
        return code, text + capsys.readouterr().err
    return code, capsys.readouterr().err


def _fails_naming(result, *words):
    code, message = result
    assert code not in (0, None), f"exit {code}: the mistake went through\n{message}"
    for w in words:
        assert w.lower() in message.lower(), f"the message does not name {w!r}:\n{message}"


def test_train_resume_from_a_folder_without_checkpoint(tmp_path, capsys):
    import train

    (tmp_path / "empty").mkdir()
    argv = ["--config", TINY, "--resume", str(tmp_path / "empty"), *tiny_overrides(tmp_path)]
    _fails_naming(_run(train.main, argv, capsys), "empty", "no checkpoint")


def test_train_parallel_mode_without_torchrun(tmp_path, capsys, monkeypatch):
    import train

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["--config", TINY, *tiny_overrides(tmp_path), "parallel.mode=dynamic"]
    _fails_naming(_run(train.main, argv, capsys), "torchrun", "parallel.mode")


def test_sample_without_prompt_or_checkpoint(tmp_path, capsys):
    import sample

    _fails_naming(_run(sample.main, ["--checkpoint", str(tmp_path)], capsys), "prompt")
    (tmp_path / "empty").mkdir()
    argv = ["--checkpoint", str(tmp_path / "empty"), "--prompt", "x"]
    _fails_naming(_run(sample.main, argv, capsys), "empty", "no checkpoint")
    argv = ["--checkpoint", str(tmp_path), "--prompts-file", str(tmp_path / "missing.txt")]
    code, message = _run_any(sample.main, argv, capsys)
    assert code not in (0, None) and "missing.txt" in message


def _run_any(main, argv, capsys) -> tuple[int, str]:
    """Like _run, for mistakes that may surface as another exception type (e.g. FileNotFoundError)."""
    try:
        return _run(main, argv, capsys)
    except Exception as e:  # noqa: BLE001 - the test only needs the exit and the words
        return 1, f"{type(e).__name__}: {e}"


def test_calibrate_rejects_bad_shapes_and_profiles(tmp_path, capsys):
    from dynamic_cp import calibrate

    out = str(tmp_path / "p.yaml")
    _fails_naming(
        _run(calibrate.main, ["--out", out, "--d", "100", "--heads", "12"], capsys), "--d", "--heads"
    )
    _fails_naming(_run(calibrate.main, ["--out", out, "--base", "no-such-gpu"], capsys), "no-such-gpu")
    assert not Path(out).exists()


def test_scan_rejects_a_missing_source(tmp_path, capsys):
    from data import scan

    argv = [str(tmp_path / "nope.csv"), "--out", str(tmp_path / "m.csv")]
    _fails_naming(_run(scan.main, argv, capsys), "nope.csv", "does not exist")
    assert not (tmp_path / "m.csv").exists()


@pytest.mark.parametrize("argv,words", [(["--out", "x"], ["--source"]), (["--source", "s", "--out", "x",
                         "--vae", "sdxl", "--text-encoder", "hashed"], ["--vae", "sdxl"])])  # fmt: skip
def test_cache_argument_errors(argv, words, capsys):
    from data import cache

    _fails_naming(_run(cache.main, argv, capsys), *words)
