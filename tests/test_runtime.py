"""The Dynamic-CP runtime equals single-process training: parameters after a step, losses after resume.

One spawn of 4 gloo ranks runs every distributed case; the single-process references run here.
- dynamic: the planner's plan (a clip longer than the per-rank cap forces CP >= 2), attention in the
  layout the cost model picks;
- hybrid: 2 heads and a 320-token clip that needs CP 4, on a zero-latency profile where the cost
  model picks Ulysses 2 x ring 2: the 2-D layout runs (checked on the attention objects built);
- static: every micro-batch on CP 2, ring attention;
- uneven: 3 clips on 4 ranks (rank 3 loads nothing, some rank may run nothing);
- resume: a run that dies mid-step after its step-2 checkpoint, resumed, logs the same losses as an
  uninterrupted run.
The gradients handed to the optimizer (after the all-reduce, before clipping), the logged loss and
grad_norm must equal the single-process ``Trainer.train_step`` on the same global batch within 1e-5
(relative, per tensor), and so must each rank's parameters after the optimizer step; all ranks must be
identical. Gradients are compared because AdamW's first step is about lr * sign(g): weights alone
would let a gradient off by a factor of W pass (the "planted_scale" case shows the check catches it).
The command line under torchrun (``torchrun ... train.py parallel.mode=dynamic``: env:// start-up, plan
ahead, checkpoints) is tests/test_faults_torchrun.py's uninterrupted 4-rank run.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import save_small_clip

from dit.batching import GlobalBatchSampler
from dit.config import load_config
from dit.trainer import Trainer
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.runtime import distributed_trainer
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.launch import train_distributed
from dynamic_cp.runtime.routing import share_of
from dynamic_cp.runtime.testing import assert_grads_match, record_step_grads, relative_error, run_gloo

WORLD = 4
CAP = 96  # tokens per rank; a 5-frame 32x16 clip has 5 * 8 * 4 = 160 tokens, so it needs CP >= 2
REL_TOL = 1e-5
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def overrides(out: str, **extra) -> list[str]:
    items = {
        "output_dir": out,
        "model.overrides": "{num_layers: 2, patch_size: [1, 4, 4]}",  # token counts the cases below assume
        "data.num_clips": 64,
        "data.num_val_clips": 1,
        "data.frame_counts": "[1, 5]",
        "data.resolutions": "[[16, 16], [32, 16]]",
        "flow.val_sigmas": "[0.5]",
        "train.global_batch_size": 8,
        "train.micro_batch_tokens": 200,
        "train.warmup_steps": 1,
        "train.log_every": 1,
        "train.val_every": 100,
        "parallel.cap_tokens": CAP,
        "parallel.plan_ahead": True,
        "parallel.hardware": "h100",  # fixed prices: the resume and plan checks need a fixed prior
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


PROFILE = "zero_latency.yaml"  # written into the run's root by the fixture
CASES = {
    "dynamic": {"parallel.mode": "dynamic"},
    "hybrid": {
        "parallel.mode": "dynamic",
        "model.overrides": "{num_layers: 2, patch_size: [1, 4, 4], num_attention_heads: 2, attention_head_dim: 64}",
        "data.resolutions": "[[32, 32]]",  # 64 tokens a frame: 5 frames need CP 4 under the cap
        "train.global_batch_size": 3,
        "parallel.plan_ahead": False,
    },
    "static": {"parallel.mode": "static", "parallel.static_cp_size": 2, "parallel.cp_method": "ring"},
    "uneven": {"parallel.mode": "dynamic", "train.global_batch_size": 3, "parallel.plan_ahead": False},
    # one Wan2.2 A14B expert: every clip's sigma on its side of the switch, drawn alike on every rank
    # (planted: the ranks drawing from the whole range: the step differs)
    "expert": {
        "parallel.mode": "dynamic",
        "model.expert": "low",
        "model.boundary_ratio": 0.875,
        "flow.shift": 3.0,
    },
    # image-to-video: 3 + 1 mask + 3 image channels in, CLIP tokens (a small random CLIPVisionModel,
    # written by the fixture) through the image K/V; condition tokens and CLIP tokens are routed too
    "i2v": {
        "parallel.mode": "dynamic",
        "model.overrides": "{num_layers: 2, patch_size: [1, 4, 4], in_channels: 7, out_channels: 3, "
        "image_dim: 12, added_kv_proj_dim: 128}",
    },
    # Wan2.2 TI2V: per-token timesteps, every multi-frame clip image-to-video (frame 0 clean at t = 0,
    # out of the loss); the clips' mode is routed with them and each CP shard finds its frame-0 tokens
    "ti2v": {
        "parallel.mode": "dynamic",
        "model.overrides": "{num_layers: 2, patch_size: [1, 4, 4], expand_timesteps: true}",
        "flow.clean_first_frame": 1.0,
    },
}
CLIP = "clip"  # written into the run's root by the fixture


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Move every weight off its init: adaLN-Zero's zero gates and output would otherwise leave most
    gradients of the first step zero, and the comparison vacuous."""
    g = torch.Generator().manual_seed(1234)
    for p in model.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g))


