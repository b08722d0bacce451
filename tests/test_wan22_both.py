"""``model.expert: both`` (Wan2.2 A14B's two experts in one run) equals one process, and routes right.

Distributed parity (and, at W=2, the sharded checkpoint of both experts and both optimizers
read back bit for bit): on 2 and 4 gloo ranks, Dynamic-CP with replicated weights (the ZeRO-1 default, one
ZeRO optimizer per expert) and FSDP2 (per_step at W=2, per_layer at W=4, each expert sharded on its
own) run 3
steps of the two-expert model of tests/test_fsdp.py; every step's loss and gradient norm and BOTH
experts' final weights must match single-process training on the same global batches within 1e-5
relative (REL_TOL of test_fsdp.py, derived there and below). The batches mix the experts and hold
steps where one expert runs no micro-batch (``IDLE``: checked, so the idle path is exercised).

One process: every micro-batch runs the expert on whose side of the pipeline's switch its clips'
timesteps fall (the forward of the expert that ran is recorded), the draw gives each expert its
share of the shifted distribution, and an expert with no micro-batch in a step keeps its weights,
AdamW state, LR schedule and EMA.

Planted and caught (each run, failing, then restored):
- routing to the wrong expert (``ExpertPair.expert_at`` returning the other one):
  test_each_micro_batch_runs_the_expert_of_its_timesteps fails (the low expert ran t = 960);
- stepping the idle expert (``ExpertOptimizers.step`` setting ``active`` to both experts):
  test_an_idle_expert_does_not_move fails (the idle expert's EMA moved; its LR schedule advanced);
- the gradient reduction handing zeros instead of None to parameters no rank used
  (``step_strategies.sum_gradients``): the idle expert's AdamW steps on its momentum and the
  replicated parity tests fail at W=2 and W=4;
- the planner ignoring the experts (``plan_per_expert`` treating every clip as high): the W=2 test
  fails;
- the sharded checkpoint holding the high expert's optimizer only (``FSDPTrainer._optimizers``
  returning one): the W=2 test's read-back of the low expert's AdamW moments fails.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_overrides
from test_fsdp import CONFIG, STEPS, PerturbedFSDP, _rel, overrides, perturb

from dit.batching import GlobalBatchSampler
from dit.config import load_config
from dit.trainer import Trainer
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.testing import run_gloo

pytestmark = pytest.mark.timeout(600)
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
BOTH = {"model.expert": "both", "model.boundary_ratio": 0.875, "flow.shift": 5.0, "train.ema_decay": 0.9}
# Per world size: batches whose experts are mixed in some steps and single in others (IDLE lists the
# steps, 1-based, where one expert runs nothing), with uneven micro-batch counts per rank.
DATA = {
    2: {"train.global_batch_size": 3, "data.seed": 1},
    4: {"train.global_batch_size": 3, "data.seed": 3},  # a rank without clips in every step
}
# Loss, gradient norm and weights within 1e-5 relative. What differs from one process is only the order
# of fp32 sums: the plan packs a step's clips into other micro-batches and shards them over CP groups,
# so each gradient element sums its per-token terms and the rank partials in another order. A
# reordered fp32 sum of n terms moves by about sqrt(n) u of its terms' magnitudes (u = 2^-24 = 6e-8;
# at most n u): n <= 480 tokens per step (3 clips of <= 160) gives 1.3e-6 typically, 3e-5 at worst
# for a single element; the Frobenius norm of a whole tensor averages the elements' errors, so 1e-5
# leaves a factor 7 over the typical value, on AVX2 and AVX-512 alike. The weights after 3 AdamW
# steps differ by lr x (the updates' relative error) <= 1e-3 x 1e-5, far below. A wrong expert, a
# stepped idle expert or a lost gradient moves something by 1e-3 relative or more.
REL_TOL = 1e-5
# replicated Dynamic-CP at both sizes, and one FSDP schedule at each (the suite's time budget)
MODES = {2: ("none", "per_step"), 4: ("none", "per_layer")}


def _config(out: str, world_size: int, **extra):
    return load_config(CONFIG, overrides(out, **{**BOTH, **DATA[world_size], **extra}))


class PerturbedDistributed(DistributedTrainer):
    def _shard_model(self) -> None:
        perturb(self.model)


class PerturbedTrainer(Trainer):
    def _shard_model(self) -> None:
        perturb(self.model)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def steps_of(trainer) -> dict:
    """STEPS steps (collective): each step's loss, gradient norm and experts run; the final weights."""
    batches = trainer.data_iterator()
    steps = []
    for _ in range(STEPS):
        batch = next(batches)
        metrics = trainer.train_step(batch)
        trainer.step += 1
        steps.append({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                      "experts": sorted(set(batch.plan.info["experts"]))})  # fmt: skip
    batches.close()
    return {"steps": steps, "params": {n: _full(p) for n, p in trainer.model.named_parameters()}}


