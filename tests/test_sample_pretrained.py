"""sample.py --pretrained: a diffusers-format Wan folder (transformer/, vae/, text_encoder/,
tokenizer/, scheduler/) of small random models, sampled without a training run."""

from __future__ import annotations

import json

import pytest
import torch

import sample
from tests.test_data_cache import save_text_encoder, save_vae

WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
    freq_dim=16, ffn_dim=32, num_layers=2,
)  # fmt: skip  # in_channels = the VAE's z_dim, text_dim = the UMT5's d_model


def save_wan_pipeline(root):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    WanTransformer3DModel(**WAN).save_pretrained(root / "transformer")
    save_vae("wan", str(root / "vae"))
    save_text_encoder("umt5", str(root / "te"))
    (root / "text_encoder").mkdir()
    (root / "tokenizer").mkdir()
    for f in (root / "te").iterdir():  # the model to text_encoder/, the tokenizer to tokenizer/
        dest = "text_encoder" if f.name in ("config.json", "model.safetensors") else "tokenizer"
        f.rename(root / dest / f.name)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({"flow_shift": 3.0}))
    return root


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    return save_wan_pipeline(tmp_path_factory.mktemp("wan") / "Wan-tiny-Diffusers")


def test_pretrained_folder_samples_a_queue_and_reruns_skip(wan_folder, tmp_path, capsys):
    (tmp_path / "q.jsonl").write_text('{"prompt": "a cat", "frames": 5}\n{"prompt": "a dog", "width": 32}\n')
    argv = ["--pretrained", str(wan_folder), "--prompts-file", str(tmp_path / "q.jsonl"), "--frames", "1",
            "--height", "16", "--width", "16", "--steps", "2", "--out", str(tmp_path / "out")]  # fmt: skip
    assert sample.main(argv) == 0
    import imageio.v3 as iio

    clips = sorted((tmp_path / "out").glob("*.mp4"))
    assert [iio.imread(c).shape[:3] for c in clips] == [(5, 16, 16), (1, 16, 32)]
    capsys.readouterr()
    assert sample.main(argv) == 0
    assert "2 of 2 clips already in place" in capsys.readouterr().out
    # bf16 clips are other clips: their own keys, sampled anew beside the fp32 ones (planted: the
    # precision left out of the key -> "2 of 2 clips already in place")
    assert sample.main([*argv, "--precision", "bf16"]) == 0
    assert "already in place" not in capsys.readouterr().out
    assert len(list((tmp_path / "out").glob("*.mp4"))) == 4


def test_pretrained_sampler_is_the_folder_parts(wan_folder):
    from dit.sampler_setup import load_pretrained_sampler

    s = load_pretrained_sampler(str(wan_folder), None, 1.0, "cpu")
    assert s.shift == 3.0 and s.vae.stride == (4, 8, 8) and s.text_encoder.dim == 16
    assert s.model.config.text_pad_len == 512  # Wan pads captions as its pipeline does
    assert {p.dtype for p in s.model.parameters()} == {torch.float32}


