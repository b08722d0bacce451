"""The sampling queue (dit/sample_requests.py) and the one-process queue runner (dit/sampling.py):
per-line settings, seeds that belong to the request, one-line errors naming the line, and a rerun
that skips the clips a killed job already wrote."""

from __future__ import annotations

import pytest
import torch

import sample
from data.hashed_text import HashedTextEncoder
from dit.model import VideoDiT
from dit.sample_output import output_path
from dit.sample_requests import build_queue
from dit.sampling import check_requests, sample_queue, sample_request

DEFAULTS = dict(frames=3, height=16, width=16, steps=2, guidance=4.0, seed=10, negative_prompt="")


def small_model() -> VideoDiT:
    torch.manual_seed(0)
    return VideoDiT(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=3, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=2, adaln_zero_init=False,
    ).eval()  # fmt: skip


def test_jsonl_csv_and_text_lines_take_the_flags_for_missing_fields(tmp_path):
    (tmp_path / "q.jsonl").write_text(
        '{"prompt": "a cat", "frames": 5, "seed": 3}\n\n{"prompt": "a dog", "guidance": 1, "width": 32}\n'
    )
    (tmp_path / "q.csv").write_text("prompt,height,negative_prompt\na fox,32,blurry\na hen,,\n")
    (tmp_path / "q.txt").write_text("one\n\n two \n")
    q = build_queue(["first"], str(tmp_path / "q.jsonl"), DEFAULTS)
    assert [(r.prompt, r.frames, r.width, r.guidance, r.seed) for r in q] == [
        ("first", 3, 16, 4.0, 10), ("a cat", 5, 16, 4.0, 3), ("a dog", 3, 32, 1.0, 12)
    ]  # fmt: skip
    assert q[2].where == "q.jsonl line 3" and not q[2].guided
    c = build_queue(None, str(tmp_path / "q.csv"), DEFAULTS)
    assert [(r.prompt, r.height, r.negative_prompt, r.seed) for r in c] == [
        ("a fox", 32, "blurry", 10), ("a hen", 16, "", 11)
    ]  # fmt: skip
    assert [r.prompt for r in build_queue(None, str(tmp_path / "q.txt"), DEFAULTS)] == ["one", "two"]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("q.jsonl", '{"prompt": "a"}\n{"prompt": "b", \n', "q.jsonl line 2: not a JSON object"),
        ("q.jsonl", '{"prompt": "a", "fps": 3}\n', "q.jsonl line 1: unknown field 'fps'"),
        (
            "q.jsonl",
            '{"prompt": "a"}\n{"prompt": "b", "frames": "many"}\n',
            "q.jsonl line 2: frames must be a whole number",
        ),
        ("q.jsonl", '{"frames": 5}\n', "q.jsonl line 1: no prompt"),
        ("q.csv", "prompt,steps\na,2\nb,2,7\n", "q.csv line 3: 2 columns expected"),
        ("q.csv", "prompt,steps\na,0\n", "q.csv line 2: steps=0 must be at least 1"),
        ("q.csv", "a cat\n", "q.csv line 1: a CSV queue needs a header row"),
    ],
)
def test_a_malformed_line_is_one_error_naming_its_line_exit_2(tmp_path, capsys, name, text, message):
    (tmp_path / name).write_text(text)
    argv = ["--checkpoint", str(tmp_path / "no-run"), "--prompts-file", str(tmp_path / name)]
    assert sample.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_shapes_the_vae_cannot_make_name_the_request():
    model = small_model()
    vae = type("Stride", (), {"stride": (4, 8, 8)})()
    (req,) = build_queue(["x"], None, {**DEFAULTS, "frames": 6})
    with pytest.raises(ValueError, match=r"--prompt 1: frames=6: .* needs 1 \+ 4k frames, e.g. 5"):
        check_requests(model, vae, [req])
    (req,) = build_queue(["x"], None, {**DEFAULTS, "frames": 5, "height": 20})
    with pytest.raises(ValueError, match=r"--prompt 1: height and width must be multiples of the VAE stride"):
        check_requests(model, vae, [req])


def test_a_request_gives_the_same_clip_wherever_it_sits_in_the_queue():
    model, enc = small_model(), HashedTextEncoder(dim=16)
    queue = build_queue(["a", "b", "c"], None, DEFAULTS)  # "c" has seed 10 + 2
    (c_alone,) = build_queue(["c"], None, {**DEFAULTS, "seed": 12})
    assert queue[2].seed == c_alone.seed == 12
    assert torch.equal(sample_request(model, enc, None, queue[2]), sample_request(model, enc, None, c_alone))
    assert not torch.equal(
        sample_request(model, enc, None, queue[1]), sample_request(model, enc, None, c_alone)
    )


class Killed(Exception):
    pass


def test_a_killed_queue_keeps_its_clips_and_a_rerun_skips_them(tmp_path, monkeypatch):
    from dit import sampling

    model, enc = small_model(), HashedTextEncoder(dim=16)
    queue = build_queue(["a", "b", "c"], None, DEFAULTS)
    paths = {r.index: output_path(tmp_path, r, "model") for r in queue}
    real = sampling.sample_request
    calls = []

    def dies_on_the_second(*args):
        calls.append(args[3].index)
        if calls == [0, 1]:
            raise Killed  # the job is stopped mid-queue
        return real(*args)

    monkeypatch.setattr(sampling, "sample_request", dies_on_the_second)
    with pytest.raises(Killed):
        sample_queue(model, enc, None, queue, paths, None)
    assert (
        paths[0].is_file()
        and not paths[1].exists()
        and sorted(p.name for p in tmp_path.iterdir()) == [paths[0].name]
    )
    first = paths[0].stat().st_mtime_ns
    calls.clear()
    written = sample_queue(model, enc, None, queue, paths, None)
    assert calls == [1, 2] and written == [paths[1], paths[2]]  # request 0 was skipped
    assert paths[0].stat().st_mtime_ns == first
    # anything that changes the clip changes its file name, so a changed request is not skipped
    changed = build_queue(["a"], None, {**DEFAULTS, "steps": 3})[0]
    assert output_path(tmp_path, changed, "model") != paths[0]
    assert output_path(tmp_path, queue[0], "other model") != paths[0]
