"""sample.py's flags take effect and its defaults are the documented ones (a tiny checkpoint, in-process).

Each run writes a PNG grid (rows = prompts, columns = frames); two runs are compared through it, which
is what a user looks at. The checkpoint is a tiny model whose live weights were moved away from its
EMA, so --weights is visible too.
"""

from __future__ import annotations

import re
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from conftest import tiny_overrides

import sample
from dit.config import load_config
from dit.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
SMALL = ["--frames", "1", "--height", "8", "--width", "8", "--steps", "2", "--grid"]  # fast runs


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sample_cli")
    cfg = load_config(TINY, tiny_overrides(tmp, **{"train.ema_decay": 0.5}))
    assert cfg.flow.shift == 3.0  # the run's shift, which --shift overrides
    torch.manual_seed(0)
    trainer = Trainer(cfg, device=torch.device("cpu"))
    with torch.no_grad():  # an initial model predicts zero velocity (zero-initialised output layer)
        for live, ema in zip(trainer.model.parameters(), trainer.ema.model.parameters()):
            live.add_(0.05 * torch.randn_like(live))
            ema.add_(0.05 * torch.randn_like(ema))  # and the EMA weights differ from the live ones
    trainer.step = 10  # 0.5**10 of the EMA is the start: ready, so --weights auto takes it
    trainer.save()
    return Path(cfg.output_dir)


def _grid(run_dir, tmp_path, *flags, prompt="a red circle") -> np.ndarray:
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    argv = ["--checkpoint", str(run_dir), "--out", str(out), *flags]
    if prompt is not None:
        argv += ["--prompt", prompt]
    assert sample.main(argv) == 0
    (png,) = out.glob("*.png")
    return imageio.imread(png)


def test_shift_overrides_the_runs_flow_shift(run_dir, tmp_path):
    default = _grid(run_dir, tmp_path, *SMALL)
    np.testing.assert_array_equal(default, _grid(run_dir, tmp_path, *SMALL, "--shift", "3"))
    assert not np.array_equal(default, _grid(run_dir, tmp_path, *SMALL, "--shift", "1"))


def test_weights_guidance_and_negative_prompt_take_effect(run_dir, tmp_path):
    default = _grid(run_dir, tmp_path, *SMALL)
    assert not np.array_equal(default, _grid(run_dir, tmp_path, *SMALL, "--weights", "model"))
    assert not np.array_equal(default, _grid(run_dir, tmp_path, *SMALL, "--guidance", "1"))
    assert not np.array_equal(default, _grid(run_dir, tmp_path, *SMALL, "--negative-prompt", "blue"))
    unguided = _grid(run_dir, tmp_path, *SMALL, "--guidance", "1")  # no negative branch without guidance
    np.testing.assert_array_equal(
        unguided, _grid(run_dir, tmp_path, *SMALL, "--guidance", "1", "--negative-prompt", "blue")
    )


