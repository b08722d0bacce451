"""fsdp.py's pieces on a one-rank gloo world, in this process (fast; the mutation tool's subset).

With one rank a shard is the whole tensor and a reduce-scatter is the identity, so the per_step and
per_layer schedules must give the gradients of the unsharded model: what FSDP adds (unit order, the
knobs of each schedule, SUM reduction with divide factor 1, the empty micro-batch, clipping by the
global norm, the sharded EMA, bytes at rest) is checked against plain tensors. Multi-rank parity,
uneven plans and resume are in tests/test_fsdp.py (spawned gloo ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dit.config import load_config
from dit.model_config import ModelConfig
from dit.setup import build_model
from dynamic_cp.runtime import fsdp

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = tmp_path_factory.mktemp("fsdp_one_rank") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    model = build_model(ModelConfig(size="tiny", overrides={"num_layers": 2, "ffn_dim": 32}))
    with torch.no_grad():  # away from the zero-initialised output head, so every weight gets a gradient
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _attention(q, k, v):  # one clip: (n, h, d) -> (n, h, d)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(
        0, 1
    )


def _loss(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    f, h, w = 2, 2, 3
    n = f * h * w
    positions = torch.stack(
        torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1
    )
    tokens = torch.randn(n, model.patch_embedding.in_features, generator=g)
    text = torch.randn(4, model.config.text_dim, generator=g)
    pred = model(
        tokens,
        positions.reshape(n, 3),
        torch.tensor([n]),
        torch.tensor([500.0]),
        text,
        torch.tensor([4]),
        _attention,
    )
    return (pred.float() ** 2).mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _reference_grads(model) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    _loss(ref).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _assert_grads(model, want):
    # one rank: the same float32 operations in the same order as the unsharded model
    for n, p in model.named_parameters():
        torch.testing.assert_close(_full(p.grad), want[n], rtol=1e-6, atol=1e-9, msg=n)


def test_per_step_schedule_gives_the_unsharded_gradients(world):
    model = _model()
    want = _reference_grads(model)
    fsdp.apply_fsdp(model, world, CPU, "bf16")  # bf16 on CPU: fp32 weights (autocast casts there)
    assert fsdp.fsdp_units(model) == [model, *model.blocks]
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())
    fsdp.configure(model, keep_gathered=True, free_after_backward=False, sync=False, last_backward=False)
    fsdp.gather_weights(model)
    _loss(model).backward()
    fsdp.configure(model, keep_gathered=True, free_after_backward=True, sync=True, last_backward=True)
    empty = fsdp.empty_micro_batch_loss(model, CPU)
    assert empty.item() == 0.0 and empty.requires_grad
    empty.backward()
    _assert_grads(model, want)


def test_per_layer_schedule_and_an_empty_round_add_nothing(world):
    model = _model()
    want = _reference_grads(model)
    fsdp.apply_fsdp(model, world, CPU, "no")
    peak = [0]
    fsdp.track_gathered_peak(model, peak)
    fsdp.configure(model, keep_gathered=False, free_after_backward=True, sync=True, last_backward=False)
    own = {n: p.nbytes for n, p in model.named_parameters()}  # one rank: a shard is the whole tensor
    root = sum(b for n, b in own.items() if not n.startswith("blocks."))
    block = sum(b for n, b in own.items() if n.startswith("blocks.0."))
    _loss(model).backward()
    # at most the root (gathered through the pass) and one block: gathered (plain) bytes, not shards
    # (planted: the hook counting the DTensor shards instead -> this fails)
    assert peak[0] == root + block
    fsdp.configure(model, keep_gathered=False, free_after_backward=True, sync=True, last_backward=True)
    fsdp.empty_micro_batch_loss(model, CPU).backward()  # a round this rank has nothing in
    _assert_grads(model, want)
    fsdp.gather_weights(model)
    fsdp.release_weights(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_a_round_with_only_the_empty_micro_batch_reduce_scatters_every_parameter(world):
    """A rank whose first round is empty: the zero-token forward leaves some parameters out of the
    graph (24 of the tiny model's), yet every parameter joins the reduce-scatter (as zeros), so the
    collective's size does not depend on which clips a rank ran; each ``.grad`` is then a zero shard.
    Planted: ``set_reduce_scatter_unused_params(False)`` (those gradients stay None; on several ranks
    the collectives' sizes would differ) -> this test fails."""
    model = _model()
    fsdp.apply_fsdp(model, world, CPU, "no")
    fsdp.configure(model, keep_gathered=False, free_after_backward=True, sync=True, last_backward=True)
    fsdp.empty_micro_batch_loss(model, CPU).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        assert not _full(p.grad).any(), n


def test_clip_by_the_global_norm_and_bytes_at_rest(world):
    model = _model()
    want = _reference_grads(model)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()]))
    fsdp.apply_fsdp(model, world, CPU, "no")
    _loss(model).backward()
    params = list(model.parameters())
    total = fsdp.grad_norm_and_clip(params, max_norm=0.5 * float(norm))
    assert not isinstance(total, DTensor)
    torch.testing.assert_close(total, norm, rtol=1e-5, atol=0)
    for n, p in model.named_parameters():  # scaled by max_norm / norm (torch adds 1e-6 to the norm)
        torch.testing.assert_close(_full(p.grad), 0.5 * want[n], rtol=1e-5, atol=1e-9, msg=n)
    optimizer = torch.optim.AdamW(params)
    optimizer.step()
    size = sum(p.numel() for p in want.values()) * 4
    assert fsdp.bytes_at_rest(model, optimizer) == {"params": size, "grads": size, "optim": 2 * size}