def _image_encoder(case: str, out: str) -> dict:
    return {"data.image_encoder_path": str(Path(out).parent / CLIP)} if case == "i2v" else {}


def _one_step(case: str, out: str, plant_scale: float | None = None) -> dict:
    # Latency-free links make the cost model's 2-D split win at CP 4 (with latency, ring's fewer
    # calls win at these tiny sizes); the profile only changes prices, never the maths.
    hardware = {"parallel.hardware": str(Path(out).parent / PROFILE)} if case == "hybrid" else {}
    hardware |= _image_encoder(case, out)
    cfg = load_config(CONFIG, overrides(out, **CASES[case], **hardware))
    trainer = DistributedTrainer(cfg, dist.group.WORLD)
    perturb(trainer.model)
    if plant_scale is not None:  # a planted bug: the reduced gradients off by a constant factor
        all_reduce = trainer.strategy.reduce

        def scaled(*args):
            result = all_reduce(*args)
            for p in trainer.trainable_parameters():
                p.grad.mul_(plant_scale)
            return result

        trainer.strategy.reduce = scaled
    grads = record_step_grads(trainer)
    batches = trainer.data_iterator()
    batch = next(batches)
    built = []  # (layout, attention type, inner type) of every micro-batch this rank ran

    def recording(*args, **kwargs):
        attention, shard = make_cp_attention(*args, **kwargs)
        inner = getattr(attention, "inner", None)
        built.append((kwargs["layout"], type(attention).__name__, type(inner).__name__))
        return attention, shard

    make_cp_attention = distributed_trainer.make_cp_attention
    distributed_trainer.make_cp_attention = recording
    try:
        metrics = trainer.train_step(batch)
    finally:
        distributed_trainer.make_cp_attention = make_cp_attention
    batches.close()
    local = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeRO-1 wraps this rank's AdamW
    moments = sum(
        v.numel()
        for state in local.state.values()
        for k, v in state.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    return {
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "moments": moments,
        "metrics": metrics,
        "grads": grads[0],
        "loaded": len(share_of(dist.get_rank(), dist.get_world_size(), batch.num_clips)),
        "ran": len(batch.micro_batches),
        "lengths": batch.lengths,
        "plan": batch.plan.micro_batches,
        "built": built,
    }


class Killed(RuntimeError):
    pass


def _resume_case(root: str) -> dict:
    extra = {"parallel.mode": "dynamic", "train.max_steps": 3, "train.checkpoint_every": 2}
    train_distributed(load_config(CONFIG, overrides(f"{root}/whole", **extra)), dist.group.WORLD)

    cfg = load_config(CONFIG, overrides(f"{root}/killed", **extra))
    trainer = DistributedTrainer(cfg, dist.group.WORLD)
    finish = trainer.finish_step

    def dies_in_step_3(loss):  # after the step-2 checkpoint, before step 3's optimizer step
        if trainer.step == 2:
            raise Killed
        return finish(loss)

    trainer.finish_step = dies_in_step_3
    try:
        trainer.train()
    except Killed:
        pass
    dist.barrier()  # rank 0 has written everything it will write before anyone resumes
    train_distributed(cfg, dist.group.WORLD, resume=f"{root}/killed")
    return {}


def worker(rank: int, world_size: int, root: str) -> dict:
    try:
        results = {case: _one_step(case, f"{root}/{case}") for case in CASES}
        results["planted_scale"] = _one_step("dynamic", f"{root}/planted", plant_scale=1.0 / world_size)
        results["resume"] = _resume_case(root)
        return results
    except Exception:  # the spawn error shows only the last frame; keep the whole trace
        return {"error": traceback.format_exc()}


def reference_step(case: str, out: str) -> tuple[dict, dict, dict]:
    """Single-process ``Trainer.train_step`` on the same global batch: (params, metrics, gradients)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two cores shared with the spawned ranks: spinning threads cost 50x here
    try:
        return _reference_step(case, out)
    finally:
        torch.set_num_threads(threads)


def _reference_step(case: str, out: str) -> tuple[dict, dict, dict]:
    extra = {**CASES[case], "parallel.mode": "none", **_image_encoder(case, out)}
    cfg = load_config(CONFIG, overrides(out, **extra))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    perturb(trainer.model)
    grads = record_step_grads(trainer)
    indices = GlobalBatchSampler(trainer.train_indices, cfg.train.global_batch_size, cfg.data.seed).batch(0)
    clips = trainer.prepare([trainer.train_set[i] for i in indices], 0)
    metrics = trainer.train_step(clips)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, metrics, grads[0]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime")
    zero_latency = dataclasses.replace(
        Hardware.load("h100"), name="zero-latency", intra_node_latency_s=0.0, inter_node_latency_s=0.0
    )
    (root / PROFILE).write_text(zero_latency.to_yaml())
    save_small_clip(root / CLIP)
    out = run_gloo(worker, WORLD, str(root), timeout_s=240)
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return root, out


@pytest.mark.parametrize("case", list(CASES))
def test_step_equals_single_process(results, case, tmp_path):
    root, out = results
    (tmp_path / CLIP).symlink_to(root / CLIP)  # the i2v case's image encoder, beside the run
    ref, ref_metrics, ref_grads = reference_step(case, str(tmp_path / "ref"))
    res = out[0][case]
    if case != "uneven":
        assert max(res["lengths"]) > CAP, "the batch needs a clip longer than the cap to test CP >= 2"
    sizes = {len(ranks) for ranks, _ in res["plan"]}
    assert max(sizes) >= 2, f"no micro-batch ran under CP: {res['plan']}"
    if case == "static":
        assert sizes == {2}
    for r in range(WORLD):
        assert_grads_match(out[r][case]["grads"], ref_grads, REL_TOL, label=f"{case}, rank {r}")
        for key in ("loss", "grad_norm"):
            assert out[r][case]["metrics"][key] == pytest.approx(ref_metrics[key], rel=REL_TOL), key
    for name, p_ref in ref.items():
        for r in range(WORLD):
            err = relative_error(out[r][case]["params"][name], p_ref)
            assert err < REL_TOL, (
                f"{case}: rank {r} parameter {name} differs from single process by {err:.2e}"
            )
    for r in range(1, WORLD):
        for name, p in out[0][case]["params"].items():
            assert torch.equal(out[r][case]["params"][name], p), (
                f"{case}: rank {r} {name} diverged from rank 0"
            )


def test_planted_gradient_scale_fails_the_gradient_check(results, tmp_path):
    """Reduced gradients divided by the world size (a mean where the loss weights need a sum): the
    gradient comparison reports the 1/W ratio, while the weights after AdamW barely move."""
    _, out = results
    ref, ref_metrics, ref_grads = reference_step("dynamic", str(tmp_path / "ref"))
    planted = out[0]["planted_scale"]
    with pytest.raises(AssertionError, match=rf"\|grad\| / \|reference grad\| = {1 / WORLD:g}\b"):
        assert_grads_match(planted["grads"], ref_grads, REL_TOL)
    assert planted["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"] / WORLD, rel=1e-4)
    # Why weights alone were not enough: AdamW's first update is ~lr * sign(g) whatever the scale.
    worst = max(relative_error(planted["params"][n], p) for n, p in ref.items())
    assert worst < 1e-3, worst


def test_hybrid_step_runs_the_2d_layout(results):
    """The cost model's 2 x 2 split is what ran: in the log's histogram and on every rank of the
    CP-4 micro-batch, as Ulysses wrapping ring attention (the params check is the test above)."""
    _, out = results
    assert out[0]["hybrid"]["metrics"]["cp_layouts"].get("2x2", 0) >= 1, out[0]["hybrid"]["metrics"]
    for r in range(WORLD):
        assert ((2, 2), "UlyssesAttention", "RingAttention") in out[r]["hybrid"]["built"], out[r]["hybrid"][
            "built"
        ]
    for r in range(WORLD):  # and the 1-D layouts elsewhere are the plain classes
        for layout, outer, _ in out[r]["dynamic"]["built"]:
            assert (
                outer
                == {(1, 1): "PackedAttention", (1, 2): "RingAttention", (2, 1): "UlyssesAttention"}[layout]
            )


def test_uneven_batch_leaves_a_rank_without_data(results):
    _, out = results
    runs = [out[r]["uneven"] for r in range(WORLD)]
    assert 0 in [res["loaded"] for res in runs], "some rank must load no clip for this case to test it"
    # The timeline saw what each rank did: a rank that ran no micro-batch was idle the whole step.
    idle = runs[0]["metrics"]["idle_share"]
    assert len(idle) == WORLD
    for r, res in enumerate(runs):
        if res["ran"] == 0:
            assert idle[r] == 1.0, (r, idle, [x["ran"] for x in runs])
    assert min(idle) < 1.0, idle


def test_resume_after_kill_gives_same_losses(results):
    root, _ = results

    def losses(run: str) -> dict[int, float]:
        lines = [json.loads(x) for x in (root / run / "metrics.jsonl").read_text().splitlines()]
        return {rec["step"]: rec["loss"] for rec in lines if "loss" in rec}

    whole, resumed = losses("whole"), losses("killed")
    assert sorted(whole) == [1, 2, 3]
    assert resumed == whole  # bitwise: same plan, same data, same reduction order


def test_resumed_run_ends_with_the_same_weights_and_moments(results):
    """Step 3's update uses the AdamW moments restored from the step-2 checkpoint, which ZeRO-1
    gathered from every rank: the final weights catch any moment that was lost or misplaced."""
    from safetensors.torch import load_file

    root, _ = results
    final = {run: root / run / "checkpoints" / "step_000003" for run in ("whole", "killed")}
    a, b = (load_file(final[run] / "model" / "diffusion_pytorch_model.safetensors") for run in final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    saved = torch.load(root / "killed" / "checkpoints" / "step_000002" / "trainer.pt", weights_only=True)
    state = saved["optimizer"]["state"]  # a plain AdamW state dict: loads into any mode or world size
    assert len(state) == len(a) and all({"exp_avg", "exp_avg_sq"} <= set(v) for v in state.values())


def test_sharded_checkpoint_resumes_in_one_process(results, tmp_path):
    """A ZeRO-1 checkpoint is a plain AdamW state dict: single-process training resumes from it."""
    root, _ = results
    step_dir = root / "killed" / "checkpoints" / "step_000002"
    cfg = load_config(CONFIG, overrides(str(tmp_path / "one"), **{"parallel.mode": "none"}))
    trainer = Trainer(cfg, resume=str(step_dir), device=torch.device("cpu"))
    saved = torch.load(step_dir / "trainer.pt", weights_only=True)["optimizer"]["state"]
    live = [trainer.optimizer.state[p] for p in trainer.model.parameters()]
    assert trainer.step == 2 and len(live) == len(saved)
    for i, state in enumerate(live):
        assert torch.equal(state["exp_avg"], saved[i]["exp_avg"])


def test_optimizer_moments_are_sharded_over_the_ranks(results):
    _, out = results
    res = [out[r]["dynamic"] for r in range(WORLD)]
    total = sum(p.numel() for p in res[0]["params"].values())
    held = [r["moments"] for r in res]
    assert sum(held) == 2 * total  # exp_avg and exp_avg_sq of every parameter, each on one rank
    assert max(held) < total  # no rank holds the full set (replicated AdamW would hold 2 x total)


def test_step_logs_plan_and_timeline(results):
    root, _ = results
    rec = [json.loads(x) for x in (root / "whole" / "metrics.jsonl").read_text().splitlines()][1]
    for key in (
        "cp_hist",
        "cp_layouts",
        "num_micro_batches",
        "predicted_s",
        "compute_s",
        "step_s",
        "idle_share",
    ):
        assert key in rec, f"metrics line lacks {key}: {rec}"
    assert sum(rec["cp_hist"].values()) == rec["num_micro_batches"]
    # compute_s is the step's compute window, inside the whole step (which also loads and routes);
    # some rank was busy for part of it.
    assert 0.0 < rec["compute_s"] <= rec["step_s"], rec
    assert min(rec["idle_share"]) < 1.0, rec
