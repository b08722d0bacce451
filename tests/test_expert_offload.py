"""``model.idle_expert=cpu`` (dit/expert_offload.py): under model.expert=both the expert a step does
not run waits on the host, weights and AdamW moments, and training is bitwise what it is without.

3 steps of a tiny two-expert run (data.seed 2: high alone, low alone, then both, checked) against
the same run with ``idle_expert=sharded``: each step's loss, gradient norm and every gradient, the
weights and AdamW moments after the run and the validation loss, bit for bit (one process, the same
operations on the same values: no tolerance). The byte counter reads the tensors themselves, as
tests/test_block_offload.py's does: while one expert runs, the other's bytes on the compute device
are 0. A LoRA run of both experts (imported from a diffusers folder) exports the same two files.

Plants seen to fail: the expert not brought back before its forward (``onload`` returning at once:
its forward meets empty weights); the other expert never sent away (``_before`` skipping
``offload``: the byte counter); the AdamW moments left behind (``offload`` keeping ``states``
empty: the moment check); the state_dict hook off (the saved weights are empty); a shared module's
second state_dict key left out (the hand-made pair).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from torch import nn

from dit.config import load_config
from dit.expert_offload import IdleExpertHost, idle_expert_host
from dit.trainer import Trainer

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
BOTH = {"model.expert": "both", "model.boundary_ratio": 0.875, "flow.shift": 5.0, "train.ema_decay": 0.9,
        "train.global_batch_size": 3, "train.micro_batch_tokens": 16, "train.warmup_steps": 0,
        "data.seed": 2, "train.seed": 2}  # fmt: skip
PATTERN = [("high",), ("low",), ("high", "low")]  # the experts each of the 3 steps runs


def _trainer(tmp_path, idle: str, **extra) -> Trainer:
    items = {**BOTH, "model.idle_expert": idle, "output_dir": str(tmp_path / idle), **extra}
    return Trainer(load_config(TINY, tiny_overrides(tmp_path, **items)), device=torch.device("cpu"))


def _expert_bytes(expert) -> int:
    return sum(t.nbytes for t in [*expert.parameters(), *expert.buffers()])


def _run(trainer, watch=None) -> list[dict]:
    batches = trainer.data_iterator()
    steps = []
    for s in range(len(PATTERN)):
        metrics = trainer.train_step(trainer.prepare(next(batches), s))
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in trainer.model.named_parameters()}
        steps.append({"loss": metrics["loss"], "norm": metrics["grad_norm"], "grads": grads,
                      "active": trainer.optimizer.active, "watch": list(watch or [])})  # fmt: skip
        if watch is not None:
            watch.clear()
    del batches
    return steps


def test_three_steps_equal_no_offload_bitwise_with_the_idle_expert_off_the_device(tmp_path):
    plain = _trainer(tmp_path, "sharded")
    want = _run(plain)
    assert [s["active"] for s in want] == PATTERN  # the idle path is exercised both ways
    off = _trainer(tmp_path, "cpu")
    host = off.expert_host
    full = {n: _expert_bytes(getattr(off.model, n)) for n in ("high", "low")}
    seen = []  # (running expert, the other's device bytes, its own) at every block forward
    for name, other in (("high", "low"), ("low", "high")):
        for block in getattr(off.model, name).blocks:
            block.register_forward_pre_hook(
                lambda *_, n=name, o=other: seen.append((n, host.device_bytes(o), host.device_bytes(n)))
            )
    got = _run(off, seen)
    for s, (g, w) in enumerate(zip(got, want)):
        assert g["active"] == w["active"] and g["loss"] == w["loss"] and g["norm"] == w["norm"], s
        assert g["grads"].keys() == w["grads"].keys()
        for n, grad in w["grads"].items():
            assert (grad is None) == (g["grads"][n] is None) and (
                grad is None or torch.equal(grad, g["grads"][n])
            ), n
        ran = {n for n, _, _ in g["watch"]}
        assert ran == set(PATTERN[s])
        for n, other_bytes, own in g["watch"]:
            assert own == full[n]  # the running expert is whole on the device
            if len(ran) == 1:
                assert other_bytes == 0, (
                    f"step {s + 1}: the idle expert has {other_bytes} bytes on the device"
                )
    assert host.on_host == set()  # the last step ran both: both stay for their optimizer steps
    # the saved weights of an offloaded expert are its host copies (checkpoints bring nothing back)
    saved_plain, val_plain = plain.model.state_dict(), plain.validation_loss()
    assert off.validation_loss() == val_plain  # no-grad forwards swap the experts one at a time
    assert len(host.on_host) == 1
    gone = getattr(off.model, next(iter(host.on_host)))
    assert all(p.grad is None for p in gone.parameters())  # its last step's gradients dropped with it
    saved = off.model.state_dict()
    assert saved.keys() == saved_plain.keys()
    for k, v in saved_plain.items():
        assert torch.equal(saved[k], v), k
    idle = next(iter(host.on_host))
    moments = [s[k] for s in off.optimizer.parts[idle].state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.nbytes > 0 for m in moments)  # AdamW's moments moved, not lost
    held = {id(t) for _, _, t in host._states[idle]}
    assert all(id(m) in held for m in moments)  # the optimizer's state is the host copy
    assert host.host_bytes() == full[idle] + sum(m.nbytes for m in moments)
    host.remove()
    assert host.on_host == set() and all(host.device_bytes(n) == full[n] for n in full)
    for (n, p), (_, q) in zip(off.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(p, q), n
    for name in ("high", "low"):
        a, b = off.optimizer.parts[name].state, plain.optimizer.parts[name].state
        assert len(a) == len(b) > 0
        for sa, sb in zip(a.values(), b.values()):
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(
                sa["exp_avg_sq"], sb["exp_avg_sq"]
            )


def test_an_expert_left_on_the_host_fails_loudly(tmp_path):
    off = _trainer(tmp_path, "cpu")
    assert off.expert_host.on_host == set() and off.expert_host.host_bytes() == 0
    spare = IdleExpertHost(off.model, off.optimizer, "cpu")  # a device by name
    assert spare.device == torch.device("cpu") and not spare.pin
    spare.remove()
    off.expert_host.offload("low")
    assert off.expert_host.device_bytes("low") == 0
    off.expert_host.offload("low")  # twice: still one host copy
    assert off.expert_host.host_bytes() == _expert_bytes(off.model.high)  # the experts are alike
    off.expert_host.remove()  # the hooks gone: nothing brings it back
    off.expert_host.offload("low")
    with pytest.raises((RuntimeError, IndexError)):  # empty weights: a shape error, never stale values
        off.model.low(*_zero_inputs(off.model.low))


def _zero_inputs(dit):
    from dit.attention import PackedAttention

    c = dit.config
    n = 4
    return (torch.zeros(n, c.in_channels * 4), torch.zeros(n, 3, dtype=torch.long), torch.tensor([n]),
            torch.tensor([500.0]), torch.zeros(1, c.text_dim), torch.tensor([1]), PackedAttention([n]))  # fmt: skip


def test_the_ema_copy_does_not_move_the_live_experts(tmp_path):
    """The EMA deep-copies the experts with their hooks: its forwards must leave the live model alone."""
    off = _trainer(tmp_path, "cpu")
    with torch.no_grad():
        off.ema.model.low(*_zero_inputs(off.ema.model.low))
    assert off.expert_host.on_host == set()
    with torch.no_grad():
        off.model.low(*_zero_inputs(off.model.low))
    assert off.expert_host.on_host == {"high"}
    assert all(t.nbytes > 0 for t in off.ema.model.high.parameters())


def test_where_it_cannot_run_it_says_so_in_one_line(tmp_path):
    class Fake:
        world_size, fsdp_mode, both, lora = 2, "per_step", True, False

        class cfg:  # noqa: N801
            class model:  # noqa: N801
                idle_expert = "cpu"

    with pytest.raises(
        ValueError, match=r"^model.idle_expert=cpu moves replicated weights; under parallel.fsdp=per_step"
    ):
        idle_expert_host(Fake(), None)
    Fake.fsdp_mode = "per_layer"
    with pytest.raises(ValueError, match="set model.idle_expert=sharded, or parallel.fsdp=none$"):
        idle_expert_host(Fake(), None)
    Fake.cfg.model.idle_expert = "sharded"
    assert idle_expert_host(Fake(), None) is None
    with pytest.raises(
        ValueError,
        match=r"model.idle_expert=cpu with model.compile: .* set model.compile=false, or model.idle_expert=sharded$",
    ):
        _trainer(tmp_path, "cpu", **{"model.compile": "true"})
    assert isinstance(_trainer(tmp_path, "cpu").expert_host, IdleExpertHost)


@pytest.mark.parametrize("offload", ["none", "blocks"])
def test_a_lora_run_with_the_idle_expert_on_the_host_equals_one_without(tmp_path, offload):
    """LoRA on both experts (a frozen base, adapters, AdapterEMA): 3 steps and the exported files, bit
    for bit equal to ``idle_expert=sharded``; also with ``model.offload=blocks`` (the 24 GB recipe:
    the running expert's last blocks stream from the host, the idle expert waits there whole)."""
    from safetensors.torch import load_file
    from test_lora import lora_overrides
    from test_wan22_both import _a14b_folder

    root = _a14b_folder(tmp_path / "a14b")
    items = {"model.pretrained": str(root), "model.expert": "both", "flow.shift": 5.0, "train.max_steps": 3,
             "train.warmup_steps": 0, "train.checkpoint_every": 2, "train.global_batch_size": 3,
             "train.sample_every": 0, "data.seed": 2, "train.seed": 2, "model.offload": offload,
             "model.offload_blocks": 2, "model.gradient_checkpointing": offload != "none"}  # fmt: skip
    runs = {}
    for idle in ("sharded", "cpu"):
        cfg = load_config(TINY, lora_overrides(tmp_path, idle, **{**items, "model.idle_expert": idle}))
        runs[idle] = Trainer(cfg, device=torch.device("cpu"))
        if idle == "cpu":  # LoRA: the low expert's frozen base went to the host before the model moved
            host = runs[idle].expert_host
            assert host.on_host == {"low"} and host.device_bytes("low") == 0 and not host.trainable
            assert all(p.numel() > 0 for p in runs[idle].model.low.parameters() if p.requires_grad)
        # Weights read from safetensors are views at odd addresses, and CPU matmul kernels can round
        # an unaligned operand's sums in another order (a last-bit difference, constraints.txt's
        # note); an expert that comes back from the host is a fresh, aligned copy. Both runs start
        # from aligned copies, so that what is compared is the offload alone.
        for t in [*runs[idle].model.parameters(), *runs[idle].model.buffers()]:
            t.data = t.data.clone()
        if idle == "cpu":  # at each expert's forward: the other one's bytes on the compute device
            host, seen = runs[idle].expert_host, []
            for name, other in (("high", "low"), ("low", "high")):
                hook = lambda _m, _a, _out, o=other, h=host, s=seen: s.append(h.device_bytes(o))  # noqa: E731
                getattr(runs[idle].model, name).register_forward_hook(hook)
        runs[idle].train()
    host = runs["cpu"].expert_host
    assert host.on_host  # the last validation left one expert on the host
    assert all(host.device_bytes(n) == 0 for n in host.on_host) and 0 in seen and max(seen) > 0
    # each expert's block offloader kept at most the running block and the prefetched one
    assert [o.peak_blocks for o in runs["cpu"].offloaders] == ([2, 2] if offload != "none" else [])
    for folder in ("transformer", "transformer_2"):
        a, b = (
            load_file(str(tmp_path / idle / folder / "pytorch_lora_weights.safetensors")) for idle in runs
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder


def test_host_copies_keep_dtype_strides_and_every_key_of_a_shared_module():
    """On a hand-made pair: a bf16 weight stored transposed, an int buffer, one linear held twice."""
    from types import SimpleNamespace

    def expert():
        e = nn.Module()
        e.a = nn.Linear(4, 6).to(torch.bfloat16)
        e.a.weight.data = e.a.weight.data.t().contiguous().t()  # (6, 4) with strides (1, 6)
        e.b = e.a  # the same module in two places: state_dict keys a.* and b.*
        e.register_buffer("count", torch.arange(3))
        return e

    pair = nn.Module()
    pair.high, pair.low = expert(), expert()
    opts = SimpleNamespace(
        parts={
            n: torch.optim.SGD(getattr(pair, n).parameters(), lr=0.1, momentum=0.9) for n in ("high", "low")
        }
    )
    pair.low.a(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    opts.parts["low"].step()  # a momentum buffer per parameter: optimizer state to move
    host = IdleExpertHost(pair, opts, "cpu")
    before = {k: v.clone() for k, v in pair.low.state_dict().items()}
    assert set(before) == {"a.weight", "a.bias", "b.weight", "b.bias", "count"}
    stride, live = pair.low.a.weight.stride(), pair.low.a.weight.data_ptr()
    host.offload("low")
    assert pair.low.a.weight.dtype == torch.bfloat16 and pair.low.count.dtype == torch.int64  # placeholders
    copies = {a: t for (_, a), t in zip(host._tensors["low"], host._host["low"])}
    assert {a: t.dtype for a, t in copies.items()} == {"weight": torch.bfloat16, "bias": torch.bfloat16,
                                                       "count": torch.int64}  # fmt: skip
    assert copies["weight"].stride() == stride and not any(t.requires_grad for t in copies.values())
    saved = pair.low.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in before.items())  # both keys of the shared linear
    assert copies["weight"].data_ptr() != live  # a copy, not a view of the device tensor it replaces
    moments = [t for _, _, t in host._states["low"]]
    assert len(moments) == 2 and all(m.dtype == torch.bfloat16 for m in moments)
    host.onload("low")
    # back as copies of their own (as a GPU's would be), not the host buffers themselves
    assert pair.low.a.weight.data_ptr() != copies["weight"].data_ptr()
    back = [s["momentum_buffer"] for s in opts.parts["low"].state.values()]
    assert all(b.data_ptr() != m.data_ptr() and torch.equal(b, m) for b, m in zip(back, moments))
    assert pair.low.a.weight.stride() == stride and pair.low.a.weight.requires_grad
    assert all(torch.equal(pair.low.state_dict()[k], v) for k, v in before.items())
