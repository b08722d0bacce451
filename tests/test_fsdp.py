"""FSDP2 sharding (``parallel.fsdp=per_step|per_layer``) equals single-process training, uses 1/W of
the memory at rest, and resumes from sharded checkpoints on another world size.

One spawn per world size (2, 3, 4 gloo ranks) runs both modes for 3 steps of ``parallel.mode=dynamic``
on batches whose micro-batch counts differ between ranks (at W=4 with 3 clips a rank has no clip at
all); every step's loss and gradient norm and every final parameter must match single-process
``Trainer.train_step`` on the same global batches within 1e-5 relative. The gradient norm is what
catches a wrong reduce-scatter scale: AdamW's update alone is nearly scale-free.

Resume: a 4-rank per_layer run is SIGKILLed right after its step-2 checkpoint; resumed on 4 ranks it
logs the same losses and ends with the same weights as an uninterrupted run, bit for bit on CPU;
resumed on 2 ranks (DCP reshards) its weights stay within a bound derived from the reordered fp32
sums (``_assert_resharded_close``), and so do they after the chain 4 -> 2 -> 1 -> 4 ranks; the
consolidated export loads with
diffusers' ``from_pretrained`` and samples with ``sample.py``. A replicated (fsdp=none) checkpoint
resumes under FSDP with the same weights, AdamW moments and EMA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException

from dit.batching import GlobalBatchSampler
from dit.config import load_config
from dit.trainer import Trainer
from dynamic_cp.planning.rounds import lockstep_rounds
from dynamic_cp.runtime.fsdp import bytes_at_rest, track_gathered_peak
from dynamic_cp.runtime.fsdp_trainer import FSDPTrainer
from dynamic_cp.runtime.launch import train_distributed
from dynamic_cp.runtime.testing import run_gloo

# The shared fixture runs five gloo spawns (each with its own 240 s limit); on a loaded 2-core
# machine they can pass the suite's 300 s per-test limit, which counts fixture set-up.
pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny.yaml"
MODES = ("per_step", "per_layer")
STEPS = 3
REL_TOL = 1e-5
# Per world size, batches whose plans (h100 prices) give ranks different micro-batch counts:
# W=2 [2, 1] [1, 1] [1, 1]; W=3 [1, 1, 0] [2, 1, 1] [1, 1, 0] (CP 2 beside CP 1); W=4 [1, 1, 1, 1]
# [1, 1, 1, 0] [1, 1, 1, 0]. At W=3 and 4 a rank has no clip at all in some step (at W=2 only a
# one-clip batch does that, and there the replicated runtime itself differs from one process at
# step 3: a separate, pre-existing issue).
DATA = {
    2: {"train.global_batch_size": 2, "data.seed": 1},
    3: {"train.global_batch_size": 2, "data.frame_counts": "[1, 5, 9]"},
    4: {"train.global_batch_size": 3},
}


def overrides(out: str, **extra) -> list[str]:
    items = {
        "output_dir": out,
        # 3 blocks; odd widths: 2 heads x 12, FFN 40, text 20 (no tensor splits evenly over 3 or 4 ranks)
        "model.overrides": "{num_layers: 3, patch_size: [1, 4, 4], num_attention_heads: 2, "
        "attention_head_dim: 12, ffn_dim: 40, text_dim: 20, freq_dim: 16}",
        "data.num_clips": 64,
        "data.num_val_clips": 1,
        "data.frame_counts": "[1, 5]",
        "data.resolutions": "[[16, 16], [32, 16]]",
        "flow.val_sigmas": "[0.5]",
        "train.micro_batch_tokens": 200,
        "train.warmup_steps": 1,
        "train.log_every": 1,
        "train.val_every": 100,
        "parallel.mode": "dynamic",
        "parallel.cap_tokens": 96,  # a 5-frame 32x16 clip (160 tokens) needs CP >= 2
        "parallel.plan_ahead": False,
        # fixed prices: a learned cost model plans from measured times, which differ between a killed
        # and an uninterrupted run, so the bitwise resume check needs a frozen prior
        "parallel.hardware": "h100",
        "parallel.learn_costs": False,
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Move every weight off its init (adaLN-Zero's zeros would leave most first-step gradients zero)."""
    g = torch.Generator().manual_seed(1234)
    for p in model.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g))


