"""Block offload (dit/block_offload.py, ``model.offload``): outputs and gradients bitwise equal to
no offload, at most two offloaded blocks on the compute device, and a LoRA run on an offloaded fp8
base that trains and resumes exactly.

On CPU the compute device and the host are one memory, so the offloader's copies are real copies
of their own and its placeholders real empty tensors: a block used while offloaded has no weights and
fails, which is what a GPU would do with weights it never received.

Plants seen to fail: ``_before`` not bringing a block back for its recompute in backward (every
training test: the recompute finds empty weights); ``_after`` keeping each block after its forward
(the residency test); the trainer not installing the offloader (the run test); the copy in
sharing the host's memory (``h.to(device)`` without ``copy=True``: the own-copy test); the placeholder
made on the host instead of ``device`` (the placeholder test); ``checkpoint_on_host`` keeping ``x``
itself or dropping its dtype (the bf16 host-copy test).
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from test_lora import TARGETS, batch, imported, make_wan

from dit.attention import PackedAttention
from dit.block_offload import BlockOffloader, checkpoint_on_host
from dit.fp8_base import store_base_in_fp8
from dit.model_config import ModelConfig
from dit.packing import pack


def _lora_model(fp8: bool):
    torch.manual_seed(0)
    model = imported(make_wan()).requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=TARGETS[:6], init_lora_weights=False), model)
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    if fp8:
        store_base_in_fp8(model, per_row=True, compute_dtype=torch.float32)
    model.gradient_checkpointing = True
    return model


def _step(model, grad: bool = True):
    """One forward (and backward) on three uneven clips -> (output, {adapter: grad})."""
    clips, texts, timesteps = batch()
    packed = pack(clips, model.patch_size)
    text, lens = torch.cat(texts), torch.tensor([t.shape[0] for t in texts])
    with torch.set_grad_enabled(grad):
        out = model(packed.tokens, packed.positions, packed.seq_lens, timesteps, text, lens,
                    PackedAttention(packed.seq_lens))  # fmt: skip
    if not grad:
        return out, {}
    (out.square().mean() + out.sum()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("count", [1, 2])
def test_outputs_and_gradients_equal_no_offload(fp8, count):
    plain = _lora_model(fp8)
    offloaded = copy.deepcopy(plain)
    off = BlockOffloader(offloaded.blocks, "cpu", count, lambda: offloaded.gradient_checkpointing)
    assert off.device_bytes() == 0 < off.host_bytes()
    for grad in (True, False):  # a training step, then a sampling forward
        want, want_grads = _step(plain, grad)
        got, got_grads = _step(offloaded, grad)
        assert torch.equal(got, want)
        assert got_grads.keys() == want_grads.keys() and (got_grads or not grad)
        for n in want_grads:
            assert torch.equal(got_grads[n], want_grads[n]), n
        assert off.device_bytes() == 0, "an offloaded block stayed on the device after the step"


def test_at_most_the_running_and_the_prefetched_block_are_resident():
    model = _lora_model(fp8=True)
    blocks = torch.nn.ModuleList([copy.deepcopy(model.blocks[i % 2]) for i in range(5)])
    model.blocks = blocks  # five blocks: a forward and a backward pass through three or more at once
    off = BlockOffloader(model.blocks, "cpu", 5, lambda: True)
    one_block = off.host_bytes() // 5
    seen = []
    for b in model.blocks:  # after the offloader's own hook: what the block runs with
        b.register_forward_pre_hook(lambda *_: seen.append(off.device_bytes()))
    _step(model)
    assert len(seen) == 10  # five forwards, five recomputes
    assert max(seen) <= 2 * one_block and min(seen) >= one_block, seen
    assert off.peak_blocks == 2 and off.device_bytes() == 0


def test_a_block_used_while_offloaded_fails_loudly():
    model = _lora_model(fp8=False)
    off = BlockOffloader(model.blocks, "cpu", 2, lambda: True)
    for h in off._handles:
        h.remove()  # no hooks: nothing brings the weights in
    with pytest.raises(RuntimeError):
        _step(model, grad=False)


def test_checkpoint_on_host_matches_the_plain_checkpoint_on_cpu():
    plain = _lora_model(fp8=False)
    hosted = copy.deepcopy(plain)
    hosted.checkpoint_fn = checkpoint_on_host
    want, want_grads = _step(plain)
    got, got_grads = _step(hosted)
    assert torch.equal(got, want) and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())


def test_checkpoint_on_host_keeps_the_dtype_and_never_reads_the_input_again():
    """A bf16 block: output and gradients bitwise equal to the plain checkpoint, and the backward is
    unchanged when ``x``'s memory is overwritten after the forward (on a GPU, freed and reused): the
    recompute reads its own host copy, of ``x``'s dtype."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    block = block.to(torch.bfloat16)
    x0 = torch.randn(5, 8, dtype=torch.bfloat16)

    def run(fn, overwrite: bool):
        block.zero_grad()
        x = x0.clone().requires_grad_(True)
        y = fn(block, x)
        if overwrite:
            x.data.fill_(float("nan"))
        y.float().square().sum().backward()
        return y.detach(), [p.grad.clone() for p in block.parameters()]

    want, want_grads = run(lambda b, x: torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False), False)
    got, got_grads = run(checkpoint_on_host, True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads, strict=True))


