"""sample.py's argument handling without a sampling run: what each flag parses to, its documented
default, the request settings the flags give a queue, and the mistakes that exit 2 naming the flag.

``sample.run`` is replaced by a recorder (this file checks what reaches it, tests/test_sample_cli.py
checks what it does with it on a tiny checkpoint), so every test here takes milliseconds: with the two
help tests of test_sample_cli.py it is the bench's subset for sample.py (``SCOPES``: ``main`` and
``request_defaults``). Planted, each seen to fail here: a flag's ``type=`` dropped (``--frames 5`` a
string), ``action="append"`` dropped (the last prompt only), ``required=`` dropped (no source runs),
a default off by one, ``image or ""`` as ``and``, ``--upscale 1`` refused (``< -> <=``), ``--debug``
ignored, a request setting dropped from the defaults.
"""

from __future__ import annotations

import pytest

import sample


@pytest.fixture
def parsed(monkeypatch):
    """parse(argv) -> (exit code, the args that reached run, request_defaults(args))."""
    seen = []

    def run(args):
        seen.append(args)
        seen.append(sample.request_defaults(args))
        return 0

    monkeypatch.setattr(sample, "run", run)

    def parse(*argv):
        seen.clear()
        code = sample.main(list(argv))
        return code, *seen

    return parse


def test_defaults_are_the_documented_ones(parsed):
    code, args, defaults = parsed("--checkpoint", "runs/tiny", "--prompt", "a red circle")
    assert code == 0
    assert vars(args) == dict(
        checkpoint="runs/tiny", pretrained=None, prompt=["a red circle"], prompts_file=None, weights="auto",
        frames=9, height=16, width=16, steps=30, guidance=4.0, guidance_2=None, shift=None,
        negative_prompt="", image=None, last_image=None, seed=0, fps=8, upscale=1, grid=False, lora=None,
        lora_scale=1.0, out=None, cfg_parallel="auto", memory_gb=None, fsdp="auto", precision="auto",
        base_dtype="auto", offload="auto", offload_blocks=None, idle_expert="auto", hardware=None,
        debug=False,
    )  # fmt: skip
    # what a queue line that sets nothing gets: no image is "", --guidance-2 unset is None (--guidance)
    assert defaults == dict(
        frames=9, height=16, width=16, steps=30, guidance=4.0, guidance_2=None, seed=0, negative_prompt="",
        image="", last_image="",
    )  # fmt: skip


def test_every_flag_parses_to_its_type_and_reaches_the_requests(parsed):
    code, args, defaults = parsed(
        "--pretrained", "Wan2.1-T2V-1.3B-Diffusers", "--prompt", "a", "--prompt", "b", "--prompts-file",
        "q.jsonl", "--weights", "model", "--frames", "5", "--height", "24", "--width", "40", "--steps", "7",
        "--guidance", "2.5", "--guidance-2", "3.5", "--shift", "5.0", "--negative-prompt", "blurry",
        "--image", "first.png", "--last-image", "last.png", "--seed", "11", "--fps", "16", "--upscale", "3",
        "--grid", "--lora", "style.safetensors", "--lora-scale", "0.5", "--out", "clips", "--cfg-parallel",
        "off", "--memory-gb", "80", "--fsdp", "per_layer", "--precision", "bf16", "--hardware", "a100",
        "--base-dtype", "fp8_scaled", "--offload", "blocks", "--offload-blocks", "3", "--idle-expert", "cpu",
    )  # fmt: skip
    assert code == 0
    assert vars(args) == dict(
        checkpoint=None, pretrained="Wan2.1-T2V-1.3B-Diffusers", prompt=["a", "b"], prompts_file="q.jsonl",
        weights="model", frames=5, height=24, width=40, steps=7, guidance=2.5, guidance_2=3.5, shift=5.0,
        negative_prompt="blurry", image="first.png", last_image="last.png", seed=11, fps=16, upscale=3,
        grid=True, lora="style.safetensors", lora_scale=0.5, out="clips", cfg_parallel="off", memory_gb=80.0,
        fsdp="per_layer", precision="bf16", base_dtype="fp8_scaled", offload="blocks", offload_blocks=3,
        idle_expert="cpu", hardware="a100", debug=False,
    )  # fmt: skip
    typed = {
        k: type(v)
        for k, v in vars(args).items()
        if k in ("frames", "guidance", "memory_gb", "seed", "offload_blocks")
    }
    assert typed == {
        "frames": int,
        "guidance": float,
        "seed": int,
        "memory_gb": float,
        "offload_blocks": int,
    }  # 5 == 5.0 above
    assert defaults == dict(
        frames=5, height=24, width=40, steps=7, guidance=2.5, guidance_2=3.5, seed=11,
        negative_prompt="blurry", image="first.png", last_image="last.png",
    )  # fmt: skip