def worker(rank: int, world_size: int, root: str) -> dict:
    try:
        out = {}
        for mode in MODES[world_size]:
            cfg = _config(f"{root}/{mode}", world_size, **{"parallel.fsdp": mode})
            trainer = (PerturbedFSDP if mode != "none" else PerturbedDistributed)(cfg, dist.group.WORLD)
            out[mode] = steps_of(trainer)
        if world_size == 2:  # per_step's sharded checkpoint of both experts and optimizers, read back
            trainer.save()
            resumed = PerturbedFSDP(cfg, dist.group.WORLD, resume=f"{root}/{mode}/checkpoints")
            out["resumed"] = {
                "step": resumed.step,
                "params": {n: _full(p) for n, p in resumed.model.named_parameters()},
                # every expert's moments, as many as before (an expert's state left out loads as none)
                "moments_equal": all(
                    len(resumed.optimizer.parts[name].state) == len(trainer.optimizer.parts[name].state) > 0
                    and all(
                        torch.equal(a["exp_avg"].to_local(), b["exp_avg"].to_local())
                        for a, b in zip(
                            trainer.optimizer.parts[name].state.values(),
                            resumed.optimizer.parts[name].state.values(),
                        )
                    )
                    for name in ("high", "low")
                ),
                "folders": sorted(
                    p.name for p in Path(f"{root}/{mode}/checkpoints/step_000003/model").iterdir()
                ),
            }
        return out if rank == 0 else {}
    except Exception:
        return {"error": traceback.format_exc()}


