"""End-to-end: train.py and sample.py on a shrunken tiny config, resume, and CLI error messages."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

import sample
import train
from dit.batching import GlobalBatchSampler, pack_by_token_budget
from dit.config import load_config
from dit.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One uninterrupted 6-step run, checkpointing every 3 steps."""
    tmp = tmp_path_factory.mktemp("full")
    assert (
        train.main(
            ["--config", TINY, *tiny_overrides(tmp, **{"train.max_steps": 6, "train.checkpoint_every": 3})]
        )
        == 0
    )
    return tmp / "run"


def test_resume_equals_uninterrupted_run_bit_for_bit(trained, tmp_path):
    over = tiny_overrides(tmp_path, **{"train.max_steps": 6, "train.checkpoint_every": 3})
    # "killed" after step 3: a run that stops there, then a resumed one to step 6
    assert train.main(["--config", TINY, *over, "train.max_steps=3"]) == 0
    # `--resume` before the overrides: argparse hands it the first override, which must go back
    assert train.main(["--config", TINY, "--resume", *over]) == 0
    full, resumed = _losses(trained), _losses(tmp_path / "run")
    assert sorted(full) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert all(full[s] == resumed[s] for s in full), (full, resumed)  # exact equality, not closeness
    a = torch.load(trained / "checkpoints" / "step_000006" / "trainer.pt", weights_only=True)["optimizer"]
    b = torch.load(tmp_path / "run" / "checkpoints" / "step_000006" / "trainer.pt", weights_only=True)[
        "optimizer"
    ]
    assert all(torch.equal(a["state"][k]["exp_avg"], b["state"][k]["exp_avg"]) for k in a["state"])


def test_checkpoint_layout_and_pruning(trained):
    ckpts = trained / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000006"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000003", "step_000006"]
    step = ckpts / "step_000006"
    for part in ("model/diffusion_pytorch_model.safetensors", "ema/config.json", "trainer.pt", "config.yaml"):
        assert (step / part).exists(), part
    assert not list(ckpts.glob("*.tmp"))


def test_validation_loss_logged_at_start_and_end(trained):
    lines = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in lines if "val_loss" in r}
    assert 0 in val and 6 in val
    assert all(r["tokens_per_s"] > 0 for r in lines if "loss" in r)


def test_sample_writes_mp4_and_is_deterministic(trained, tmp_path):
    args = ["--checkpoint", str(trained), "--prompt", "a red circle moving left on a black background",
            "--frames", "3", "--height", "16", "--width", "24", "--steps", "3", "--grid"]  # fmt: skip
    assert sample.main([*args, "--out", str(tmp_path / "a")]) == 0
    assert sample.main([*args, "--out", str(tmp_path / "b")]) == 0
    mp4 = sorted((tmp_path / "a").glob("*.mp4"))
    assert len(mp4) == 1 and mp4[0].stat().st_size > 0
    assert (tmp_path / "a" / mp4[0].name).read_bytes() == (tmp_path / "b" / mp4[0].name).read_bytes()
    import imageio.v3 as iio

    frames = iio.imread(mp4[0])
    assert frames.shape[0] == 3 and frames.shape[1:3] == (16, 24)  # the size asked for: --upscale 1


def test_same_seed_same_clip_different_seed_different_clip(trained):
    from data.hashed_text import HashedTextEncoder
    from dit.model import VideoDiT
    from dit.sampling import generate

    model = VideoDiT.from_pretrained(trained / "checkpoints" / "step_000006" / "ema")
    enc = HashedTextEncoder(dim=model.config.text_dim)
    a, b, c = (
        generate(model, enc, None, ["a blue square moving up"], 3, 16, 16, steps=2, seed=s)[0]
        for s in (1, 1, 2)
    )
    assert torch.equal(a, b) and not torch.equal(a, c)


def _cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["train.py", "--config", TINY, "train.bogus=1"], "unknown config key train.bogus"),
        (
            ["sample.py", "--checkpoint", "/no/such/run", "--prompt", "x"],
            "checkpoint path /no/such/run does not exist",
        ),
    ],
)
def test_cli_errors_are_one_line_with_the_fix(args, message):
    """Each script as a user starts it (a fresh interpreter: its exit status and all of fd 2)."""
    result = _cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


