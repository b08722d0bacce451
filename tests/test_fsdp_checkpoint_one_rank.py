"""fsdp_checkpoint.py on a one-rank gloo world, in this process (the mutation bench's fast subset).

Save then load restores the sharded weights, AdamW moments and EMA exactly, writes the diffusers
exports and the trainer state, and resuming from a replicated checkpoint (fsdp=none) or from one
saved without EMA works. Resharding across world sizes is in tests/test_fsdp.py (spawned ranks).
"""

# ruff: noqa: F811 (tests take the imported `world` fixture as an argument)
from __future__ import annotations

import pytest
import torch
from test_fsdp_one_rank import (
    CPU,
    _full,
    _loss,
    _model,
    world,  # noqa: F401 (the one-rank gloo fixture, shared)
)

from dit.checkpoint import save_checkpoint
from dit.model import VideoDiT
from dynamic_cp.runtime import fsdp
from dynamic_cp.runtime.fsdp_checkpoint import (
    AsyncFSDPCheckpointer,
    load_fsdp_checkpoint,
    save_fsdp_checkpoint,
)

STATE = {"lr_schedule": {"last_epoch": 3}, "bad_steps": 1}


def _trained(world, seed: int = 0):
    """A sharded model, its AdamW after one step, and an EMA that differs from the weights."""
    torch.manual_seed(seed)
    model = fsdp.apply_fsdp(_model(), world, CPU, "no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = fsdp.ShardedEMA(model, decay=0.5)
    _loss(model).backward()
    optimizer.step()
    ema.update(model)
    return model, optimizer, ema


def _values(model, optimizer, ema):
    weights = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    moments = {n: _full(optimizer.state[p]["exp_avg_sq"]).clone() for n, p in model.named_parameters()}
    averages = {n: _full(t).clone() for n, t in ema.params.items()}
    return weights, moments, averages


def _fresh(world):
    model = fsdp.apply_fsdp(_model(), world, CPU, "no")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)  # the checkpoint's lr (1e-2) replaces it
    return model, optimizer, fsdp.ShardedEMA(model, decay=0.5)


def _assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_save_then_load_restores_weights_moments_and_ema_and_writes_the_exports(world, tmp_path):
    model, optimizer, ema = _trained(world)
    weights, moments, averages = _values(model, optimizer, ema)
    config = {"train": {"max_steps": 9}, "model": {"size": "tiny"}}  # not in sorted order
    step_dir = save_fsdp_checkpoint(tmp_path, 3, model, optimizer, ema, STATE, config, 2, world)
    assert step_dir == tmp_path / "step_000003" and (tmp_path / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "config.yaml",
        "ema",
        "model",
        "sharded",
        "trainer.pt",
    ]
    assert (
        step_dir / "config.yaml"
    ).read_text() == "train:\n  max_steps: 9\nmodel:\n  size: tiny\n"  # config's order
    exported = VideoDiT.from_pretrained(step_dir / "model").state_dict()
    for n, w in weights.items():
        assert torch.equal(exported[n], w), n
    exported_ema = VideoDiT.from_pretrained(step_dir / "ema").state_dict()
    for n, w in averages.items():
        assert torch.equal(exported_ema[n], w), n

    model2, optimizer2, ema2 = _fresh(world)
    state = load_fsdp_checkpoint(step_dir, model2, optimizer2, ema2)
    assert (state["step"], state["bad_steps"], state["lr_schedule"]) == (3, 1, {"last_epoch": 3})
    got = _values(model2, optimizer2, ema2)
    for g, w in zip(got, (weights, moments, averages)):
        _assert_same(g, w)
    assert optimizer2.param_groups[0]["lr"] == 1e-2