def reference(root: Path, world_size: int) -> dict:
    """Single-process steps on the same global batches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # cores shared with spawned ranks
    try:
        cfg = _config(str(root / "ref"), world_size, **{"parallel.mode": "none", "parallel.fsdp": "none"})
        trainer = PerturbedTrainer(cfg, device=torch.device("cpu"))
        sampler = GlobalBatchSampler(trainer.train_indices, cfg.train.global_batch_size, cfg.data.seed)
        steps = []
        for s in range(STEPS):
            clips = trainer.prepare([trainer.train_set[i] for i in sampler.batch(s)], s)
            steps.append(trainer.train_step(clips))
        return {
            "steps": steps,
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        }
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world_size", [2, 4])
def test_both_experts_on_gloo_ranks_equal_one_process(tmp_path, world_size):
    res = run_gloo(worker, world_size, str(tmp_path), timeout_s=300)
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}:\n{out['error']}"
    ref = reference(tmp_path, world_size)
    for mode in MODES[world_size]:
        got = res[0][mode]
        label = f"W={world_size} fsdp={mode}"
        # the batches exercise both experts, and a step where one of them is idle
        assert {e for s in got["steps"] for e in s["experts"]} == {"high", "low"}, label
        assert any(len(s["experts"]) == 1 for s in got["steps"]), f"{label}: no step leaves an expert idle"
        for s, (step, want) in enumerate(zip(got["steps"], ref["steps"])):
            assert step["loss"] == pytest.approx(want["loss"], rel=REL_TOL), f"{label} step {s + 1} loss"
            assert step["grad_norm"] == pytest.approx(want["grad_norm"], rel=REL_TOL), (
                f"{label} step {s + 1} grad norm"
            )
        assert got["params"].keys() == ref["params"].keys()
        assert any(n.startswith("low.") for n in ref["params"]) and any(
            n.startswith("high.") for n in ref["params"]
        )
        for name, want in ref["params"].items():
            err = _rel(got["params"][name], want)
            assert err < REL_TOL, f"{label}: {name} differs from one process by {err:.2e}"
    if world_size == 2:  # per_step's checkpoint: both experts' shards and AdamW moments, bit for bit
        back = res[0]["resumed"]
        assert back["step"] == STEPS and back["moments_equal"]
        assert all(torch.equal(back["params"][n], p) for n, p in res[0]["per_step"]["params"].items())
        assert back["folders"] == ["model_index.json", "transformer", "transformer_2"]


# ----------------------------------------------------------------------------- one process


def _trainer(tmp_path, *extra) -> Trainer:
    # no warm-up: step 1 moves the weights off their EMA, so an EMA update of an idle expert would show
    items = {**BOTH, "train.global_batch_size": 6, "train.micro_batch_tokens": 16, "train.warmup_steps": 0}
    cfg = load_config(TINY, [*tiny_overrides(tmp_path, **items), *extra])
    return Trainer(cfg, device=torch.device("cpu"))


def test_each_micro_batch_runs_the_expert_of_its_timesteps(tmp_path):
    from dit.flow import model_timesteps, on_expert_side

    t = _trainer(tmp_path, "train.global_batch_size=8", "train.micro_batch_tokens=32")
    ran = []  # (expert module that ran, timesteps it was given)
    for name in ("high", "low"):
        getattr(t.model, name).register_forward_pre_hook(
            lambda mod, args, name=name: ran.append((name, args[3].clone())), with_kwargs=False
        )
    t.train_step(t.prepare(next(t.data_iterator()), 0))
    assert {name for name, _ in ran} == {"high", "low"}
    for name, timesteps in ran:
        side = on_expert_side(model_timesteps(timesteps / 1000), name, 0.875)  # the pipeline's test
        assert bool(side.all()), f"the {name} expert ran timesteps {timesteps.tolist()}"


def test_the_draw_gives_each_expert_its_share(tmp_path):
    """The expert draw's frequency equals the shifted distribution's mass above the switch."""
    from dit.flow import draw_expert, sample_sigmas, shift_sigmas

    n = 4000
    drawn = sum(draw_expert(0, 7, i, "logit_normal", 0.0, 1.0, 5.0, 0.875) == "high" for i in range(n)) / n
    g = torch.Generator().manual_seed(0)
    share = float((shift_sigmas(sample_sigmas(200_000, g), 5.0) >= 0.875).double().mean())
    assert abs(drawn - share) < 4 * (share * (1 - share) / n) ** 0.5  # 4 standard errors of the draw


def test_an_idle_expert_does_not_move(tmp_path):
    t = _trainer(tmp_path)
    batches = t.data_iterator()
    t.train_step(t.prepare(next(batches), 0))  # both experts run (checked): the EMA leaves the weights
    assert t.optimizer.active == ("high", "low")
    clips = [c for c in t.prepare(next(batches), 1) if c.sigma >= 0.875]  # the high expert's only
    assert clips
    before = {
        "weights": {n: p.detach().clone() for n, p in t.model.low.named_parameters()},
        "ema": {n: p.clone() for n, p in t.ema.model.low.named_parameters()},
        "lr": t.lr_schedule.parts["low"].state_dict(),
        "adam_steps": [float(s["step"]) for s in t.optimizer.parts["low"].state.values()],
    }
    high = {n: p.detach().clone() for n, p in t.model.high.named_parameters()}
    t.train_step(clips)
    for n, p in t.model.low.named_parameters():
        assert torch.equal(p, before["weights"][n]), f"idle low expert's {n} moved"
    for n, p in t.ema.model.low.named_parameters():
        assert torch.equal(p, before["ema"][n]), f"idle low expert's EMA of {n} moved"
    assert t.lr_schedule.parts["low"].state_dict() == before["lr"], "idle low expert's LR schedule advanced"
    assert [float(s["step"]) for s in t.optimizer.parts["low"].state.values()] == before["adam_steps"]
    assert any(not torch.equal(p, high[n]) for n, p in t.model.high.named_parameters())  # high did step
    assert t.optimizer.active == ("high",)


# ----------------------------------------------------------------------------- LoRA, checkpoints, bad input


def _a14b_folder(root: Path) -> Path:
    """A small random two-expert Wan2.2 pipeline folder (diffusers' transformers, model_index.json)."""
    import json

    from test_lora import make_wan

    make_wan(1).save_pretrained(root / "transformer")
    make_wan(2).save_pretrained(root / "transformer_2")
    index = {"_class_name": "WanPipeline", "boundary_ratio": 0.875, "transformer_2": ["diffusers", "X"]}
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_both_lora_files_load_into_the_two_expert_pipeline(tmp_path):
    """One diffusers LoRA file per expert: transformer/ into ``transformer``, transformer_2/ with
    ``load_into_transformer_2=True``: no missing or unexpected keys, each expert's trained adapters on
    its own transformer. Planted: both files written from the high expert -> the low one's values differ."""
    from diffusers import WanPipeline
    from test_lora import lora_overrides, make_wan
    from test_wan22_lora import load_logging

    root = _a14b_folder(tmp_path / "a14b")
    items = {"model.pretrained": str(root), "model.expert": "both", "flow.shift": 5.0, "train.max_steps": 2, "train.warmup_steps": 0,
             "train.checkpoint_every": 100, "train.global_batch_size": 4, "train.sample_every": 0}  # fmt: skip
    trainer = Trainer(load_config(TINY, lora_overrides(tmp_path, "run", **items)), device=torch.device("cpu"))
    trainer.train()
    high, low = make_wan(1), make_wan(2)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=high,
                       transformer_2=low, boundary_ratio=0.875)  # fmt: skip
    for name, folder, module in (("high", "transformer", high), ("low", "transformer_2", low)):
        messages = load_logging(pipe, str(tmp_path / "run" / folder), load_into_transformer_2=name == "low")
        assert not [m for m in messages if "unexpected keys" in m or "missing keys" in m], messages
        # lora_B: laid out alike on both sides (a Conv3d's lora_A orders the patch differently from ours)
        trained = {n[len(name) + 1 :]: p for n, p in trainer.ema.state.items() if n.startswith(f"{name}.")}
        trained = {n: p for n, p in trained.items() if "lora_B" in n}
        loaded = {n: p for n, p in module.named_parameters() if "lora_B" in n}
        assert trained and len(loaded) == len(trained), name
        assert all(float(p.abs().max()) > 0 for p in trained.values()), f"{name}: adapters never trained"
        for n, value in trained.items():  # ours: ...lora_B.default.weight; theirs: ...default_0.weight
            theirs = loaded[n.replace(".default.", ".default_0.")]
            assert torch.equal(theirs.detach().reshape(value.shape), value), f"{name}: {n}"