def test_a_resident_block_is_a_copy_of_its_own_and_the_host_copy_stays_intact():
    """What the device does with a block's weights while they are in never reaches the host copy:
    overwrite every resident copy after a step, and the next step is bitwise the same."""
    from dit.block_offload import frozen_tensors

    model = _lora_model(fp8=False)
    BlockOffloader(model.blocks, "cpu", 2, lambda: True)
    resident = []
    for b in model.blocks:  # after the offloader's own hook: the tensors the block runs with
        b.register_forward_pre_hook(
            lambda m, _a: resident.extend(getattr(t, n).data for t, n in frozen_tensors(m))
        )
    first, _ = _step(model, grad=False)
    assert len(resident) == 2 * len(frozen_tensors(model.blocks[0]))
    for t in resident:
        t.fill_(float("nan")) if t.is_floating_point() else t.fill_(7)
    again, _ = _step(model, grad=False)
    assert torch.equal(again, first)


def test_placeholders_live_on_the_compute_device_and_remove_brings_the_blocks_back():
    """The offloaded tensors' placeholders are empty tensors of their dtype on ``device``, and
    ``remove()`` copies every block to ``device`` for good. On a model on ``meta`` (a device that is
    not the host: a placeholder made on the CPU cannot stand in for its tensor there), shapes and
    dtypes; on the CPU, the host's values, and a training step then leaves them all in."""
    from dit.block_offload import frozen_tensors

    model = _lora_model(fp8=True)
    meta = copy.deepcopy(model).to("meta")
    tensors = [(m, n) for b in meta.blocks for m, n in frozen_tensors(b)]
    shapes = [(getattr(m, n).shape, getattr(m, n).dtype) for m, n in tensors]
    off = BlockOffloader(meta.blocks, "meta", 2, lambda: True)
    for (m, n), (_, dtype) in zip(tensors, shapes, strict=True):
        t = getattr(m, n)
        assert t.device.type == "meta" and t.numel() == 0 and t.dtype == dtype, n
    off.remove()
    assert off.swapped == set()
    assert [(getattr(m, n).shape, getattr(m, n).dtype) for m, n in tensors] == shapes
    assert all(getattr(m, n).device.type == "meta" for m, n in tensors)

    plain = copy.deepcopy(model)
    off = BlockOffloader(model.blocks, "cpu", 2, lambda: True)
    _step(model)
    off.remove()
    assert off.device_bytes() == off.host_bytes() > 0
    for (_, t), (_, want) in zip(
        [*model.blocks.named_buffers(), *model.blocks.named_parameters()],
        [*plain.blocks.named_buffers(), *plain.blocks.named_parameters()],
        strict=True,
    ):
        if not want.requires_grad:
            assert torch.equal(t, want)
    _step(model)  # no hooks left: nothing is released
    assert off.device_bytes() == off.host_bytes() and off.peak_blocks == 2


def test_bad_offload_settings_are_one_line():
    with pytest.raises(ValueError, match="model.offload='disk'; choose one of none, blocks"):
        ModelConfig(offload="disk")
    with pytest.raises(ValueError, match="set model.lora"):
        ModelConfig(offload="blocks")
    with pytest.raises(ValueError, match="model.offload_blocks=-1"):
        ModelConfig(offload_blocks=-1)
    with pytest.raises(ValueError, match="only 2 blocks|the model has 2 blocks"):
        BlockOffloader(_lora_model(False).blocks, "cpu", 3, lambda: True)


