"""``--dry-run`` flags a clip larger than a rank (or the largest CP group) holds, in every mode, and
prices memory at it; docs/data.md's first commands run as written on the tiny config.

Issue 54: a cache made without a clip policy kept every frame at source size, and the dry run said
``no problems found`` at 2,048 tokens a rank while the run then sat in step 0's validation.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from _data_media import make_clips

import train
from data import cache, scan

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_dry_run_flags_a_clip_above_what_a_rank_holds_in_every_mode(tmp_path, capsys):
    make_clips(str(tmp_path / "videos"))
    out = str(tmp_path / "cache")
    # the command: no --fps/--max-frames/--resolution, so every frame at source size
    argv = ["--source", str(tmp_path / "videos"), "--out", out, "--vae", "identity"]
    argv += ["--text-encoder", "hashed"]
    assert cache.main(argv) == 0
    run = ["--config", TINY, f"data.source={out}", "data.num_val_clips=1", f"output_dir={tmp_path / 'run'}"]
    capsys.readouterr()
    # h264_64x36_25fps.mp4 (50 frames) is the largest: 50 x 18 x 32 = 28,800 tokens at patch 1x2x2
    assert train.main([*run, "--dry-run"]) == 1
    text = capsys.readouterr().out
    limit = "more than one rank holds (train.micro_batch_tokens=2,048)"
    assert f"the largest clip has 28,800 tokens, {limit}" in text
    assert "re-run python -m data.cache with --resolution" in text
    assert "at 28,800 tokens a rank" in text  # priced at the clip the single process would run
    assert "no problems found" not in text
    # Dynamic-CP on 4 ranks: the largest group holds 2,048 x 4; memory at the clip's quarter
    assert train.main([*run, "parallel.mode=dynamic", "--dry-run", "--world-size", "4"]) == 1
    text = capsys.readouterr().out
    assert "more than the largest CP group holds (train.micro_batch_tokens=2,048 x CP 4)" in text
    assert "at 7,200 tokens a rank" in text
    # a budget that holds the clip: no problem, memory at the cap again
    assert train.main([*run, "train.micro_batch_tokens=32768", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "at 32,768 tokens a rank" in text and "no problems found" in text


def test_dry_run_flags_a_memory_estimate_that_does_not_fit(tmp_path, capsys):
    over = [f"output_dir={tmp_path / 'run'}", "parallel.memory_gb=0.01"]
    assert train.main(["--config", TINY, *over, "--dry-run"]) == 1
    text = capsys.readouterr().out
    assert re.search(r"- memory: [\d.]+ GB per GPU does not fit; try ", text), text


def test_data_md_first_commands_run_as_written_on_the_tiny_config(tmp_path, monkeypatch, capsys):
    """The opening block of docs/data.md, on a folder of real clips: scan, cache, then each train.py
    line as --dry-run (training itself is tests/test_train.py's), all without a problem."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "docs" / "data.md").read_text(), flags=re.S).group(1)
    lines = [ln.split("  #")[0].strip() for ln in block.replace("\\\n", " ").splitlines()]
    make_clips(str(tmp_path / "videos"))
    monkeypatch.chdir(tmp_path)
    ran = []
    for line in filter(None, lines):
        argv = shlex.split(line)
        if argv[:3] == ["python", "-m", "data.scan"]:
            assert scan.main(argv[3:]) == 0, line
        elif argv[:3] == ["python", "-m", "data.cache"]:
            assert cache.main(argv[3:]) == 0, line
        elif argv[:2] == ["python", "train.py"]:
            args = [TINY if a == "configs/tiny.yaml" else a for a in argv[2:]]
            capsys.readouterr()
            assert train.main([*args, "--dry-run"]) == 0, (line, capsys.readouterr().out)
            assert "no problems found" in capsys.readouterr().out
        else:
            continue  # bench/ commands are not the data path
        ran.append(argv[1] if argv[1] != "-m" else argv[2])
    assert ran == ["train.py", "data.scan", "data.cache", "train.py"]