def test_sharded_ema_moves_one_minus_decay_and_gathers_on_the_main_rank(world):
    model = _model()
    fsdp.apply_fsdp(model, world, CPU, "no")
    ema = fsdp.ShardedEMA(model, decay=0.75)
    old = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    full = ema.full_state_dict(is_main=True)
    assert sorted(full) == sorted(old)
    for n, t in full.items():
        assert not isinstance(t, DTensor) and t.device == CPU
        torch.testing.assert_close(t, old[n] + 0.25, rtol=0, atol=1e-6)
    assert ema.full_state_dict(is_main=False) == {}


def test_mixed_precision_policy_and_memory_per_rank(monkeypatch):
    cpu = fsdp.mixed_precision_policy(CPU, "bf16")
    assert (cpu.param_dtype, cpu.reduce_dtype) == (None, torch.float32)
    cuda = torch.device("cuda")
    assert fsdp.mixed_precision_policy(cuda, "bf16").param_dtype == torch.bfloat16
    assert fsdp.mixed_precision_policy(cuda, "auto").param_dtype == torch.bfloat16
    assert fsdp.mixed_precision_policy(cuda, "no").param_dtype is None
    assert fsdp.memory_per_rank(load_config(None, ["parallel.memory_gb=2.5"])) == 2.5e9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert fsdp.memory_per_rank(load_config(None, [])) == ram
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # the node's RAM shared by its ranks
    assert fsdp.memory_per_rank(load_config(None, [])) == ram / 4


def test_auto_prices_a_lora_run_with_its_adapter_ema():
    from dynamic_cp.planning.memory import memory_breakdown

    cfg = load_config(
        None, ["model.lora={rank: 8}", "train.ema_decay=0.9", "model.gradient_checkpointing=true"]
    )
    dims = fsdp.model_dims_of(cfg)
    mode, expected, cap = fsdp.auto_fsdp_choice(cfg, 4, 1e12)
    want = memory_breakdown(dims, "lora", 4, cap, True, ema=True, lora_rank=8)
    assert (mode, expected, cap) == ("none", want.total, cfg.train.micro_batch_tokens)
    assert want.ema > 0  # the adapters' fp32 average is counted


def test_memory_per_rank_on_a_gpu_is_the_devices_memory(monkeypatch):
    """On CUDA without ``parallel.memory_gb`` a rank may use its device's whole memory (this machine has
    no GPU: torch.cuda's two calls answer as an 80 GB device would). Planted: that branch returning
    None, the memory as an int -> this test fails."""

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties)
    memory = fsdp.memory_per_rank(load_config(None, []))
    assert memory == 80 * 2**30 and isinstance(memory, float)
    assert fsdp.memory_per_rank(load_config(None, ["parallel.memory_gb=2.5"])) == 2.5e9  # the knob first


@pytest.mark.parametrize("lora", [False, True])
def test_auto_prices_the_ema_only_when_the_run_keeps_one(lora):
    """``train.ema_decay=0`` keeps no EMA: ``auto`` prices the run without its bytes (a full or adapter
    copy in fp32), 0.9 with them, in the replicated-LoRA and the choosing path alike. Planted:
    ``ema_decay > 0`` as ``>= 0`` (an EMA priced for every run) -> this test fails."""
    from dynamic_cp.planning.memory import choose_fsdp_mode, memory_breakdown

    items = ["model.lora={rank: 8}"] if lora else []
    priced = {}
    for decay in (0.0, 0.9):
        cfg = load_config(None, [*items, f"train.ema_decay={decay}"])
        mode, expected, cap = fsdp.auto_fsdp_choice(cfg, 4, 1e12)
        dims = fsdp.model_dims_of(cfg)
        if lora:
            want = memory_breakdown(dims, "lora", 4, cap, False, ema=decay > 0, lora_rank=8).total
        else:
            want = choose_fsdp_mode(dims, 4, cap, 1e12, False, ema=decay > 0)[1]
        assert expected == want
        priced[decay] = expected
    assert priced[0.0] < priced[0.9]