def test_a_lora_run_with_fp8_and_offload_trains_resumes_and_exports(tmp_path):
    """3 steps of LoRA on an fp8 base with every block offloaded: equal to the same run without offload
    (bitwise), a resume from step 2 ends bitwise equal, and the export holds the adapters alone. The
    run without gradient checkpointing is refused with the fix."""
    from safetensors.torch import load_file
    from test_lora import TINY, lora_overrides

    from dit.config import load_config
    from dit.trainer import Trainer

    make_wan().save_pretrained(tmp_path / "wan")
    extra = {"model.base_dtype": "fp8_scaled", "model.gradient_checkpointing": True,
             "train.sample_every": 0, "train.ema_decay": 0}  # fmt: skip

    def run(out, resume=None, **more):
        cfg = load_config(TINY, lora_overrides(tmp_path, out, **{**extra, **more}))
        trainer = Trainer(cfg, resume=resume, device=torch.device("cpu"))
        trainer.train()
        return trainer

    offloaded = run("offloaded", **{"model.offload": "blocks"})
    assert [o.swapped for o in offloaded.offloaders] == [{0, 1}]  # auto with no memory limit: all
    plain = run("plain")
    live = {n: p for n, p in plain.model.named_parameters() if p.requires_grad}
    for n, p in offloaded.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, live[n]), n
    resumed = run("resumed", resume=str(tmp_path / "offloaded" / "checkpoints" / "step_000002"),
                  **{"model.offload": "blocks", "model.offload_blocks": 1})  # fmt: skip
    for n, p in resumed.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, live[n]), n
    keys = set(load_file(str(tmp_path / "offloaded" / "pytorch_lora_weights.safetensors")))
    assert keys == set(load_file(str(tmp_path / "plain" / "pytorch_lora_weights.safetensors")))
    with pytest.raises(ValueError, match="set model.gradient_checkpointing=true"):
        run("no-ckpt", **{"model.offload": "blocks", "model.gradient_checkpointing": False})


def test_memory_model_prices_fp8_storage_and_offload_by_hand():
    """Wan-14B LoRA: the base at 1 byte a weight, 40 - N + 2 blocks of it on the GPU, N on the host,
    and under blocks+activations the checkpointed inputs (2 d bytes a token a block) on the host."""
    from dynamic_cp.planning.memory import BYTES_BF16, memory_breakdown
    from dynamic_cp.planning.model_dims import MODELS

    dims = MODELS["wan-14b"]
    P, L, d = dims.num_params, dims.layers, dims.d
    per_block = (P - dims.patch_values * d) / L
    bf16 = memory_breakdown(dims, "lora", 1, 1000, True)
    fp8 = memory_breakdown(dims, "lora", 1, 1000, True, base_bytes=1)
    assert bf16.compute_weights - fp8.compute_weights == pytest.approx(P)
    off = memory_breakdown(dims, "lora", 1, 1000, True, base_bytes=1, offload_blocks=30)
    assert fp8.compute_weights - off.compute_weights == pytest.approx(28 * per_block)
    assert off.offloaded == pytest.approx(30 * per_block) and off.total < fp8.total
    acts = memory_breakdown(
        dims, "lora", 1, 1000, True, base_bytes=1, offload_blocks=30, offload_activations=True
    )
    assert acts.host_activations_per_token == L * d * BYTES_BF16
    assert off.activations_per_token - acts.activations_per_token == L * d * BYTES_BF16
    assert acts.host_offload == pytest.approx(30 * per_block + 1000 * L * d * BYTES_BF16)
    with pytest.raises(ValueError, match="mode 'lora'"):
        memory_breakdown(dims, "none", 1, 1000, True, base_bytes=1)


def test_dry_run_shows_the_24_gb_recipe_fits_with_its_block_count(capsys):
    """``train.py --config configs/wan-14b-lora.yaml --dry-run parallel.memory_gb=24``: bf16 does not
    fit (and names the knobs left); fp8_scaled + blocks+activations fits at 32,768 tokens a rank (one
    480x832 clip of 81 frames is 32,760), with the block count the run would use."""
    from pathlib import Path

    import train

    config = str(Path(__file__).resolve().parents[1] / "configs" / "wan-14b-lora.yaml")
    argv = ["--config", config, "--dry-run", "--world-size", "1", "parallel.memory_gb=24"]
    train.main(argv)
    out = capsys.readouterr().out
    assert "does not fit in 90% of 24 GB (estimate) at 32,768 tokens" in out
    assert "try model.base_dtype=fp8_scaled, model.offload=blocks" in out
    # the word order: overrides before the flags and after them (parse_intermixed_args)
    recipe = ["model.base_dtype=fp8_scaled", "model.offload=blocks+activations"]
    train.main(["--config", config, *recipe, "--dry-run", "--world-size", "1", "parallel.memory_gb=24"])
    out = capsys.readouterr().out
    assert (
        "fits in 90% of 24 GB (estimate) at 32,768 tokens a rank with base_dtype=fp8_scaled + offload 7"
        in out
    )
    assert "model.offload=blocks+activations: 7 blocks offloaded (offload_blocks=auto)" in out


