"""``model.idle_expert=cpu`` on several ranks (replicated weights, Dynamic-CP): the ranks agree on
which expert waits on the host, and training is bitwise what ``idle_expert=sharded`` gives.

3 gloo ranks (an odd world) run 3 steps of the two-expert model of tests/test_fsdp.py twice, with
``idle_expert=sharded`` and with ``cpu``, full training and LoRA. Every step's loss, gradient norm
and every gradient, then the state_dict (an offloaded expert's comes from its host copies) and the
AdamW moments must be bit for bit equal: the same operations on the same values on every rank,
only where the idle expert's tensors rest differs. The batches hold a step where one expert runs
nothing (it is on the host on every rank) and a step of both in which some rank runs only one
expert: that rank must still keep the other on the device, as the all-reduce sums both experts'
gradients. The byte counter reads the tensors themselves.

Against one process with ``idle_expert=cpu`` on the same global batches: loss, gradient norm and the
weights within REL_TOL = 1e-5 relative, derived in tests/test_wan22_both.py (only fp32 sums are
reordered by the plan's packing and CP sharding).

Plants seen to fail:
- ``plan_step`` not called (the step strategy skipping it): a rank that runs only the high expert
  sends the low one away before the all-reduce, whose flat buffer then has another length on that
  rank -> the collective fails;
- ``plan_step`` ignoring the plan (onloading every expert: both on the device until the first
  forward's hook sends one away, a peak of two experts): the byte counter of the idle step, read
  before that hook;
- the idle expert's parameters kept in the all-reduce (``ReplicatedStep.summed`` of every
  parameter): its empty placeholders shorten the flat buffer, the sums' grouping changes, and
  the gradients are no longer bitwise those of ``idle_expert=sharded``.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_fsdp import CONFIG, STEPS, _rel, overrides
from test_wan22_both import BOTH, REL_TOL, PerturbedDistributed, PerturbedTrainer, _a14b_folder

from dit.batching import GlobalBatchSampler
from dit.config import load_config
from dit.expert_offload import local_state
from dit.flow import EXPERTS
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.testing import run_gloo

pytestmark = pytest.mark.timeout(600)
WORLD = 3
DATA = {"train.global_batch_size": 3, "data.seed": 3}
LORA = {"model.lora": "{rank: 4}", "train.lr": 1e-3, "model.overrides": "{}", "parallel.cap_tokens": 320}
CASES = {"full": {}, "lora": LORA}


def _config(out: str, **extra):
    return load_config(CONFIG, overrides(out, **{**BOTH, **DATA, **extra}))


def _watch(trainer, seen: list) -> None:
    """Record, at each expert's forward, the bytes the other expert has on the compute device: before
    the offload hook acts (``prepend``), so that what ``plan_step`` left is what is seen."""
    host = trainer.expert_host
    for name in EXPERTS:
        other = "low" if name == "high" else "high"
        getattr(trainer.model, name).register_forward_pre_hook(
            lambda _m, _a, n=name, o=other: seen.append((n, host.device_bytes(o) if host else None)),
            prepend=True,
        )


def _state(trainer) -> dict:
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "moments": {
            name: [
                (k, v.clone())
                for s in local_state(trainer.optimizer.parts[name]).values()
                for k, v in s.items()
                if torch.is_tensor(v) and v.dim() > 0
            ]
            for name in EXPERTS
        },
    }


def run_steps(trainer) -> dict:
    batches = trainer.data_iterator()
    seen: list = []
    _watch(trainer, seen)
    steps = []
    for _ in range(STEPS):
        batch = next(batches)
        metrics = trainer.train_step(batch)
        trainer.step += 1
        experts = batch.plan.info["experts"]
        steps.append({
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in trainer.model.named_parameters()},
            "plan": sorted(set(experts)), "mine": sorted({experts[m] for m in batch.plan_indices}),
            "seen": list(seen), "on_host": sorted(trainer.expert_host.on_host) if trainer.expert_host else [],
        })  # fmt: skip
        seen.clear()
    batches.close()
    return {"steps": steps, **_state(trainer)}


def worker(rank: int, world_size: int, root: str) -> dict:
    try:
        out = {}
        for case, extra in CASES.items():
            for idle in ("sharded", "cpu"):
                items = {**extra, "model.idle_expert": idle}
                if case == "lora":  # a random two-expert diffusers folder: the user's path, not perturb
                    items["model.pretrained"] = f"{root}/a14b"
                cfg = _config(f"{root}/{case}-{idle}", **items)
                trainer = (DistributedTrainer if case == "lora" else PerturbedDistributed)(
                    cfg, dist.group.WORLD
                )
                # safetensors' views sit at odd addresses, and CPU matmuls of an unaligned weight can
                # round in another order than of the aligned host copy an expert comes back as (see
                # tests/test_expert_offload.py): both runs start from aligned copies
                for t in [*trainer.model.parameters(), *trainer.model.buffers()]:
                    t.data = t.data.clone()
                out[case, idle] = run_steps(trainer)
        return out
    except Exception:
        return {"error": traceback.format_exc()}


def reference(root: Path) -> dict:
    """One process, idle_expert=cpu, on the same global batches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        items = {"parallel.mode": "none", "parallel.fsdp": "none", "model.idle_expert": "cpu"}
        trainer = PerturbedTrainer(_config(str(root / "ref"), **items), device=torch.device("cpu"))
        sampler = GlobalBatchSampler(
            trainer.train_indices, trainer.cfg.train.global_batch_size, trainer.cfg.data.seed
        )
        steps = [trainer.train_step(trainer.prepare([trainer.train_set[i] for i in sampler.batch(s)], s))
                 for s in range(STEPS)]  # fmt: skip
        return {"steps": steps, "model": trainer.model.state_dict()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("idle_ranks")
    _a14b_folder(root / "a14b")
    res = run_gloo(worker, WORLD, str(root), timeout_s=300)
    for r, out in enumerate(res):
        assert "error" not in out, f"rank {r}:\n{out['error']}"
    return root, res


def _equal(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("case", CASES)
def test_idle_expert_on_host_is_bitwise_sharded_on_every_rank(ranks, case):
    _, res = ranks
    for r, out in enumerate(res):
        cpu, sharded = out[case, "cpu"], out[case, "sharded"]
        for s, (a, b) in enumerate(zip(cpu["steps"], sharded["steps"])):
            where = f"{case} rank {r} step {s + 1}"
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), where
            assert a["grad_norm"] > 0, f"{where}: no gradient reached the trained weights"
            assert a["grads"].keys() == b["grads"].keys()
            bad = [n for n in a["grads"] if not _equal(a["grads"][n], b["grads"][n])]
            assert not bad, f"{where}: gradients differ: {bad[:3]}"
        assert cpu["model"].keys() == sharded["model"].keys()
        assert all(torch.equal(cpu["model"][k], v) for k, v in sharded["model"].items()), f"{case} rank {r}"
        for name in EXPERTS:
            got, want = cpu["moments"][name], sharded["moments"][name]
            assert len(got) == len(want) > 0, f"{case} rank {r}: {name}'s moments"
            assert all(k1 == k2 and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(got, want))


@pytest.mark.parametrize("case", CASES)
def test_every_rank_keeps_the_experts_the_step_runs(ranks, case):
    _, res = ranks
    steps = [out[case, "cpu"]["steps"] for out in res]
    plans = [s["plan"] for s in steps[0]]
    # the batches exercise an idle expert and a step of both where some rank runs only one
    assert any(len(p) == 1 for p in plans) and any(len(p) == 2 for p in plans), plans
    assert any(len(p) == 2 and len(rank[s]["mine"]) < 2 for s, p in enumerate(plans) for rank in steps)
    for r, rank in enumerate(steps):
        for s, step in enumerate(rank):
            assert step["plan"] == plans[s], "the ranks disagree on the plan"
            assert {n for n, _ in step["seen"]} == set(step["mine"]), f"rank {r} step {s + 1}"
            for running, other_bytes in step["seen"]:
                other = "low" if running == "high" else "high"
                # an expert the step's plan runs is on the device on every rank; the idle one is not
                assert (other_bytes > 0) == (other in plans[s]), (r, s + 1, running, other_bytes)
            assert step["on_host"] == sorted(set(EXPERTS) - set(plans[s])), f"rank {r} step {s + 1}"


def test_idle_expert_on_host_ranks_equal_one_process(ranks):
    root, res = ranks
    ref = reference(root)
    got = res[0]["full", "cpu"]
    for s, (step, want) in enumerate(zip(got["steps"], ref["steps"])):
        assert step["loss"] == pytest.approx(want["loss"], rel=REL_TOL), f"step {s + 1} loss"
        assert step["grad_norm"] == pytest.approx(want["grad_norm"], rel=REL_TOL), f"step {s + 1} norm"
    assert got["model"].keys() == ref["model"].keys()
    for k, want in ref["model"].items():
        if want.is_floating_point() and want.norm() > 0:
            assert _rel(got["model"][k], want) < REL_TOL, k