def test_files_seed_fps_upscale_prompts_file_and_default_out(run_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a blue square\n\n  \na green dot\n")
    out = tmp_path / "files"
    argv = ["--checkpoint", str(run_dir), *SMALL, "--upscale", "2", "--seed", "7", "--fps", "5"]
    assert sample.main([*argv, "--prompt", "first", "--prompts-file", str(prompts), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    # request i takes seed --seed + i; the six hex digits key what made the clip (rerun skips)
    patterns = [r"00_first_seed7_[0-9a-f]{6}\.mp4", r"01_a_blue_square_seed8_[0-9a-f]{6}\.mp4",
                r"02_a_green_dot_seed9_[0-9a-f]{6}\.mp4", r"grid_seed7_[0-9a-f]{6}\.png"]  # fmt: skip
    assert len(names) == 4 and all(re.fullmatch(p, n) for p, n in zip(patterns, names)), names
    assert imageio.imread(out / names[3]).shape == (3 * 16, 16, 3)  # 3 prompts, 8 px x 2
    import av

    with av.open(str(out / names[0])) as f:
        assert f.streams.video[0].average_rate == 5
        assert (f.streams.video[0].height, f.streams.video[0].width) == (16, 16)
    no_grid = [a for a in SMALL if a != "--grid"]
    assert sample.main(["--checkpoint", str(run_dir), *no_grid, "--prompt", "x"]) == 0
    written = sorted(p.name for p in (run_dir / "samples").iterdir())  # the default --out
    assert len(written) == 1 and re.fullmatch(r"00_x_seed0_[0-9a-f]{6}\.mp4", written[0]), written
    with av.open(str(run_dir / "samples" / written[0])) as f:
        assert f.streams.video[0].average_rate == 8  # the default --fps


def test_mistakes_exit_2_naming_them(run_dir, tmp_path, capsys):
    def fails(argv, words):
        assert sample.main(argv) == 2
        assert words in capsys.readouterr().err

    fails(["--checkpoint", str(run_dir), *SMALL, "--prompt", "p", "--upscale", "0"], "--upscale 0")
    fails(["--checkpoint", str(run_dir), *SMALL], "no prompt given")
    cfg = load_config(TINY, tiny_overrides(tmp_path, **{"train.ema_decay": 0}))
    Trainer(cfg, device=torch.device("cpu")).save()
    no_ema = ["--checkpoint", cfg.output_dir, *SMALL, "--prompt", "p", "--weights", "ema"]
    fails(no_ema, "no ema weights, try --weights model")


def test_help_names_every_flag_and_keeps_the_usage_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        sample.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "\n    python sample.py --checkpoint runs/tiny --prompt" in out  # the example keeps its own line
    text = " ".join(out.split())  # argparse wraps the help of each flag
    for words in [
        "Sample clips from a checkpoint",
        "python sample.py --checkpoint runs/tiny --prompt",
        "run directory (its latest checkpoint) or a step_* dir",
        "a prompt; repeat for several",
        "one prompt a line (.txt), or a .jsonl / .csv queue with per-line settings",
        "first frame for an image-to-video model",
        "last frame for a first-last-frame (FLF2V) model",
        "a run's EMA (ema), its trained weights (model), or auto (default)",
        "Euler steps",
        "classifier-free guidance scale; 1 disables",
        "sigma shift; default: the run's flow.shift, else by token count",
        "nearest-neighbour enlargement",
        "also write a PNG grid of all frames",
        "a Wan LoRA .safetensors file",
        "strength of --lora (0 = the base)",
        "output directory (default: <run>/samples, or ./samples for --pretrained)",
    ]:
        assert words in text, words
    with pytest.raises(SystemExit):
        sample.main(["--prompt", "x"])  # --checkpoint is required
    assert "--checkpoint" in capsys.readouterr().err


def test_lora_on_top_is_scaled_by_lora_scale(run_dir, tmp_path):
    from dit import lora
    from dit.model import VideoDiT
    from dit.model_config import LoraSettings

    (step,) = sorted((run_dir / "checkpoints").glob("step_*"))
    model = VideoDiT.from_pretrained(step / "model")
    lora.add_lora(model, lora.peft_config(LoraSettings(rank=2)))
    with torch.no_grad():
        for p in lora.adapter_parameters(model):
            p.copy_(0.5 * torch.randn_like(p))
    lora.save_lora(model, tmp_path / "adapter")
    flags = [*SMALL, "--weights", "model", "--lora", str(tmp_path / "adapter")]
    base = _grid(run_dir, tmp_path, *SMALL, "--weights", "model")
    full = _grid(run_dir, tmp_path, *flags)
    np.testing.assert_array_equal(full, _grid(run_dir, tmp_path, *flags, "--lora-scale", "1"))  # the default
    np.testing.assert_array_equal(base, _grid(run_dir, tmp_path, *flags, "--lora-scale", "0"))
    half = _grid(run_dir, tmp_path, *flags, "--lora-scale", "0.5")
    assert (
        not np.array_equal(full, base) and not np.array_equal(half, base) and not np.array_equal(half, full)
    )


def test_defaults_are_the_documented_ones(run_dir, tmp_path):
    """--weights auto (the EMA, ready here), --steps 30, --guidance 4, the run's shift, --seed 0, --upscale 1; 9 frames of 16 x 16."""
    small = ["--grid", "--frames", "1", "--height", "8", "--width", "8"]  # 30 steps of a 16-token clip
    default = _grid(run_dir, tmp_path, *small)
    explicit = ["--weights", "ema", "--steps", "30", "--guidance", "4", "--shift", "3", "--seed", "0",
                "--upscale", "1", "--negative-prompt", ""]  # fmt: skip
    np.testing.assert_array_equal(default, _grid(run_dir, tmp_path, *small, *explicit))
    assert not np.array_equal(default, _grid(run_dir, tmp_path, *small, "--steps", "29"))
    assert _grid(run_dir, tmp_path, "--grid", "--height", "8", "--width", "8", "--steps", "1").shape == (
        8,
        9 * 8,
        3,
    )
    assert _grid(run_dir, tmp_path, "--grid", "--frames", "1", "--steps", "1").shape == (16, 16, 3)


def _clips(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.suffix == ".mp4")


def test_repeated_prompts_and_a_rerun_that_skips_exactly_the_clips_it_would_write_again(
    run_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun's one-process world is not distributed
    no_grid = [a for a in SMALL if a != "--grid"]
    out = tmp_path / "rerun"
    argv = ["--checkpoint", str(run_dir), *no_grid, "--prompt", "one", "--prompt", "two", "--out", str(out)]
    assert sample.main(argv) == 0
    first = _clips(out)
    assert [n[:6] for n in first] == ["00_one", "01_two"]
    (out / ".partial-killed").mkdir()  # what a killed job was writing
    capsys.readouterr()
    assert sample.main(argv) == 0
    assert "2 of 2 clips already in place; sampling 0" in capsys.readouterr().out
    assert _clips(out) == first and not (out / ".partial-killed").exists()
    # anything that changes the clip or its file changes its name: sampled again
    one = ["--checkpoint", str(run_dir), *no_grid, "--prompt", "one", "--out", str(out)]
    for flag, value in [("--shift", "2"), ("--fps", "4"), ("--upscale", "2")]:
        assert sample.main([*one, flag, value]) == 0
        assert "already in place" not in capsys.readouterr().out, flag
    assert len(_clips(out)) == 2 + 3


def test_only_rank_0_clears_partials_and_draws_the_grid(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "rank1"
    (out / ".partial-other").mkdir(parents=True)
    assert sample.main(["--checkpoint", str(run_dir), *SMALL, "--prompt", "x", "--out", str(out)]) == 0
    assert (out / ".partial-other").is_dir() and not list(out.glob("*.png")) and len(_clips(out)) == 1


def test_the_grid_is_the_written_clips_frames(run_dir, tmp_path, capsys):
    out = tmp_path / "grid"
    flags = ["--frames", "3", "--height", "8", "--width", "8", "--steps", "2", "--grid", "--upscale", "2"]
    assert sample.main(["--checkpoint", str(run_dir), *flags, "--prompt", "a", "--prompt", "b", "--out", str(out)]) == 0  # fmt: skip
    (png,) = out.glob("grid_seed0_*.png")
    grid = imageio.imread(png)
    rows = [np.concatenate(list(imageio.mimread(out / name)), axis=1) for name in _clips(out)]
    assert grid.shape == (2 * 16, 3 * 16, 3)
    np.testing.assert_array_equal(grid, np.concatenate(rows, axis=0))
    queue = tmp_path / "mixed.jsonl"
    queue.write_text('{"prompt": "a"}\n{"prompt": "b", "width": 16}\n')
    argv = ["--checkpoint", str(run_dir), *SMALL, "--prompts-file", str(queue), "--out", str(tmp_path / "m")]
    capsys.readouterr()
    assert sample.main(argv) == 0
    assert "--grid skipped: the queue mixes 2 clip shapes" in capsys.readouterr().out
    assert not list((tmp_path / "m").glob("*.png")) and len(_clips(tmp_path / "m")) == 2


def test_memory_gb_refuses_a_request_that_cannot_fit_before_sampling(run_dir, tmp_path, capsys):
    argv = ["--checkpoint", str(run_dir), *SMALL, "--prompt", "p", "--out", str(tmp_path / "mem")]
    assert sample.main([*argv, "--memory-gb", "1e-6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "do not fit in 0 GB per rank" in err, err
    assert not (tmp_path / "mem").exists() or not _clips(tmp_path / "mem")
    assert sample.main([*argv, "--memory-gb", "100"]) == 0


def test_bad_choices_exit_2(run_dir, capsys):
    for flag, value in [("--weights", "best"), ("--cfg-parallel", "on")]:
        with pytest.raises(SystemExit) as exit_:
            sample.main(["--checkpoint", str(run_dir), "--prompt", "p", flag, value])
        assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sample.main(["--checkpoint", str(run_dir), "--pretrained", "x", "--prompt", "p"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_help_of_the_remaining_flags(capsys):
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in [
        "a diffusers Wan folder: transformer/, vae/, text_encoder/, tokenizer/",
        "--negative-prompt NEGATIVE_PROMPT",
        "--frames FRAMES",
        "under torchrun: let the planner run a request's two CFG branches on two groups (auto)",
        "memory per rank requests must fit (default: the GPU's; no check on CPU)",
        "cost-model profile for the planner (default: h100 on GPU, cpu-like on CPU)",
        "show the full traceback of user errors too",
        "Under torchrun a planner gives each request its context-parallel group",
    ]:
        assert words in text, words


def test_the_script_runs_as_a_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--checkpoint CHECKPOINT" in done.stdout


@pytest.fixture(scope="module")
def i2v_run(tmp_path_factory):
    """A tiny pixel-space image-to-video run: 3 noisy + 1 mask + 3 image channels in, 3 out."""
    tmp = tmp_path_factory.mktemp("i2v")
    overrides = tiny_overrides(tmp, **{"model.overrides": "{num_layers: 2, ffn_dim: 128, in_channels: 7, out_channels: 3}"})  # fmt: skip
    cfg = load_config(TINY, overrides)
    torch.manual_seed(0)
    trainer = Trainer(cfg, device=torch.device("cpu"))
    with torch.no_grad():
        for p in trainer.ema.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.save()
    rng = np.random.default_rng(0)
    images = []
    for name in ("a.png", "b.png"):
        imageio.imwrite(tmp / name, rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        images.append(str(tmp / name))
    return Path(cfg.output_dir), images


def test_image_and_last_image_reach_every_request(i2v_run, tmp_path, capsys):
    run, (a, b) = i2v_run
    flags = ["--frames", "3", "--height", "8", "--width", "8", "--steps", "2", "--grid", "--guidance", "1"]
    flags += ["--weights", "ema"]  # the weights moved off zero (at step 0 auto takes model/)
    first = _grid(run, tmp_path, *flags, "--image", a)
    np.testing.assert_array_equal(first, _grid(run, tmp_path, *flags, "--image", a))
    assert not np.array_equal(first, _grid(run, tmp_path, *flags, "--image", b))
    capsys.readouterr()
    argv = ["--checkpoint", str(run), *flags, "--prompt", "p", "--out", str(tmp_path / "x")]
    assert sample.main([*argv, "--image", a, "--last-image", b]) == 2  # an I2V (not FLF2V) model
    assert "takes no --last-image" in capsys.readouterr().err