def test_the_edges_of_the_settings_and_the_counts_are_accepted():
    """offload_blocks=0 and every block are valid counts; compile without offload is not refused."""
    from dit.model_config import LoraSettings

    assert ModelConfig(offload="blocks", offload_blocks=0, lora=LoraSettings()).offload_blocks == 0
    assert ModelConfig(compile=True).compile  # offload none: compile is fine
    with pytest.raises(ValueError, match="model.offload=blocks with model.compile: choose one"):
        ModelConfig(offload="blocks", lora=LoraSettings(), compile=True)
    model = _lora_model(False)
    none = BlockOffloader(model.blocks, "cpu", 0, lambda: True)
    assert none.swapped == set() and none.peak_blocks == 0 and none.host_bytes() == 0
    _step(model)
    assert none.peak_blocks == 0  # nothing offloaded: nothing ever brought in
    with pytest.raises(ValueError, match="the model has 2 blocks; use 0 to 2"):
        BlockOffloader(model.blocks, "cpu", -1, lambda: True)


def test_frozen_tensors_lists_real_buffers_and_keeps_dtypes_while_offloaded():
    """A None buffer (an FP8Linear without bias) is no tensor to move; an offloaded tensor keeps its
    dtype (peft and autocast read it), fp8 included."""
    from dit.block_offload import frozen_tensors

    m = torch.nn.Linear(4, 4)
    m.register_buffer("kept", torch.ones(2))
    m.register_buffer("absent", None)
    m.weight.requires_grad_(False)
    assert frozen_tensors(m) == [(m, "weight"), (m, "kept")]
    assert frozen_tensors(m, trainable=True) == [(m, "weight"), (m, "bias"), (m, "kept")]
    model = _lora_model(fp8=True)
    dtypes = {n: t.dtype for n, t in [*model.blocks[1].named_buffers(), *model.blocks[1].named_parameters()]}
    off = BlockOffloader(model.blocks, "cpu", 1, lambda: True)
    assert off.peak_blocks == 0
    for n, t in [*model.blocks[1].named_buffers(), *model.blocks[1].named_parameters()]:
        assert t.dtype == dtypes[n], n
    assert torch.float8_e4m3fn in dtypes.values()


def test_each_offloaded_block_is_copied_in_twice_and_freed_twice_a_step():
    """Forward and recompute: one copy in and one release each, no more (a block freed before its own
    recompute, or a backward prefetch in the wrong direction, copies again)."""
    from collections import Counter

    model = _lora_model(fp8=False)
    off = BlockOffloader(model.blocks, "cpu", 2, lambda: True)
    copies, releases = Counter(), Counter()
    onload, release = off._onload, off._release

    def counting_onload(i):
        copies[i] += i not in off._resident
        onload(i)

    def counting_release(i):
        releases[i] += i in off._resident
        release(i)

    off._onload, off._release = counting_onload, counting_release
    _step(model)
    assert copies == Counter({0: 2, 1: 2}) and releases == Counter({0: 2, 1: 2})
    assert off.device_bytes() == 0


def test_without_recompute_a_training_forward_keeps_its_blocks_and_a_no_grad_one_does_not():
    model = _lora_model(fp8=False)
    off = BlockOffloader(model.blocks, "cpu", 2, lambda: False)
    _step(model, grad=False)
    assert off.device_bytes() == 0  # sampling: each block freed after its forward
    model.gradient_checkpointing = False
    clips, texts, timesteps = batch()
    packed = pack(clips, model.patch_size)
    out = model(packed.tokens, packed.positions, packed.seq_lens, timesteps, torch.cat(texts),
                torch.tensor([t.shape[0] for t in texts]), PackedAttention(packed.seq_lens))  # fmt: skip
    assert off.device_bytes() == off.host_bytes()  # autograd saved them for the backward: kept
    out.sum().backward()


def test_offload_model_installs_per_mode():
    from types import SimpleNamespace

    from dit.block_offload import checkpoint_on_host, offload_model

    model = _lora_model(fp8=False)
    plain_fn = model.checkpoint_fn
    assert offload_model(model, SimpleNamespace(offload="none"), "cpu", 2) == []
    (off,) = offload_model(model, SimpleNamespace(offload="blocks"), "cpu", 1)
    assert off.swapped == {1} and model.checkpoint_fn is plain_fn
    model = _lora_model(fp8=False)
    offload_model(model, SimpleNamespace(offload="blocks+activations"), "cpu", 1)
    assert model.checkpoint_fn is checkpoint_on_host


def test_the_recompute_runs_the_block_on_the_input_brought_back():
    from dit.block_offload import _block_on_device

    x = torch.randn(3, 4)
    assert torch.equal(_block_on_device(lambda h, k: h * k, torch.device("cpu"), x, 2.0), x * 2)