class PerturbedFSDP(FSDPTrainer):
    def _shard_model(self) -> None:
        perturb(self.model)  # before sharding: the same full weights as the reference
        super()._shard_model()


class PerturbedTrainer(Trainer):
    def _shard_model(self) -> None:
        perturb(self.model)


def _parity_case(mode: str, world_size: int, out: str) -> dict:
    cfg = load_config(CONFIG, overrides(out, **{"parallel.fsdp": mode, **DATA[world_size]}))
    trainer = PerturbedFSDP(cfg, dist.group.WORLD)
    peak = [0]
    track_gathered_peak(trainer.model, peak)
    batches = trainer.data_iterator()
    steps = []
    for _ in range(STEPS):
        batch = next(batches)
        metrics = trainer.train_step(batch)
        trainer.step += 1
        plan = lockstep_rounds(batch.plan, world_size)
        steps.append(
            {
                "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"],
                "counts": [len(x) for x in batch.plan.per_rank()],
                "rounds": len(plan.rounds),
            }
        )
    batches.close()
    full = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}  # collective
    return {
        "steps": steps,
        "params": full,
        "memory": bytes_at_rest(trainer.model, trainer.optimizer),
        "gathered_peak": peak[0],
    }


def _resume_runs(root: str) -> None:
    """The uninterrupted 6-step per_layer run (checkpoints at steps 2, 4 and 6; 4 and 6 kept)."""
    extra = {"parallel.fsdp": "per_layer", "train.max_steps": 6, "train.checkpoint_every": 2, **DATA[4]}
    train_distributed(load_config(CONFIG, overrides(f"{root}/whole", **extra)), dist.group.WORLD)


def parity_worker(rank: int, world_size: int, root: str) -> dict:
    try:
        out = {mode: _parity_case(mode, world_size, f"{root}/w{world_size}_{mode}") for mode in MODES}
        if world_size == 4:
            _resume_runs(root)
        if world_size == 2:  # spawned after the killed run: resume it here on 2 ranks
            out["on2"] = _resume_case(root, "resumed_on_2")
            out["from_replicated"] = _from_replicated(root)
            out["auto"] = _auto_case(root)
            out["auto_resume"] = _auto_resume_case(root)
        return out if rank == 0 else {m: {"memory": out[m]["memory"]} for m in MODES}
    except Exception:  # the spawn error shows only the last frame; keep the whole trace
        return {"error": traceback.format_exc()}


def _auto_case(root: str) -> dict:
    """parallel.fsdp=auto with parallel.memory_gb just above what per_layer needs at W=2: the
    launcher must pick per_layer (the others do not fit) and train with it."""
    from dynamic_cp.planning.memory import memory_breakdown
    from dynamic_cp.runtime.fsdp import model_dims_of

    cfg = load_config(CONFIG, overrides(f"{root}/auto", **{"train.max_steps": 1, **DATA[2]}))
    dims, cap = model_dims_of(cfg), cfg.parallel.cap_tokens
    need = {m: memory_breakdown(dims, m, 2, cap, ema=True).total for m in MODES}
    gb = need["per_layer"] / 0.9 * 1.01 / 1e9
    cfg = load_config(
        CONFIG, overrides(f"{root}/auto", **{"train.max_steps": 1, "parallel.memory_gb": gb, **DATA[2]})
    )
    trainer = train_distributed(cfg, dist.group.WORLD)
    return {"mode": trainer.fsdp_mode if isinstance(trainer, FSDPTrainer) else "none",
            "per_step_fits": need["per_step"] <= 0.9 * gb * 1e9, "step": trainer.step}  # fmt: skip


def _auto_resume_case(root: str) -> dict:
    """parallel.fsdp=auto with memory for replicated weights, resuming the killed per_layer run's
    sharded checkpoint: it must stay sharded (per_step), not fall back to 'none' and fail to load."""
    extra = {"train.max_steps": 3, "train.checkpoint_every": 2, **DATA[4]}
    cfg = load_config(CONFIG, overrides(f"{root}/auto_resume", **extra))
    trainer = train_distributed(cfg, dist.group.WORLD, resume=f"{root}/killed/checkpoints/step_000002")
    return {"mode": trainer.fsdp_mode, "step": trainer.step}


