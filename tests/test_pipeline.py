"""Pipeline stages (``parallel.pp_size``) under Dynamic-CP equal one process.

Three spawns, each against the same single-process reference over 3 steps on uneven mixed clips
(1- and 5-frame clips at two sizes; with ``cap_tokens=96`` a 5-frame 32x16 clip, 160 tokens, needs
CP 2): PP 2 x 2 ranks (W=4) for dynamic and static CP with replicated weights and FSDP ``per_step``
inside the stages, 1F1B; PP 2 x 3 ranks (W=6) dynamic, 1F1B; PP 3 x 1 (W=3, one rank a stage, every
clip on one rank) under 1F1B and GPipe. Each step's loss and gradient norm and every final weight
(gathered from the stages, each of which holds its blocks under their global names) must match.

Bounds: a pipeline changes no arithmetic inside a micro-batch (the same blocks run on the same rows;
the stage boundary only moves tensors), so what differs from one process is what the plain
multi-process runtime differs by: how the plan packs clips into micro-batches and over ranks, i.e.
the order of fp32 sums, plus the gradient norm summed as stage squares (a reordered sum too). The
bounds are the reordered-sum bounds derived in tests/test_default_path_worlds.py (``LOSS_REL``,
``GRAD_NORM_REL``, and the weight bound beside its final comparison), for this data's step tokens.

Planted and seen to fail (docs/runtime.md lists them): a stage boundary one block off (stage 0 runs
blocks 0..1 of [0, 2) plus block 2); stage 1 running its micro-batches in reverse order; the
gradient of the text context not sent back (zeros sent instead).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file

from dit.config import load_config, to_dict
from dynamic_cp.runtime.launch import trainer_class
from dynamic_cp.runtime.testing import run_gloo
from tests.test_fsdp import CONFIG, LR, PerturbedTrainer, U, one_process_run, perturb

pytestmark = pytest.mark.timeout(900)
STEPS = 3
ITEMS = {
    "model.overrides": "{num_layers: 3, patch_size: [1, 4, 4], num_attention_heads: 2, "
    "attention_head_dim: 12, ffn_dim: 40, text_dim: 20, freq_dim: 16}",
    "data.num_clips": 64,
    "data.num_val_clips": 1,
    "data.frame_counts": "[1, 5]",
    "data.resolutions": "[[16, 16], [32, 16]]",
    "flow.val_sigmas": "[0.5]",
    "train.global_batch_size": 5,
    "train.micro_batch_tokens": 200,
    "train.warmup_steps": 1,
    "train.log_every": 1,
    "train.val_every": 100,
    "parallel.mode": "dynamic",
    "parallel.cap_tokens": 96,
    "parallel.plan_ahead": False,
    "parallel.hardware": "h100",
    "parallel.learn_costs": False,
}
# name -> config items of each case; one spawn per world size runs its cases in turn
CASES = {
    4: {
        "dynamic": {"parallel.pp_size": 2},
        "static": {"parallel.pp_size": 2, "parallel.mode": "static", "parallel.static_cp_size": 2},
        "fsdp_per_step": {"parallel.pp_size": 2, "parallel.fsdp": "per_step"},
    },
    6: {"dynamic": {"parallel.pp_size": 2}},
    # one rank a stage: no clip can take CP 2, so the cap must hold the longest clip
    3: {
        "1f1b": {"parallel.pp_size": 3, "parallel.cap_tokens": 200},
        "gpipe": {"parallel.pp_size": 3, "parallel.cap_tokens": 200, "parallel.pp_schedule": "gpipe"},
    },
}
# The longest reordered sum has at most STEP_TOKENS terms: 5 clips of at most 5 frames x 8 x 4 patches.
STEP_TOKENS = 5 * 160
ETA = STEP_TOKENS * U
LOSS_REL = STEP_TOKENS * 48 * U  # a mean of non-negative squared errors: no cancellation
GRAD_NORM_REL = ETA
DECAY = load_config(CONFIG, []).train.ema_decay


def assert_weights_close(got: dict, ref: dict, where: str) -> None:
    """Every weight of ``ref`` (one process after STEPS steps) in ``got`` (gathered from the stages)."""
    assert got.keys() == ref.keys(), f"{where}: the stages hold other weights than the model"
    for name, p in ref.items():
        # test_default_path_worlds' bound: 2 ETA x lr a step through AdamW, plus 4 u |w| a step
        torch.testing.assert_close(
            got[name],
            p,
            atol=2 * ETA * STEPS * LR,
            rtol=4 * U * STEPS,
            msg=lambda m, name=name: f"{where}: {name}: {m}",
        )


def overrides(out: str, **extra) -> list[str]:
    return [f"{k}={v}" for k, v in {"output_dir": out, **ITEMS, **extra}.items()]


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def _timeline_faults(records: list, finished: list) -> list[str]:
    """A rank's recorded micro-batches on its stage (ready, end, comm) against its compute window: each
    ends after it was ready and spent between 0 and its busy seconds in CP collectives (forward's and
    backward's added), and they never overlap, so their busy seconds add up to at most the window."""
    faults = [
        f"micro-batch {m}: ready {ready}, end {end}, comm {comm}"
        for m, ready, end, comm in records
        if not (end > ready and 0.0 <= comm <= end - ready)
    ]
    busy = sum(end - ready for _, ready, end, _ in records)
    if busy > finished[-1] + 1e-6:
        faults.append(f"busy {busy:.6f} s in a {finished[-1]:.6f} s window")
    return faults


def _run(items: dict, out: str) -> dict:
    from dynamic_cp.runtime.pipeline import PipelineTimeline

    cfg = load_config(CONFIG, overrides(out, **items))
    base = trainer_class(cfg, dist.group.WORLD)

    class Perturbed(base):
        def _shard_model(self) -> None:
            perturb(self.model)  # the whole model, before the stage keeps its part: the reference's weights
            super()._shard_model()

    trainer = Perturbed(cfg, dist.group.WORLD)
    val = trainer.validation_loss()  # through the stages (PipelineEval): the loss reaches stage 0
    batches = trainer.data_iterator()
    steps, cp, warmups, faults = [], set(), [], []
    record, finish = PipelineTimeline.record, PipelineTimeline.finish
    for _ in range(STEPS):
        records, finished = [], []
        PipelineTimeline.record = lambda t, m, ready, end, comm=0.0, records=records: (
            records.append((m, ready, end, comm)) or record(t, m, ready, end, comm)
        )
        PipelineTimeline.finish = lambda t, end, finished=finished: finished.append(end) or finish(t, end)
        batch = next(batches)
        cp |= {len(ranks) for ranks, _ in batch.plan.micro_batches}
        warmups.append(batch.plan.pp_warmup)
        try:
            metrics = trainer.train_step(batch)
        finally:
            PipelineTimeline.record, PipelineTimeline.finish = record, finish
        faults += _timeline_faults(records, finished)
        trainer.step += 1
        steps.append({k: metrics[k] for k in ("loss", "grad_norm")})
    batches.close()
    params = {n: _full(p) for n, p in trainer.model.named_parameters()}  # collective under FSDP
    keep = trainer.plan_rank == 0
    return {
        "steps": steps,
        "params": params if keep else {},
        "cp": sorted(cp),
        "warmups": warmups,
        "stage": trainer.pipeline.stage,
        "val": val,
        "timeline_faults": faults,
    }


def worker(rank: int, world_size: int, root: str) -> dict:
    try:
        return {name: _run(items, f"{root}/{name}") for name, items in CASES[world_size].items()}
    except Exception:  # the spawn error shows only the last frame; keep the whole trace
        return {"error": traceback.format_exc()}


def _reference(out: str) -> tuple[list[dict], dict, float]:
    cfg = load_config(CONFIG, overrides(out, **{"parallel.mode": "none"}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        val = PerturbedTrainer(cfg, device=torch.device("cpu")).validation_loss()  # at step 0
    finally:
        torch.set_num_threads(threads)
    return (*one_process_run(cfg, STEPS), val)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(str(tmp_path_factory.mktemp("one")))


@pytest.mark.parametrize("world_size", [4, 6, 3])
def test_pipeline_equals_one_process(world_size, reference, tmp_path):
    out = run_gloo(worker, world_size, str(tmp_path), timeout_s=180)
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    ref_steps, ref_params, ref_val = reference
    for name in CASES[world_size]:
        where = f"W={world_size} {name}"
        if world_size > 3:
            assert 2 in out[0][name]["cp"], f"{where}: no micro-batch ran on CP 2: {out[0][name]['cp']}"
        if world_size == 4 and name == "dynamic":
            # plan_for_pipeline gives these batches 1F1B warm-ups [2, 1, 2] (their micro-batches are
            # far under the cap): the deeper schedule is the one held to one process here
            assert 2 in out[0][name]["warmups"], f"{where}: warm-ups {out[0][name]['warmups']}"
        params = {}
        for res in out:
            assert res[name]["timeline_faults"] == [], f"{where}: {res[name]['timeline_faults']}"
            assert res[name]["steps"] == out[0][name]["steps"], f"{where}: ranks logged different steps"
            params.update(res[name]["params"])
        assert sorted({res[name]["stage"] for res in out}) == list(
            range(CASES[world_size][name]["parallel.pp_size"])
        )
        for s, (got, ref) in enumerate(zip(out[0][name]["steps"], ref_steps)):
            assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_REL), f"{where} step {s + 1} loss"
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_REL), (
                f"{where} step {s + 1}"
            )
        assert_weights_close(params, ref_params, where)
        # the step-0 validation loss on rank 0 (stage 0), run stage by stage: the one process's within
        # the loss bound (the same sums, only blocked in other orders)
        assert out[0][name]["val"] == pytest.approx(ref_val, rel=LOSS_REL), f"{where} validation loss"


# ----------------------------------------------------------------------------- checkpoints
# Two steps at PP 2 x 2 (W=4) write a stage checkpoint at step 2; step 3 resumes it at PP 3 x 1 (W=3),
# without a pipeline (W=2, pp_size 1) and at PP 2 x 2 with FSDP per_step stages: each ends with the
# single-process weights of 3 steps, within the same bound (only the order of fp32 sums differs).
# The step-0 validation runs through the stages (PipelineEval) and must be finite on rank 0.


def _train(rank: int, world_size: int, out: str, items: dict, resume: str | None) -> dict:
    try:
        base = trainer_class(load_config(CONFIG, overrides(out, **items)), dist.group.WORLD)

        class Perturbed(base):
            def _shard_model(self) -> None:
                # also when resuming: the checkpoint replaces what it holds (all but a LoRA's frozen base)
                perturb(self.model)
                super()._shard_model()

        cfg = load_config(CONFIG, overrides(out, **items))
        trainer = Perturbed(cfg, dist.group.WORLD, resume=resume)
        saved, save = [], trainer.save
        trainer.save = lambda: saved.append(save()) or saved[-1]  # what each save returned
        trainer.train()
        params = {n: _full(p) for n, p in trainer.model.named_parameters()}
        ema = _ema_of(trainer.ema)  # collective under FSDP
        keep = trainer.plan_rank == 0
        return {"params": params if keep else {}, "ema": ema if keep else {}, "step": trainer.step,
                "saved": [None if p is None else str(p) for p in saved]}  # fmt: skip
    except Exception:
        return {"error": traceback.format_exc()}


def _ema_of(ema) -> dict[str, torch.Tensor]:
    """The averaged parameters of this rank's model, whole: LoRA's AdapterEMA, FSDP's ShardedEMA
    (gathered), or the EMA model's."""
    if hasattr(ema, "state"):
        return {n: t.clone() for n, t in ema.state.items()}
    if hasattr(ema, "params"):
        return {n: _full(t) for n, t in ema.params.items()}
    return {n: p.detach().clone() for n, p in ema.model.named_parameters()}


def _params_of(res: list[dict], step: int = STEPS, ema: bool = False) -> dict:
    """The whole model's weights (or EMA) from the ranks of a finished run (each plan rank 0 sends its
    stage's). Every save returned its step directory on rank 0 and None on the others."""
    assert all("error" not in r for r in res), [r.get("error") for r in res]
    assert res[0]["saved"] and None not in res[0]["saved"], "rank 0's save returned no step directory"
    assert all(p is None for r in res[1:] for p in r["saved"]), "a rank but 0 returned a checkpoint"
    params = {}
    for r in res:
        assert r["step"] == step
        params.update(r["ema" if ema else "params"])
    return params


def assert_ema_resumed(res: list[dict], step_dir: Path) -> None:
    """One step after resuming ``step_dir``, the EMA is one lerp from the checkpoint's average toward
    the final weights. Bound: lerp(a, b, w) = a + w (b - a) rounds three times, each by at most u of
    max(|a|, |b|); an EMA restarted at the weights instead sits ~lr (1e-3) away."""
    saved = {}
    if (step_dir / "stages").is_dir():
        for folder in sorted((step_dir / "stages").iterdir()):
            saved.update(load_file(str(folder / "ema.safetensors")))
    else:  # a replicated checkpoint's EMA
        saved = load_file(str(step_dir / "ema" / "diffusion_pytorch_model.safetensors"))
    params, ema = _params_of(res), _params_of(res, ema=True)
    assert ema and ema.keys() <= saved.keys()
    for name, got in ema.items():
        a, b = saved[name], params[name]
        bound = 4 * U * torch.maximum(a.abs(), b.abs())
        assert ((got - torch.lerp(a, b, 1 - DECAY)).abs() <= bound).all(), f"EMA {name} not resumed"


def test_stage_checkpoint_resumes_at_other_pp_sizes(reference, tmp_path):
    first = {"parallel.pp_size": 2, "train.max_steps": 2, "train.checkpoint_every": 2}
    out = run_gloo(_train, 4, str(tmp_path / "pp2"), first, None, timeout_s=180)
    assert all("error" not in r for r in out), [r.get("error") for r in out]
    step_dir = tmp_path / "pp2" / "checkpoints" / "step_000002"
    assert sorted(p.name for p in (step_dir / "stages").iterdir()) == ["stage_0", "stage_1"]
    cfg = to_dict(load_config(CONFIG, overrides(str(tmp_path / "pp2"), **first)))
    assert yaml.safe_load((step_dir / "config.yaml").read_text()) == cfg
    assert list(yaml.safe_load((step_dir / "config.yaml").read_text())) == list(cfg), "not the config's order"
    _, ref_params, _ = reference
    for world_size, pp, fsdp in ((2, 1, "none"), (3, 3, "none"), (4, 2, "per_step")):
        then = {"parallel.pp_size": pp, "train.max_steps": 3, "parallel.cap_tokens": 200 if pp == 3 else 96}
        then["parallel.fsdp"] = fsdp
        res = run_gloo(
            _train, world_size, str(tmp_path / f"to{pp}_{fsdp}"), then, str(step_dir), timeout_s=180
        )
        assert_weights_close(_params_of(res), ref_params, f"resumed at pp_size={pp}, fsdp={fsdp}")
        assert_ema_resumed(res, step_dir)
    # one process (parallel.mode=none: train.py's Trainer, no process group) reads the stage files too
    res = [_train_one_process(str(tmp_path / "to_one"), str(step_dir))]
    assert_weights_close(_params_of(res), ref_params, "resumed in one process")
    assert_ema_resumed(res, step_dir)


def test_one_process_checkpoint_resumes_under_stages(reference, tmp_path):
    """A one-process (replicated files) checkpoint of step 2 resumed at PP 2 x 2: each stage reads its
    blocks' weights, EMA and AdamW moments by name (the moments named by the whole model's parameter
    order) and ends at the single-process weights of 3 steps, its EMA one lerp on. Planted: the moments
    named in reverse parameter order -> the weights leave the bound."""
    _train_one_process(str(tmp_path / "one"), None, steps=2)
    step_dir = tmp_path / "one" / "checkpoints" / "step_000002"
    res = run_gloo(
        _train, 4, str(tmp_path / "pp"), {"parallel.pp_size": 2, "train.max_steps": 3}, str(step_dir)
    )
    _, ref_params, _ = reference
    assert_weights_close(_params_of(res), ref_params, "one-process checkpoint resumed at PP 2 x 2")
    assert_ema_resumed(res, step_dir)


def _train_one_process(out: str, resume: str | None, steps: int = STEPS) -> dict:
    """``_train``'s result for one process training to ``steps``, from ``resume`` or from the perturbed
    init (a checkpoint replaces every weight), saving every 2 steps."""
    one = {"parallel.mode": "none", "parallel.pp_size": 1, "parallel.fsdp": "none", "train.max_steps": steps,
           "train.checkpoint_every": 2}  # fmt: skip
    trainer = PerturbedTrainer(load_config(CONFIG, overrides(out, **one)), resume=resume)
    saved, save = [], trainer.save
    trainer.save = lambda: saved.append(save()) or saved[-1]
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {
        "params": params,
        "ema": _ema_of(trainer.ema),
        "step": trainer.step,
        "saved": [str(p) for p in saved],
    }


def test_fsdp_stage_checkpoint_resumes_bitwise_and_unsharded(reference, tmp_path):
    """PP 2 x 2 (W=4) with FSDP per_step stages: a run stopped at its step-2 checkpoint (every tensor
    gathered whole to its stage's plan rank 0), resumed at the same layout, ends bit for bit where an
    uninterrupted 3-step run does (the same plans and sums, the shards loaded back exactly: the
    bitwise check of tests/test_fsdp.py's resume); resumed with replicated weights and no pipeline
    (W=2, pp_size 1) it ends at the single-process weights within the bound above."""
    fsdp = {"parallel.pp_size": 2, "parallel.fsdp": "per_step", "train.checkpoint_every": 2}
    whole = run_gloo(_train, 4, str(tmp_path / "whole"), {**fsdp, "train.max_steps": 3}, None)
    stopped = run_gloo(_train, 4, str(tmp_path / "stopped"), {**fsdp, "train.max_steps": 2}, None)
    step_dir = tmp_path / "stopped" / "checkpoints" / "step_000002"
    _params_of(stopped, 2)
    assert stopped[0]["saved"] == [str(step_dir)]
    assert sorted(p.name for p in (step_dir / "stages").iterdir()) == ["stage_0", "stage_1"]
    res = run_gloo(_train, 4, str(tmp_path / "resumed"), {**fsdp, "train.max_steps": 3}, str(step_dir))
    for ema in (False, True):
        got, want = _params_of(res, ema=ema), _params_of(whole, ema=ema)
        assert got.keys() == want.keys()
        for name, p in want.items():
            assert torch.equal(got[name], p), f"FSDP stages resumed at step 2: {name} (ema={ema}) differs"
    flat = {"parallel.pp_size": 1, "parallel.fsdp": "none", "train.max_steps": 3}
    unsharded = run_gloo(_train, 2, str(tmp_path / "flat"), flat, str(step_dir))
    _, ref_params, _ = reference
    assert_weights_close(_params_of(whole), ref_params, "FSDP stages, uninterrupted")
    assert_weights_close(_params_of(unsharded), ref_params, "FSDP stages resumed at pp_size=1, replicated")
    assert_ema_resumed(unsharded, step_dir)


def test_stage_checkpoint_of_another_model_is_refused_in_one_line(tmp_path):
    """A resume names the first tensor the stage files lack and how many more, and refuses a folder
    that holds no stages; no process is spawned."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from dit.model import VideoDiT
    from dynamic_cp.runtime.pipeline_checkpoint import resume_pipeline_checkpoint

    model = VideoDiT(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        text_dim=20, freq_dim=16, ffn_dim=40, num_layers=2,
    )  # fmt: skip
    trainer = SimpleNamespace(model=model, lora=False, ema=None)
    with pytest.raises(
        ValueError, match="written without pipeline stages; resume it with parallel.pp_size=1"
    ):
        resume_pipeline_checkpoint(trainer, tmp_path)
    (tmp_path / "stages" / "stage_0").mkdir(parents=True)
    held = {n: t for n, t in model.state_dict().items() if not n.startswith("blocks.1.")}
    save_file(held, str(tmp_path / "stages" / "stage_0" / "model.safetensors"))
    missing = sorted(set(model.state_dict()) - set(held))
    assert len(missing) > 2
    with pytest.raises(ValueError, match=rf"holds no {missing[0]} \(and {len(missing) - 1} more\)"):
        resume_pipeline_checkpoint(trainer, tmp_path)


@pytest.mark.parametrize("per_token", [False, True])
def test_carried_shapes_are_what_embed_makes(per_token):
    """A receiver's buffers (``carried_shapes``, from the frame alone) have the shapes stage 0 sends:
    per-clip and per-token (TI2V) timesteps, an image-conditioned (I2V) model's image context, an
    empty shard; no process is spawned."""
    from dit.model import VideoDiT
    from dit.stages import CARRIED, carried_shapes

    model = VideoDiT(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        text_dim=20,
        freq_dim=16,
        ffn_dim=40,
        num_layers=1,
        image_dim=8,
        added_kv_proj_dim=24,
    )
    for n in (0, 7):
        seq_lens = torch.tensor([n - n // 2, n // 2])
        tokens, positions = torch.randn(n, 16), torch.zeros(n, 3, dtype=torch.long)
        text, text_lens = torch.randn(5, 20), torch.tensor([2, 3])
        extra = {"image": torch.randn(2, 3, 8)}
        if per_token:  # three distinct values over the tokens held here
            extra["token_timesteps"] = torch.tensor([0.0, 500.0, 900.0] * 3)[:n]
        x, inputs = model.embed(
            tokens, positions, seq_lens, torch.tensor([500.0, 900.0]), text, text_lens, **extra
        )
        frame, _ = model.frame(positions, seq_lens, torch.tensor([500.0, 900.0]), text_lens, **extra)
        got = dict(carried_shapes(model, frame, n))
        want = {"x": tuple(x.shape), **{k: tuple(getattr(inputs, k).shape) for k in CARRIED}}
        if per_token and n == 0:  # no token: no modulation row is read (u = 0 rows)
            want["modulation"], want["temb"] = (0, 6, 24), (0, 24)
        assert got == want, (n, per_token)


def test_stage_schedule_runs_the_plans_warm_up():
    """The runtime's op list is the one the simulator replays: the schedule at the plan's 1F1B
    warm-up (``Plan.pp_warmup``, chosen by the planner); no process is spawned."""
    from types import SimpleNamespace

    from dynamic_cp.planning.pipeline_schedule import stage_ops
    from dynamic_cp.planning.plan_types import Plan
    from dynamic_cp.runtime.pipeline import stage_schedule

    plan = Plan([((0,), [m]) for m in range(6)], 1, 1e9, pp_warmup=2)
    for stage in range(3):
        pipe = SimpleNamespace(pp_size=3, stage=stage, schedule="1f1b")
        assert stage_schedule(pipe, plan) == stage_ops(6, 3, stage, "1f1b", 2)
    assert stage_schedule(SimpleNamespace(pp_size=3, stage=0, schedule="1f1b"), plan)[:5] == [
        ("F", m) for m in range(5)
    ]  # 4 warm-up forwards, then F(4) before B(0)
    gpipe = SimpleNamespace(pp_size=3, stage=1, schedule="gpipe")
    assert stage_schedule(gpipe, plan) == stage_ops(6, 3, 1, "gpipe")