def test_a_checkpoint_without_ema_starts_the_ema_at_the_weights(world, tmp_path):
    model, optimizer, _ = _trained(world)
    weights = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    step_dir = save_fsdp_checkpoint(tmp_path, 1, model, optimizer, None, STATE, {}, 2, world)
    assert not (step_dir / "ema").exists()
    model2, optimizer2, ema2 = _fresh(world)
    load_fsdp_checkpoint(step_dir, model2, optimizer2, ema2)
    _assert_same({n: _full(t) for n, t in ema2.params.items()}, weights)


def test_resume_from_a_replicated_checkpoint(world, tmp_path):
    torch.manual_seed(0)
    plain = _model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _loss(plain).backward()
    optimizer.step()
    ema = _model()  # any other weights: the EMA export
    state = {**STATE, "optimizer": optimizer.state_dict()}
    step_dir = save_checkpoint(tmp_path, 2, plain, ema, state, {}, 2)
    model2, optimizer2, ema2 = _fresh(world)
    got = load_fsdp_checkpoint(step_dir, model2, optimizer2, ema2)
    assert got["step"] == 2 and "optimizer" not in got
    params = dict(plain.named_parameters())
    _assert_same(
        {n: _full(p).detach() for n, p in model2.named_parameters()},
        {n: p.detach() for n, p in params.items()},
    )
    _assert_same(
        {n: _full(optimizer2.state[p]["exp_avg"]) for n, p in model2.named_parameters()},
        {n: optimizer.state[p]["exp_avg"] for n, p in params.items()},
    )
    _assert_same({n: _full(t) for n, t in ema2.params.items()}, dict(ema.named_parameters()))
    # without an ema/ folder the EMA starts at the checkpoint's weights
    step_dir = save_checkpoint(tmp_path, 4, plain, None, state, {}, 2)
    model3, optimizer3, ema3 = _fresh(world)
    load_fsdp_checkpoint(step_dir, model3, optimizer3, ema3)
    _assert_same({n: _full(t) for n, t in ema3.params.items()}, {n: p.detach() for n, p in params.items()})


def _exported(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize(
    "dtype, with_ema", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)]
)
def test_async_save_exports_the_weights_it_read_back_from_the_shards(world, tmp_path, dtype, with_ema):
    """``train.async_checkpoint`` under FSDP: rank 0's writer thread reads the full weights (and the
    EMA) back from the finished DCP shards for the diffusers exports, instead of gathering them while
    training waits. Those exports must hold the saved step's weights bitwise, in the run's dtype (a
    bf16 run exports bf16), with ema/ only when there is an EMA, and the checkpoint must resume. Planted:
    the read-back buffers in the default dtype, the EMA left out or the model's shapes lost (None), the
    DCP folder not passed to the read: each fails."""
    torch.manual_seed(0)
    model = fsdp.apply_fsdp(_model().to(dtype), world, CPU, "no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = fsdp.ShardedEMA(model, decay=0.5) if with_ema else None
    if dtype == torch.float32:  # a step, so the weights, moments and EMA differ (the tiny model's
        _loss(model).backward()  # loss takes fp32 inputs: the bf16 case saves its initial weights)
        optimizer.step()
        if ema is not None:
            ema.update(model)
    weights = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    saver = AsyncFSDPCheckpointer(world, CPU)
    saver.save(tmp_path, 5, model, optimizer, ema, STATE, {}, 2)
    saver.wait()  # raises RunStopped if the background save failed
    step_dir = tmp_path / "step_000005"
    assert (tmp_path / "latest").read_text().strip() == "step_000005"
    exported = _exported(step_dir / "model")  # the files as written (from_pretrained would upcast some)
    for n, w in weights.items():
        assert exported[n].dtype == dtype and torch.equal(exported[n], w), n
    assert (step_dir / "ema").exists() == with_ema
    if with_ema:
        exported_ema = _exported(step_dir / "ema")
        for n, t in ema.params.items():
            assert exported_ema[n].dtype == dtype and torch.equal(exported_ema[n], _full(t)), n
    model2, optimizer2, ema2 = _fresh(world)
    assert load_fsdp_checkpoint(step_dir, model2, optimizer2, ema2)["step"] == 5