def killed_worker(rank: int, world_size: int, root: str) -> None:
    extra = {"parallel.fsdp": "per_layer", "train.max_steps": 4, "train.checkpoint_every": 2, **DATA[4]}
    trainer = FSDPTrainer(load_config(CONFIG, overrides(f"{root}/killed", **extra)), dist.group.WORLD)
    save = trainer.save

    def save_then_die():
        done = save()
        if trainer.step == 2:  # the checkpoint is committed (save ends in a barrier): die, no cleanup
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    trainer.save = save_then_die
    trainer.train()


def _resume_case(root: str, run: str) -> dict:
    """Resume the killed run's step-2 checkpoint into ``run`` and train to step 4; -> full weights."""
    extra = {"parallel.fsdp": "per_layer", "train.max_steps": 4, "train.checkpoint_every": 2, **DATA[4]}
    cfg = load_config(CONFIG, overrides(f"{root}/{run}", **extra))
    trainer = train_distributed(cfg, dist.group.WORLD, resume=f"{root}/killed/checkpoints/step_000002")
    return {"params": {n: p.full_tensor() for n, p in trainer.model.named_parameters()}}


def _replicated_checkpoint(root: Path) -> Trainer:
    """One single-process step of plain (replicated) training, checkpointed: weights, AdamW, EMA."""
    cfg = load_config(CONFIG, overrides(f"{root}/one", **{"parallel.mode": "none", "parallel.fsdp": "none"}))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    sampler = GlobalBatchSampler(trainer.train_indices, cfg.train.global_batch_size, cfg.data.seed)
    trainer.train_step(trainer.prepare([trainer.train_set[i] for i in sampler.batch(0)], 0))
    trainer.step = 1
    trainer.save()
    return trainer


def _from_replicated(root: str) -> dict:
    """An FSDP run resumed from the replicated checkpoint: its full weights, exp_avg and EMA."""
    cfg = load_config(CONFIG, overrides(f"{root}/from_one", **{"parallel.fsdp": "per_layer"}))
    trainer = FSDPTrainer(cfg, dist.group.WORLD, resume=f"{root}/one")
    named = list(trainer.model.named_parameters())
    return {
        "step": trainer.step,
        "params": {n: p.full_tensor() for n, p in named},
        "exp_avg": {n: trainer.optimizer.state[p]["exp_avg"].full_tensor() for n, p in named},
        "ema": {n: t.full_tensor() for n, t in trainer.ema.params.items()},
    }


def chain_worker(rank: int, world_size: int, root: str) -> dict:
    """The resume chain 4 -> 2 -> 1 -> 4: the killed 4-rank run's step-2 checkpoint went on for two
    steps on 2 ranks (``resumed_on_2``); here step 5 runs on 1 rank (a cap for one rank: the longest
    clip needs CP 2 at the usual cap), then step 6 on 4 ranks again."""
    try:
        extra = {"parallel.fsdp": "per_layer", "train.checkpoint_every": 1, **DATA[4]}
        if world_size == 1:
            extra.update({"train.max_steps": 5, "parallel.cap_tokens": 400})
            cfg = load_config(CONFIG, overrides(f"{root}/on1", **extra))
            train_distributed(cfg, dist.group.WORLD, resume=f"{root}/resumed_on_2/checkpoints/step_000004")
            return {}
        cfg = load_config(CONFIG, overrides(f"{root}/back_on4", **{**extra, "train.max_steps": 6}))
        trainer = train_distributed(cfg, dist.group.WORLD, resume=f"{root}/on1/checkpoints/step_000005")
        return {"params": {n: p.full_tensor() for n, p in trainer.model.named_parameters()}}
    except Exception:
        return {"error": traceback.format_exc()}


def resume_worker(rank: int, world_size: int, root: str) -> dict:
    try:
        return _resume_case(root, "killed")
    except Exception:
        return {"error": traceback.format_exc()}


def fsdp_steps(cfg) -> dict:
    """STEPS sharded steps of ``cfg`` on the world group (collective): each step's loss and gradient
    norm, and the full final parameters."""
    trainer = PerturbedFSDP(cfg, dist.group.WORLD)
    batches = trainer.data_iterator()
    steps = []
    for _ in range(STEPS):
        metrics = trainer.train_step(next(batches))
        trainer.step += 1
        steps.append({k: metrics[k] for k in ("loss", "grad_norm")})
    batches.close()
    return {"steps": steps, "params": {n: p.full_tensor() for n, p in trainer.model.named_parameters()}}