def test_bf16_sampler_holds_the_dit_and_text_encoder_in_bf16_and_the_vae_in_fp32(wan_folder):
    """--precision bf16: every DiT weight in bf16 (the norms and modulation diffusers keeps in fp32
    too: sharded sampling gathers one dtype, and replicated sampling must give the same clips), the
    UMT5 encoder in bf16 (as Wan's pipeline runs it), the VAE in fp32 (as diffusers' Wan examples load
    it). Planted: the norms kept fp32, the text encoder loaded in fp32: each fails here."""
    from dit.sampler_setup import load_pretrained_sampler
    from dit.sampling import compute_dtype

    s = load_pretrained_sampler(str(wan_folder), None, 1.0, "cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in s.model.parameters()} == {torch.bfloat16}
    assert compute_dtype(s.model) == torch.bfloat16
    assert {p.dtype for p in s.text_encoder.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in s.vae.model.parameters()} == {torch.float32}


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--frames", "6"],
            "--prompt 1: frames=6: a causal video VAE with temporal stride 4 needs 1 + 4k frames",
        ),
        (["--height", "20"], "--prompt 1: height and width must be multiples of the VAE stride"),
    ],
)
def test_pretrained_bad_shapes_are_one_line_exit_2(wan_folder, tmp_path, capsys, extra, message):
    argv = ["--pretrained", str(wan_folder), "--prompt", "x", "--steps", "1", "--out", str(tmp_path), *extra]
    assert sample.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_pretrained_folder_missing_parts_is_one_line(tmp_path, capsys):
    (tmp_path / "transformer").mkdir()
    assert sample.main(["--pretrained", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks vae/, text_encoder/, tokenizer/" in err[0], err


def test_torchrun_two_ranks_writes_the_one_process_clips(wan_folder, tmp_path):
    """The user path: `torchrun --nproc_per_node 2 sample.py ... --fsdp per_layer` on a queue of mixed
    shapes: the DiT sharded over both ranks (replicated weights under torchrun are
    test_sampling_parallel's; sharded ones at the runtime level test_sampling_fsdp's)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import imageio.v3 as iio

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "q.jsonl").write_text(
        '{"prompt": "a cat", "frames": 5, "width": 32}\n{"prompt": "a dog"}\n{"prompt": "a hen", "guidance": 1}\n'
    )
    argv = ["--pretrained", str(wan_folder), "--prompts-file", str(tmp_path / "q.jsonl"), "--frames", "1",
            "--height", "16", "--width", "16", "--steps", "2"]  # fmt: skip
    assert sample.main([*argv, "--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(root / "sample.py"), *argv, "--out", str(tmp_path / "two"), "--fsdp", "per_layer"]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan: 3 requests on 2 ranks" in result.stdout
    assert "weights FSDP-sharded over 2 ranks" in result.stdout
    one, two = sorted((tmp_path / "one").glob("*.mp4")), sorted((tmp_path / "two").glob("*.mp4"))
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 3
    for a, b in zip(one, two):
        # the same frames (within 1e-5 before rounding to uint8) through the same encoder: equal
        # but for a pixel that lands on a rounding edge
        fa, fb = iio.imread(a).astype(int), iio.imread(b).astype(int)
        assert fa.shape == fb.shape and abs(fa - fb).max() <= 1, a.name


def test_a_request_that_fits_no_memory_is_named_with_what_to_lower(wan_folder, tmp_path, capsys):
    """301 kB a rank, 271 kB of it usable (0.9): the VAE (247 kB, fp32) and the text encoder (5 kB in
    bf16) every rank holds, the DiT's bf16 weights (13 kB) and 8 tokens of activations (640 B each).
    Under --precision bf16 the 1-token request fits and the 9-token one is named; in fp32 (the CPU's
    default) the weights (27 kB) and the encoder do not fit at all, and the message names bf16.
    Planted: the text encoder and VAE left out of the budget -> 402 tokens fit, no error."""
    (tmp_path / "q.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog", "height": 48, "width": 48}\n')
    argv = ["--pretrained", str(wan_folder), "--prompts-file", str(tmp_path / "q.jsonl"), "--frames", "1",
            "--height", "16", "--width", "16", "--steps", "1", "--out", str(tmp_path), "--memory-gb", "3.01e-4"]  # fmt: skip
    assert sample.main([*argv, "--precision", "bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "q.jsonl line 2: 9 tokens" in err[0]
        and "lower its frames, height or width" in err[0]
    ), err
    assert sample.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fp32 weights" in err[0] and "(or --precision bf16)" in err[0], err
    assert not list(tmp_path.glob("*.mp4"))  # checked before the first clip


def _sample_then_wait(argv: list[str]) -> None:
    """A forked child: ``sample.main(argv)`` on one thread, its output discarded (fd 1 too)."""
    import os

    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os._exit(sample.main(argv))


def test_sigkilled_job_keeps_whole_clips_and_the_rerun_skips_them(wan_folder, tmp_path, capsys):
    """A real kill (SIGKILL, no cleanup) after the first clip is written, then the same command. The
    killed job is forked from this process (it inherits torch, diffusers and sample.py: a fresh
    interpreter cost tens of seconds under load; the real launches are the torchrun test's).
    Planted: the rerun not skipping the clips in place -> fails."""
    import gc
    import multiprocessing
    import os
    import signal
    import time

    import imageio.v3 as iio

    out = tmp_path / "out"
    argv = ["--pretrained", str(wan_folder), "--frames", "5", "--height", "16", "--width", "16",
            "--steps", "10", "--out", str(out)] + [x for i in range(3) for x in ("--prompt", f"clip {i}")]  # fmt: skip
    gc.collect()  # as run_gloo: nothing of an earlier test's process group collected in the child
    gc.freeze()
    try:
        job = multiprocessing.get_context("fork").Process(target=_sample_then_wait, args=(argv,))
        job.start()
    finally:
        gc.unfreeze()
    try:
        deadline = time.time() + 240
        while not list(out.glob("*.mp4")) and job.is_alive() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(job.pid, signal.SIGKILL)
    finally:
        job.join()
    kept = {p: p.stat().st_mtime_ns for p in out.glob("*.mp4")}
    assert 1 <= len(kept) < 3, "the job was killed after its first clip and before its last"
    for p in kept:
        assert iio.imread(p).shape == (5, 16, 16, 3)  # whole clips only
    assert sample.main(argv) == 0
    assert f"{len(kept)} of 3 clips already in place; sampling {3 - len(kept)}" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # not written again
    assert len(list(out.glob("*.mp4"))) == 3 and not list(out.glob(".partial-*"))