def test_auto_prices_replicated_adam_moments_when_the_optimizer_is_not_sharded():
    """``parallel.shard_optimizer=false`` keeps every rank's AdamW moments whole: ``auto`` prices them
    so (more bytes than ZeRO-1's 1/W), as ``choose_fsdp_mode(shard_optimizer=False)``. Planted: the
    knob not passed (``shard_optimizer=`` dropped: always sharded) -> this test fails."""
    from dynamic_cp.planning.memory import choose_fsdp_mode

    priced = {}
    for shard in (True, False):
        cfg = load_config(None, [f"parallel.shard_optimizer={str(shard).lower()}"])
        got = fsdp.auto_fsdp_choice(cfg, 4, 1e12)
        dims = fsdp.model_dims_of(cfg)
        assert got == choose_fsdp_mode(dims, 4, got[2], 1e12, False, shard_optimizer=shard, ema=True)
        priced[shard] = got[1]
    assert priced[False] > priced[True]


@pytest.mark.parametrize("idle", ["sharded", "cpu"])
def test_auto_prices_both_experts_of_a_two_expert_run(idle):
    """``model.expert=both`` holds two transformers: ``auto`` prices two experts (and where the idle one
    waits), as ``choose_fsdp_mode(experts=2, idle_expert=...)`` does; more than one expert's bytes
    when the idle one stays on the GPU. Planted: experts 3 for both, ``idle_expert`` dropped -> this
    test fails."""
    from dynamic_cp.planning.memory import choose_fsdp_mode

    both = ["model.expert=both", "model.boundary_ratio=0.875", f"model.idle_expert={idle}"]
    one = fsdp.auto_fsdp_choice(load_config(None, []), 4, 1e12)
    cfg = load_config(None, both)
    two = fsdp.auto_fsdp_choice(cfg, 4, 1e12)
    assert cfg.train.ema_decay > 0  # the default keeps an EMA (of each expert)
    dims = fsdp.model_dims_of(cfg)
    want = choose_fsdp_mode(dims, 4, two[2], 1e12, False, ema=True, experts=2, idle_expert=idle)
    assert two == want
    # on the host: only the idle expert's fp32 EMA stays on the GPU, 4 bytes a parameter
    extra = two[1] - one[1]
    assert extra > 4 * dims.num_params if idle == "sharded" else extra == pytest.approx(4 * dims.num_params)


@pytest.mark.parametrize("pos_embed_seq_len", [None, 4])
def test_the_empty_micro_batch_of_an_image_conditioned_model(pos_embed_seq_len):
    """An image-to-video model (``image_dim``; FLF2V: ``pos_embed_seq_len`` CLIP tokens of two images)
    needs each clip's image tokens even in a round where this rank has no micro-batch: the empty one
    passes one clip's zeros of the shape the model checks, and its loss is 0. Planted: the image as
    two clips' rows, FLF2V's 4 tokens as 1 (``or`` -> ``and``), the zeros call dropped -> this test
    fails (the model refuses the shape)."""
    dim = 128  # the tiny size's width: the image K/V must read it
    overrides = {"num_layers": 1, "ffn_dim": 32, "image_dim": 8, "added_kv_proj_dim": dim}
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(size="tiny", overrides={**overrides, "pos_embed_seq_len": pos_embed_seq_len})
    )
    loss = fsdp.empty_micro_batch_loss(model, CPU)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()


def _gathered(module) -> bool:
    return all(not isinstance(p, DTensor) for p in module.parameters())


def _root_own(model):
    return [p for n, p in model.named_parameters() if not n.startswith("blocks.")]


def test_per_step_keeps_the_weights_gathered_and_per_layer_frees_each_block_after_use(world):
    model = _model()
    assert fsdp.apply_fsdp(model, world, CPU, "no") is model  # sharded in place
    # per_step: gathered once, kept through forward and backward of the rank's micro-batches
    fsdp.configure(model, keep_gathered=True, free_after_backward=False, sync=False, last_backward=False)
    fsdp.gather_weights(model)
    loss = _loss(model)
    assert _gathered(model)
    loss.backward()
    assert _gathered(model)
    fsdp.release_weights(model)
    assert not any(_gathered(b) for b in model.blocks)
    # sync off on every unit: nothing was reduce-scattered (no world collective) before the sync pass
    assert all(p.grad is None for p in model.parameters())
    # per_layer: each block freed after its forward; the root stays gathered through the pass
    fsdp.configure(model, keep_gathered=False, free_after_backward=True, sync=True, last_backward=True)
    loss = _loss(model)
    assert not any(_gathered(b) for b in model.blocks)
    assert all(not isinstance(p, DTensor) for p in _root_own(model))
    loss.backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())  # freed after backward