def assert_equals_single_process(got: dict, cfg, check_clips=None, label: str = "") -> None:
    """``got`` (rank 0's ``fsdp_steps``) against STEPS single-process steps of ``cfg`` on the same global
    batches, within REL_TOL; ``check_clips(clips)`` asserts the path under test runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # cores shared with spawned ranks
    try:
        trainer = PerturbedTrainer(cfg, device=torch.device("cpu"))
        sampler = GlobalBatchSampler(trainer.train_indices, cfg.train.global_batch_size, cfg.data.seed)
        ref_steps = []
        for s in range(STEPS):
            clips = trainer.prepare([trainer.train_set[i] for i in sampler.batch(s)], s)
            if check_clips is not None:
                check_clips(clips)
            ref_steps.append(trainer.train_step(clips))
    finally:
        torch.set_num_threads(threads)
    for s, (step, ref) in enumerate(zip(got["steps"], ref_steps)):
        assert step["loss"] == pytest.approx(ref["loss"], rel=REL_TOL), f"{label}step {s + 1} loss"
        assert step["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL_TOL), (
            f"{label}step {s + 1} grad norm"
        )
    for name, p in trainer.model.named_parameters():
        err = _rel(got["params"][name], p.detach())
        assert err < REL_TOL, f"{label}{name} differs from single process by {err:.2e}"


def one_process_run(cfg, steps: int) -> tuple[list[dict], dict]:
    """``steps`` single-process steps of ``cfg`` on the global batches the ranks see, on one thread
    (the cores are shared with spawned ranks): per-step metrics and final parameters. The reference
    of every spawned parity test here and in test_default_path_worlds.py and test_pipeline.py."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = PerturbedTrainer(cfg, device=torch.device("cpu"))
        sampler = GlobalBatchSampler(trainer.train_indices, cfg.train.global_batch_size, cfg.data.seed)
        metrics = []
        for s in range(steps):
            clips = trainer.prepare([trainer.train_set[i] for i in sampler.batch(s)], s)
            metrics.append(trainer.train_step(clips))
        return metrics, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _reference(world_size: int, out: str) -> tuple[list[dict], dict]:
    """Single-process steps on the same global batches: per-step metrics and final parameters."""
    single = {"parallel.mode": "none", "parallel.fsdp": "none", **DATA[world_size]}
    return one_process_run(load_config(CONFIG, overrides(out, **single)), STEPS)


# ----------------------------------------------------------------------------- resharded-resume tolerances
# A resume on another world size changes only the order of fp32 operations: the plan packs and shards the
# step's clips differently, so each gradient element sums its per-token terms and the rank partials in
# another order (and AVX2 and AVX-512 kernels block their sums differently again). The longest reordered
# sum has at most STEP_TOKENS terms (every token of a step's batch; attention's key sums and the matmuls'
# inner sums are shorter: <= 160 keys, widths <= 40). A reordered fp32 sum of n terms moves by at most
# n * u of its terms' magnitudes (recursive summation's worst case, u = 2^-24); the typical move is
# sqrt(n) * u, which leaves a factor sqrt(480) ~ 22 for cancellation and the recomputed activations.
# So each gradient element moves by at most eta = STEP_TOKENS * u of its scale, and AdamW's update
# m / (sqrt(v) + eps) by at most 2 eta (once through m, once through sqrt(v)); times the learning rate,
# summed over steps (decoupled weight decay only shrinks a difference): an absolute bound, as tight for a
# zero-initialised bias as for a matrix. On top, each step rounds the weight itself twice (the decay's
# multiply and the update's add, u |w| each), and two runs may round it differently: 4 u |w| a step,
# relative. (On an AVX-512 BF16 host under OMP_NUM_THREADS=1 the largest difference was one ulp of a
# weight near 1, which only this second term explains.)
# Bugs sit far above both: a skipped AdamW step moves elements by ~lr (thousands of times the absolute
# term), a shard loaded at a wrong offset by the weights themselves.
U = 2.0**-24  # fp32 unit roundoff
STEP_TOKENS = 480  # DATA[4]: 3 clips of at most 5 frames x 8 x 4 patches = 160 tokens
LR = 1e-3  # configs/tiny.yaml's train.lr; warm-up and a constant schedule keep every lr_t <= LR

