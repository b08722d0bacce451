"""bf16 autocast on every parallel path: 3 steps on 4 gloo ranks end where single-process bf16 does.

``train.mixed_precision=bf16`` runs autocast on CPU too, so these are the casts a GPU run makes:
bf16 activations through Ulysses' all-to-alls, ring attention's K/V passes and LSE merges, the 2-D
layout, and fp32 gradients into the all-reduce. One spawn of 4 ranks runs every case (3 optimizer
steps each); the single-process references run here.

Tolerance, and why: bf16 keeps 8 significant bits (unit round-off 2^-8 = 3.9e-3), and a parallel
path rounds at other places than one process does (other GEMM shapes per micro-batch, attention in
shards merged in fp32, sums in another order). So it cannot match single-process bf16 to 1e-5; what
it must do is add no more error than bf16 itself adds. Both runs are the exact (fp32) run plus a
rounding error; if the parallel run's error is no larger than the single-process one's, the triangle
inequality bounds their distance by 2x the single-process bf16-vs-fp32 distance. The test measures
that distance in the same run and allows 2.5x of it (a little room for the parallel run's extra
roundings), on the parameter *updates* of all 3 steps: the updates are what bf16 perturbs, whereas
relative to the parameters themselves even a broken gradient would look small after 3 steps of
lr 1e-3. A dropped or misrouted block of attention moves the updates by O(1), far above this.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch
import torch.distributed as dist

from dit.batching import GlobalBatchSampler
from dit.config import load_config
from dit.trainer import Trainer
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.runtime.distributed_trainer import DistributedTrainer
from dynamic_cp.runtime.testing import run_gloo
from tests.test_runtime import CASES, CONFIG, PROFILE, overrides, perturb

WORLD = 4
STEPS = 3
FACTOR = 2.5  # x the single-process bf16-vs-fp32 distance; see the module docstring
BF16_CASES = {
    "dynamic": CASES["dynamic"],  # planner's plan: Ulysses and PackedAttention micro-batches
    "hybrid": CASES["hybrid"],  # Ulysses 2 x ring 2 at CP 4
    "static_ring": CASES["static"],
    "static_ulysses": {
        "parallel.mode": "static",
        "parallel.static_cp_size": 2,
        "parallel.cp_method": "ulysses",
    },
}


def _extra(case: str, root: str) -> dict:
    hardware = {"parallel.hardware": f"{root}/{PROFILE}"} if case == "hybrid" else {}
    return {**BF16_CASES[case], **hardware, "train.mixed_precision": "bf16"}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def worker(rank: int, world_size: int, root: str) -> dict:
    try:
        results = {}
        for case in BF16_CASES:
            cfg = load_config(CONFIG, overrides(f"{root}/{case}", **_extra(case, root)))
            trainer = DistributedTrainer(cfg, dist.group.WORLD)
            perturb(trainer.model)
            start = _params(trainer.model)
            batches = trainer.data_iterator()
            layouts: dict[str, int] = {}
            for _ in range(STEPS):
                metrics = trainer.train_step(next(batches))
                for k, v in metrics["cp_layouts"].items():
                    layouts[k] = layouts.get(k, 0) + v
            batches.close()
            results[case] = {"start": start, "end": _params(trainer.model), "layouts": layouts}
        return results
    except Exception:
        return {"error": traceback.format_exc()}


def _single_key(case: str) -> tuple:
    """The config a single process runs for ``case``: parallel settings dropped, so cases on the same
    model and data share one reference run."""
    return tuple(sorted((k, v) for k, v in BF16_CASES[case].items() if not k.startswith("parallel.")))


_REFERENCES: dict[tuple, dict[str, torch.Tensor]] = {}


def single_process(case: str, out: str, mixed_precision: str) -> dict[str, torch.Tensor]:
    key = (*_single_key(case), mixed_precision)
    if key not in _REFERENCES:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # two cores shared with the spawned ranks: spinning threads cost 50x
        try:
            _REFERENCES[key] = _single_process(case, out, mixed_precision)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCES[key]


def _single_process(case: str, out: str, mixed_precision: str) -> dict[str, torch.Tensor]:
    extra = {**dict(_single_key(case)), "parallel.mode": "none", "train.mixed_precision": mixed_precision}
    cfg = load_config(CONFIG, overrides(out, **extra))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    perturb(trainer.model)
    sampler = GlobalBatchSampler(trainer.train_indices, cfg.train.global_batch_size, cfg.data.seed)
    for step in range(STEPS):
        trainer.train_step(trainer.prepare([trainer.train_set[i] for i in sampler.batch(step)], step))
    return _params(trainer.model)


def _update_distance(a: dict, b: dict, start: dict) -> float:
    """||update_a - update_b|| / ||update_b|| over all parameters as one vector."""
    diff = sum(float((a[n] - b[n]).double().square().sum()) for n in b)
    norm = sum(float((b[n] - start[n]).double().square().sum()) for n in b)
    return (diff / norm) ** 0.5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    zero_latency = dataclasses.replace(
        Hardware.load("h100"), name="zero-latency", intra_node_latency_s=0.0, inter_node_latency_s=0.0
    )
    (root / PROFILE).write_text(zero_latency.to_yaml())
    out = run_gloo(worker, WORLD, str(root), timeout_s=400)
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return out


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_parallel_path_matches_single_process_bf16(results, case, tmp_path):
    ref_bf16 = single_process(case, str(tmp_path / "bf16"), "bf16")
    ref_fp32 = single_process(case, str(tmp_path / "fp32"), "no")
    start = results[0][case]["start"]
    assert all(torch.equal(start[n], p) for n, p in results[1][case]["start"].items())
    bf16_cost = _update_distance(ref_bf16, ref_fp32, start)  # what bf16 alone moves the updates by
    assert 0 < bf16_cost < 0.2, f"bf16 vs fp32 distance {bf16_cost:.3g}: autocast did not run, or broke"
    for r in range(WORLD):
        got = results[r][case]["end"]
        err = _update_distance(got, ref_bf16, start)
        print(f"{case} rank {r}: {err:.3g} from single-process bf16 (bf16 vs fp32: {bf16_cost:.3g})")
        assert err <= FACTOR * bf16_cost, (
            f"{case}: rank {r} is {err:.3g} from single-process bf16, more than {FACTOR} x the "
            f"bf16-vs-fp32 distance {bf16_cost:.3g}"
        )
    if case == "hybrid":
        assert results[0][case]["layouts"].get("2x2", 0) >= 1, results[0][case]["layouts"]
    if case.startswith("static"):
        assert results[0][case]["layouts"], "no micro-batch ran under CP"