# The same path in this process (main -> run_cli -> exit code 2), read on fd 2 (capfd: native writes
# too): a fresh interpreter for each would cost a torch import (seconds) and test nothing more than
# the two cases above.
@pytest.mark.parametrize(
    "args,message",
    [
        (["--config", "nope.yaml"], "config file nope.yaml does not exist"),
        (["--config", TINY, "train.lr=-3"], "train.lr=-3.0 must be positive"),
    ],
)
def test_train_errors_in_process_are_one_line_with_the_fix(args, message, capfd):
    assert train.main(args) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_sample_rejects_sizes_not_divisible_by_patch(trained, capfd):
    assert sample.main(["--checkpoint", str(trained), "--prompt", "x", "--height", "17"]) == 2
    assert "height=17 is not divisible by the patch size 2" in capfd.readouterr().err


def test_global_batches_are_a_pure_function_of_step():
    a = GlobalBatchSampler(range(10), 4, seed=3)
    b = GlobalBatchSampler(range(10), 4, seed=3, start_step=5)
    assert next(iter(b)) == a.batch(5)
    first_epoch = a.batch(0) + a.batch(1) + a.batch(2)[:2]
    assert sorted(first_epoch) == list(range(10))  # each clip once per epoch


def test_token_budget_packing():
    groups = pack_by_token_budget([50, 10, 40, 30, 200, 5], budget=100)
    assert sorted(i for g in groups for i in g) == list(range(6))
    lens = [50, 10, 40, 30, 200, 5]
    assert all(sum(lens[i] for i in g) <= 100 or len(g) == 1 for g in groups)
    assert [4] in groups  # over budget alone


def test_trainer_step_reduces_loss_on_a_fixed_batch(tmp_path):
    cfg = load_config(TINY, tiny_overrides(tmp_path, **{"train.lr": 3e-3}))
    trainer = Trainer(cfg)
    samples = [trainer.train_set[i] for i in range(4)]
    clips = trainer.prepare(samples, step=0)
    first = trainer.train_step(clips)["loss"]
    for _ in range(15):
        last = trainer.train_step(clips)["loss"]
    assert last < 0.8 * first


def test_pretrained_model_refuses_overrides():
    from dit.model_config import ModelConfig
    from dit.setup import build_model

    with pytest.raises(ValueError, match="cannot change a pretrained model"):
        build_model(ModelConfig(pretrained="/some/wan", overrides={"num_layers": 2}))


def test_generate_rejects_frames_a_causal_vae_cannot_make(trained):
    from types import SimpleNamespace

    from data.hashed_text import HashedTextEncoder
    from dit.model import VideoDiT
    from dit.sampling import generate

    model = VideoDiT.from_pretrained(trained / "checkpoints" / "step_000006" / "ema")
    vae = SimpleNamespace(stride=(4, 8, 8))  # only its stride is read before the check
    with pytest.raises(ValueError, match="frames=10: .* needs 1 \+ 4k frames, e.g. 9"):
        generate(model, HashedTextEncoder(dim=model.config.text_dim), vae, ["x"], 10, 32, 32)


def test_run_killed_with_sigkill_resumes_to_the_same_losses(trained, tmp_path):
    """A real kill (SIGKILL, no cleanup) of a run still going, right after its first checkpoint."""
    import signal
    import time

    over = tiny_overrides(tmp_path, **{"train.checkpoint_every": 2})
    # The reference and the resumed steps run here, on this process's intra-op thread count (conftest
    # sets it); the killed run must use the same count, or reductions split differently and the
    # losses differ in the last bits (torchrun, for one, exports OMP_NUM_THREADS=1).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    # max_steps only decides when to stop, so a long run killed early shares the 6-step run's numbers
    proc = subprocess.Popen([sys.executable, "train.py", "--config", TINY, *over, "train.max_steps=1000"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.time() + 600  # seconds on an idle machine; minutes on a loaded CI runner
    while not latest.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    killed_at = int(latest.read_text().strip().split("_")[1])
    assert 2 <= killed_at <= 6
    assert train.main(["--config", TINY, *over, "train.max_steps=6", "--resume"]) == 0
    full, resumed = _losses(trained), _losses(tmp_path / "run")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert all(full[s] == resumed[s] for s in full), (full, resumed)