# The logged loss averages a step's squared errors: at most STEP_TOKENS x 48 values (3 pixel channels x a
# 1x4x4 patch per token), all non-negative, so no cancellation: reordering moves it by at most that many
# u, relative; the weights' own differences, within the bound above, add far less.
RESHARDED_LOSS_REL = STEP_TOKENS * 48 * U


def _assert_resharded_close(params: dict, whole: dict, steps: int, what: str) -> None:
    """Per element: |a - b| <= 2 STEP_TOKENS u * steps * LR + 4 u * steps * |b| (the bound above)."""
    assert params.keys() == whole.keys()
    for name, p in params.items():
        torch.testing.assert_close(
            p,
            whole[name],
            atol=2 * STEP_TOKENS * U * steps * LR,
            rtol=4 * U * steps,
            msg=lambda m, name=name: f"{name}: {what}: {m}",
        )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _check(res: dict) -> None:
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r} failed:\n{out['error']}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Five spawns: W=4 (parity, the uninterrupted run), the killed run, its resume on 4 ranks, W=2
    (parity, the resume on 2 ranks), W=3 (parity)."""
    root = tmp_path_factory.mktemp("fsdp")
    results = {4: run_gloo(parity_worker, 4, str(root), timeout_s=240)}
    _check(results[4])
    with pytest.raises(ProcessExitedException) as killed:
        run_gloo(killed_worker, 4, str(root), timeout_s=240)
    assert killed.value.signal_name == "SIGKILL" or killed.value.exit_code != 0, killed.value
    on4 = run_gloo(resume_worker, 4, str(root), timeout_s=240)
    _check(on4)
    one = _replicated_checkpoint(root)  # the W=2 spawn resumes it under FSDP
    for w in (2, 3):
        results[w] = run_gloo(parity_worker, w, str(root), timeout_s=240)
        _check(results[w])
    for w in (1, 4):  # the chain goes on from the W=2 spawn's resume
        results[f"chain{w}"] = run_gloo(chain_worker, w, str(root), timeout_s=240)
        _check(results[f"chain{w}"])
    return root, results, on4[0], one


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_steps_equal_single_process(runs, mode, world_size, tmp_path):
    root, results, _, _ = runs
    res = results[world_size][0][mode]
    assert all(s["rounds"] >= max(s["counts"]) for s in res["steps"])
    ref_steps, ref_params = _reference(world_size, str(tmp_path / "ref"))
    counts = [s["counts"] for s in res["steps"]]
    assert any(len(set(c)) > 1 for c in counts), f"every step had equal micro-batch counts: {counts}"
    if world_size > 2:
        assert any(0 in c for c in counts), f"no step left a rank without a clip: {counts}"
    for s, (got, ref) in enumerate(zip(res["steps"], ref_steps)):
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL_TOL), f"step {s + 1} loss"
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL_TOL), f"step {s + 1} grad norm"
    for name, p_ref in ref_params.items():
        err = _rel(res["params"][name], p_ref)
        assert err < REL_TOL, f"{mode} W={world_size}: {name} differs from single process by {err:.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_memory_at_rest_is_one_over_w(runs, mode):
    """W=4: parameter, gradient and AdamW bytes per rank <= 1/W of replicated + the gathered buffers
    (per_layer: one block's weights, per_step: all compute-dtype weights), and nothing is held twice."""
    _, results, _, _ = runs
    res = results[4]
    params = res[0][mode]["params"]
    replicated = 4 * sum(p.numel() for p in params.values())  # fp32 bytes of the full weights
    block = 4 * sum(p.numel() for n, p in params.items() if n.startswith("blocks.0."))
    gathered = block if mode == "per_layer" else replicated
    for r in range(4):
        mem = res[r][mode]["memory"]
        assert mem["params"] <= replicated / 4 + gathered, (r, mem)
        assert mem["grads"] <= replicated / 4 + gathered, (r, mem)
        assert mem["optim"] <= 2 * replicated / 4 + 2 * gathered, (r, mem)
    # the shards partition the model: together they hold each weight, gradient and moment once
    assert sum(res[r][mode]["memory"]["params"] for r in range(4)) == replicated
    assert sum(res[r][mode]["memory"]["grads"] for r in range(4)) == replicated
    assert sum(res[r][mode]["memory"]["optim"] for r in range(4)) == 2 * replicated
    peak = res[0][mode]["gathered_peak"]
    if mode == "per_layer":  # during forward: the root's weights and the running block
        root = 4 * sum(p.numel() for n, p in params.items() if not n.startswith("blocks."))
        assert peak <= root + block, (peak, root, block)
    else:
        assert peak == replicated


@pytest.fixture(scope="module")
def resumed(runs):
    root, results, on4, _ = runs
    return root, on4, results[2][0]["on2"]


def _losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {rec["step"]: rec["loss"] for rec in lines if "loss" in rec}


def _weights(step_dir: Path, which: str = "model") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(step_dir / which / "diffusion_pytorch_model.safetensors")


def test_killed_run_resumed_on_4_ranks_is_bitwise(resumed):
    root, _, _ = resumed
    assert not (root / "killed" / "checkpoints" / "step_000002.tmp").exists()
    whole, killed = _losses(root / "whole"), _losses(root / "killed")
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and killed == {s: whole[s] for s in (1, 2, 3, 4)}
    for which in ("model", "ema"):
        a = _weights(root / "whole" / "checkpoints" / "step_000004", which)
        b = _weights(root / "killed" / "checkpoints" / "step_000004", which)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), which