def test_upscale_below_1_exits_2_naming_it_and_debug_shows_the_traceback(parsed, capsys):
    code, _, defaults = parsed("--checkpoint", "r", "--prompt", "p", "--upscale", "1")
    assert code == 0 and defaults["frames"] == 9  # 1 is the size asked for: accepted
    capsys.readouterr()
    assert parsed("--checkpoint", "r", "--prompt", "p", "--upscale", "0")[0] == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --upscale 0: use 1") and err.count("\n") == 1  # one line
    with pytest.raises(ValueError, match="--upscale -2"):
        parsed("--checkpoint", "r", "--prompt", "p", "--upscale", "-2", "--debug")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--prompt", "p"], "one of the arguments --checkpoint --pretrained is required"),
        (["--checkpoint", "r", "--pretrained", "w"], "not allowed with argument"),
        (["--checkpoint", "r", "--weights", "best"], "invalid choice: 'best'"),
        (["--checkpoint", "r", "--cfg-parallel", "on"], "invalid choice: 'on'"),
        (["--checkpoint", "r", "--fsdp", "full"], "invalid choice: 'full'"),
        (["--checkpoint", "r", "--precision", "fp16"], "invalid choice: 'fp16'"),
        (["--checkpoint", "r", "--base-dtype", "fp8"], "invalid choice: 'fp8'"),
        (["--checkpoint", "r", "--offload", "blocks+activations"], "invalid choice: 'blocks+activations'"),
        (["--checkpoint", "r", "--offload-blocks", "all"], "invalid int value: 'all'"),
        (["--checkpoint", "r", "--frames", "9.5"], "invalid int value: '9.5'"),
        (["--checkpoint", "r", "--guidance", "high"], "invalid float value: 'high'"),
        (["--checkpoint", "r", "--grid", "yes"], "unrecognized arguments: yes"),
    ],
)
def test_mistakes_exit_2_naming_the_flag(parsed, capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        parsed(*argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_help_of_the_flags_the_other_help_tests_leave_out(capsys):
    """(test_sample_cli.py's two help tests name the rest; the bench runs them with this file.)"""
    with pytest.raises(SystemExit) as exit_:
        sample.main(["--help"])
    assert exit_.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps help, also after a hyphen
    for words in [
        "--checkpoint CHECKPOINT | --pretrained PRETRAINED",
        "--prompt PROMPT",
        "guidance of a two-expert (Wan2.2 A14B) folder's low-noise expert; default: --guidance",
        "first frame for an image-to-video model, or for Wan2.2 TI2V's image-to-video mode (PNG/JPEG); "
        "a queue line may set its own",
        "under torchrun: shard the DiT over all ranks with FSDP2 (per_layer), keep it replicated (none)",
        "--weights {auto,ema,model}",
        "--cfg-parallel {auto,off}",
        "--fsdp {auto,none,per_layer}",
        "--debug",
    ]:
        assert "".join(words.split()) in text, words