def test_both_resumes_exactly(tmp_path):
    """2 steps == 1 step, a checkpoint, and 1 resumed step (both experts run in each: checked): both
    experts' weights, EMA, AdamW states and LR schedules, bit for bit. Planted: the low expert's optimizer not loaded on resume
    (ExpertOptimizers.load_state_dict skipping 'low') -> its weights differ."""
    small = {"train.global_batch_size": 4, "train.micro_batch_tokens": 64, "flow.val_sigmas": "[0.5, 0.95]",
             "train.val_every": 100, "train.warmup_steps": 0, "train.checkpoint_every": 1}  # fmt: skip

    def cfg(out: str, steps: int):
        return load_config(
            TINY, tiny_overrides(tmp_path / out, **{**BOTH, **small, "train.max_steps": steps})
        )

    whole = Trainer(cfg("whole", 2), device=torch.device("cpu"))
    whole.train()
    assert [s.last_epoch for s in whole.lr_schedule.parts.values()] == [2, 2]  # each expert stepped twice
    Trainer(cfg("cut", 1), device=torch.device("cpu")).train()
    resumed = Trainer(cfg("cut", 2), resume=str(tmp_path / "cut" / "run"), device=torch.device("cpu"))
    assert resumed.step == 1
    resumed.train()
    for (n, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(whole.ema.model.named_parameters(), resumed.ema.model.named_parameters()):
        assert torch.equal(a, b), f"EMA {n}"
    assert whole.lr_schedule.state_dict() == resumed.lr_schedule.state_dict()
    step_dir = tmp_path / "cut" / "run" / "checkpoints" / "step_000001" / "model"
    assert (step_dir / "transformer").is_dir() and (step_dir / "transformer_2").is_dir()

    # sample.py --checkpoint of the run: both experts' EMA weights, switching at the run's boundary
    from dit.experts import ExpertPair
    from dit.sampler_setup import load_checkpoint_sampler

    sampler = load_checkpoint_sampler(str(tmp_path / "whole" / "run"), "ema", None, 1.0, "cpu")
    assert isinstance(sampler.model, ExpertPair) and sampler.model.boundary_ratio == 0.875
    for (n, a), (_, b) in zip(sampler.model.named_parameters(), whole.ema.model.named_parameters()):
        assert torch.equal(a, b), f"sampled {n}"


def test_both_bad_input_is_one_line(tmp_path):
    from test_lora import make_wan

    make_wan(1).save_pretrained(tmp_path / "one")  # a single transformer folder: no transformer_2/
    with pytest.raises(ValueError, match=r"model.expert=both: .* holds one transformer, no transformer_2/"):
        _trainer(tmp_path, f"model.pretrained={tmp_path / 'one'}", "model.overrides={}")
    cfg = load_config(TINY, [*tiny_overrides(tmp_path), "model.expert=both"])
    with pytest.raises(
        ValueError, match=r"model.expert=both needs the experts' switch: set model.boundary_ratio"
    ):
        Trainer(cfg, device=torch.device("cpu"))


def test_memory_model_counts_the_idle_expert():
    """The idle expert at rest: 16 bytes a parameter over W when sharded (fp32 master, fp32 gradient,
    two AdamW moments), on the GPU ('sharded') or the host ('cpu'); the running expert as one model.
    Planted: the idle expert left out (experts ignored) -> the first assertion fails."""
    from dynamic_cp.planning.memory import memory_breakdown, resolve_dims

    P, W = float(resolve_dims("wan-14b").num_params), 8
    for mode in ("per_step", "per_layer"):
        one = memory_breakdown("wan-14b", mode, W, 4096, True)
        kept = memory_breakdown("wan-14b", mode, W, 4096, True, experts=2, idle_expert="sharded")
        assert kept.total == pytest.approx(one.total + 16 * P / W), mode
        # the idle expert goes to the host from replicated weights only (dit/expert_offload.py)
        with pytest.raises(ValueError, match=f"under {mode} the idle expert stays sharded on the GPU: use"):
            memory_breakdown("wan-14b", mode, W, 4096, True, experts=2, idle_expert="cpu")
    one = memory_breakdown("wan-14b", "none", W, 4096, True)
    off = memory_breakdown("wan-14b", "none", W, 4096, True, experts=2, idle_expert="cpu")
    # fp32 master and gradient, 8 bytes of AdamW moments sharded over W by ZeRO-1 (the default)
    assert off.total == pytest.approx(one.total) and off.host == pytest.approx(8 * P + 8 * P / W)
    # with an EMA: the idle expert's fp32 average stays on the GPU (dit/expert_offload.py)
    off = memory_breakdown("wan-14b", "none", W, 4096, True, ema=True, experts=2, idle_expert="cpu")
    assert off.idle_expert == pytest.approx(4 * P) and off.host == pytest.approx(8 * P + 8 * P / W)
    # auto: with the idle expert on the host only replicated weights are tried, and the error says so
    from dynamic_cp.planning.memory import choose_fsdp_mode

    sharded = choose_fsdp_mode("wan-14b", W, 4096, 80e9, True, experts=2, idle_expert="sharded")
    assert sharded[0] in ("per_step", "per_layer")
    with pytest.raises(
        ValueError, match=r"none: .* \(model.idle_expert=sharded lets auto shard the weights\)$"
    ):
        choose_fsdp_mode("wan-14b", W, 4096, 80e9, True, experts=2, idle_expert="cpu")
    assert choose_fsdp_mode("wan-14b", W, 4096, 1e12, True, experts=2, idle_expert="cpu")[0] == "none"
    lora = memory_breakdown("wan-14b", "lora", W, 4096, True, experts=2)
    assert lora.idle_expert > 2 * P  # a second frozen bf16 base, and its adapters' states
    # idle_expert='cpu' under LoRA: the frozen base moves, the adapters and their moments stay
    from dynamic_cp.planning.memory import lora_params

    A = float(lora_params(resolve_dims("wan-14b"), 16))
    off = memory_breakdown("wan-14b", "lora", W, 4096, True, experts=2, idle_expert="cpu")
    assert off.host == pytest.approx(2 * P) and off.idle_expert == pytest.approx(16 * A)
    assert off.idle_expert + off.host == pytest.approx(lora.idle_expert)
    with pytest.raises(ValueError, match="idle_expert='gpu'; use 'sharded' or 'cpu'"):
        memory_breakdown("wan-14b", "per_layer", W, experts=2, idle_expert="gpu")