def test_killed_run_resumed_on_2_ranks_matches(resumed):
    root, _, on2 = resumed
    whole = _weights(root / "whole" / "checkpoints" / "step_000004")
    _assert_resharded_close(on2["params"], whole, 4, "4 -> 2 ranks")


def test_resume_chain_4_2_1_4_matches(runs):
    """Steps 1-2 on 4 ranks (killed), 3-4 on 2, 5 on 1, 6 on 4: the weights and logged losses of
    the uninterrupted 4-rank run, within the reordered-sum bounds above (DCP reshards at each hop; only
    the order of float sums changes with the world size)."""
    root, results, _, _ = runs
    whole = _weights(root / "whole" / "checkpoints" / "step_000006")
    _assert_resharded_close(results["chain4"][0]["params"], whole, 6, "4 -> 2 -> 1 -> 4 ranks")
    losses = {**_losses(root / "on1"), **_losses(root / "back_on4")}
    assert sorted(losses) == [5, 6]
    for step, loss in losses.items():
        assert loss == pytest.approx(_losses(root / "whole")[step], rel=RESHARDED_LOSS_REL), step


def test_export_loads_in_diffusers_and_sample_py(resumed, tmp_path):
    from dit.model import VideoDiT

    root, on4, _ = resumed
    step_dir = root / "killed" / "checkpoints" / "step_000004"
    model = VideoDiT.from_pretrained(step_dir / "model")  # diffusers ModelMixin.from_pretrained
    for name, p in model.named_parameters():
        assert torch.equal(p, on4["params"][name]), name
    spec = importlib.util.spec_from_file_location("sample_cli", ROOT / "sample.py")
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    args = [
        "--checkpoint",
        str(step_dir),
        "--prompt",
        "x",
        "--frames",
        "1",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert sample.main(args) == 0
    assert list(tmp_path.glob("*.mp4"))


@pytest.mark.parametrize(
    "items, message",
    [
        (["parallel.fsdp=zero3"], "parallel.fsdp='zero3'"),
        (["parallel.mode=none", "parallel.fsdp=per_layer"], "parallel.mode=static or dynamic"),
    ],
)
def test_fsdp_config_errors_name_the_field(items, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, items)


def test_explicit_modes_resolve_to_themselves():
    from dynamic_cp.runtime.fsdp import resolve_fsdp_mode

    assert load_config(None, []).parallel.fsdp == "auto"
    for mode in ("none", "per_step", "per_layer"):
        cfg = load_config(None, ["parallel.mode=dynamic", f"parallel.fsdp={mode}"])
        assert resolve_fsdp_mode(cfg, 4, memory_bytes=1.0) == mode  # memory matters to auto only


WAN14B = ROOT / "configs" / "wan-14b-finetune.yaml"


@pytest.mark.parametrize(
    "gb, want",
    [
        (1000, "none"),  # replicated weights, gradients and ZeRO-1 moments fit
        (120, "per_step"),  # 8 x 14B bf16 weights gathered once a step, sharded master and moments
        (80, "per_layer"),  # an H100: only ZeRO-3 fits (README, configs/wan-14b-finetune.yaml)
    ],
)
def test_auto_picks_the_fastest_mode_that_fits(gb, want):
    """Wan-14B shapes (model.size, no weights), 32 ranks, checkpointing, 16,384 tokens per rank."""
    from dynamic_cp.runtime.fsdp import auto_fsdp_choice, resolve_fsdp_mode

    items = ["model.pretrained=null", "train.micro_batch_tokens=16384", "parallel.fsdp=auto"]
    cfg = load_config(WAN14B, items)
    mode, expected, cap = auto_fsdp_choice(cfg, 32, gb * 1e9)
    assert (mode, cap) == (want, 16384)
    assert expected <= 0.9 * gb * 1e9
    assert resolve_fsdp_mode(cfg, 32, memory_bytes=gb * 1e9) == want


def test_auto_without_a_fitting_mode_names_the_knobs():
    from dynamic_cp.runtime.fsdp import resolve_fsdp_mode

    cfg = load_config(WAN14B, ["model.pretrained=null", "parallel.fsdp=auto"])
    with pytest.raises(ValueError, match="micro_batch_tokens.*gradient_checkpointing.*more GPUs"):
        resolve_fsdp_mode(cfg, 2, memory_bytes=24e9)


def test_auto_keeps_a_lora_run_replicated_and_refuses_lora_under_fsdp():
    from dynamic_cp.runtime.fsdp import auto_fsdp_choice, resolve_fsdp_mode

    items = ["model.pretrained=null", "model.lora={rank: 16}", "train.micro_batch_tokens=16384"]
    mode, expected, _ = auto_fsdp_choice(load_config(WAN14B, [*items, "parallel.fsdp=auto"]), 1, 80e9)
    assert mode == "none" and 28e9 < expected < 72e9  # the frozen bf16 base, adapters, activations
    with pytest.raises(ValueError, match="parallel.fsdp=auto or none"):
        resolve_fsdp_mode(load_config(WAN14B, [*items, "parallel.fsdp=per_layer"]), 8)


def test_memory_gb_must_be_positive():
    with pytest.raises(ValueError, match="parallel.memory_gb=0"):
        load_config(None, ["parallel.memory_gb=0"])


def test_auto_picks_per_layer_when_only_it_fits_and_trains(runs):
    _, results, _, _ = runs
    got = results[2][0]["auto"]
    assert not got["per_step_fits"]  # the case is set up so that only per_layer fits
    assert got["mode"] == "per_layer" and got["step"] == 1


def test_auto_resuming_a_sharded_checkpoint_stays_sharded(runs):
    _, results, _, _ = runs
    assert results[2][0]["auto_resume"] == {"mode": "per_step", "step": 3}


def test_a_replicated_trainer_refuses_a_sharded_checkpoint_by_name(runs, tmp_path):
    root = runs[0]
    step_dir = root / "killed" / "checkpoints" / "step_000002"
    cfg = load_config(
        CONFIG, overrides(str(tmp_path / "one"), **{"parallel.mode": "none", "parallel.fsdp": "none"})
    )
    with pytest.raises(ValueError, match="parallel.fsdp=auto, per_step or per_layer"):
        Trainer(cfg, resume=str(step_dir), device=torch.device("cpu"))


def test_fsdp_run_resumes_from_a_replicated_checkpoint(runs):
    """fsdp=none checkpoint (full weights, plain AdamW state dict, EMA) -> 2-rank per_layer run: every
    rank keeps its shards of the same numbers, bit for bit."""
    _, results, _, one = runs
    got = results[2][0]["from_replicated"]
    assert got["step"] == 1
    for name, p in one.model.named_parameters():
        assert torch.equal(got["params"][name], p.detach()), name
        assert torch.equal(got["exp_avg"][name], one.optimizer.state[p]["exp_avg"]), name
    for name, p in one.ema.model.named_parameters():
        assert torch.equal(got["ema"][name], p), name
