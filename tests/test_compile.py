"""``model.compile``: compiled blocks equal eager ones, and packed micro-batches of new lengths do not
recompile.

Inductor on CPU generates and compiles C++, which is slow on small machines, so the blocks are tiny
(2 heads x 16, FFN 64) and one test compiles with inductor; the recompile count is dynamo's business
(guards on sizes), which the ``aot_eager`` backend exercises the same way without generating code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from dit.attention import PackedAttention, cu_seqlens_from_lengths
from dit.batching import GlobalBatchSampler, pack_by_token_budget
from dit.compile import compile_blocks, frame_recompiles, recompiles
from dit.config import load_config
from dit.model import DiTBlock
from dit.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _block_inputs(seq_lens: list[int], dim: int, heads: int, text_len: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, b = sum(seq_lens), len(seq_lens)
    head_dim = dim // heads
    angles = torch.rand(n, 1, head_dim, generator=g) * 6.28
    return dict(
        x=torch.randn(n, dim, generator=g),
        text=torch.randn(b * text_len, dim, generator=g),
        modulation=torch.randn(b, 6, dim, generator=g),
        rope=(angles.cos(), angles.sin()),
        seq_lens=torch.tensor(seq_lens),
        cu_seqlens=cu_seqlens_from_lengths(seq_lens),
        text_cu_seqlens=cu_seqlens_from_lengths([text_len] * b),
        attention=PackedAttention(seq_lens),
    )


def _fwd_bwd(block: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, dict, torch.Tensor]:
    x = inputs["x"].clone().requires_grad_(True)
    out = block(**{**inputs, "x": x})
    # a fixed random cotangent: sum() would give every output the same weight and hide sign errors
    g = torch.Generator().manual_seed(1)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    return out.detach(), grads, x.grad


def test_compiled_block_equals_eager_on_packed_clips(monkeypatch):
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)  # no worker pool to start
    torch.manual_seed(0)
    eager = DiTBlock(32, 64, heads=2, eps=1e-6, qk_norm=True, cross_attn_norm=True)
    with torch.no_grad():  # adaLN-Zero gates would zero both branches and hide them
        eager.scale_shift_table.normal_()
    compiled = DiTBlock(32, 64, heads=2, eps=1e-6, qk_norm=True, cross_attn_norm=True)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend="inductor", dynamic=True)
    inputs = _block_inputs([7, 1, 12], dim=32, heads=2)  # odd lengths, a one-token clip
    out_e, grads_e, dx_e = _fwd_bwd(eager, inputs)
    out_c, grads_c, dx_c = _fwd_bwd(compiled, inputs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_c, dx_e, rtol=1e-5, atol=1e-5)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_config_compile_compiles_blocks_in_place():
    cfg = load_config(CONFIG, ["model.compile=true", "output_dir=/tmp/unused", "data.num_clips=8"])
    trainer = Trainer(cfg, device=torch.device("cpu"))
    names = {n for n, _ in trainer.model.named_parameters()}
    assert all(block._compiled_call_impl is not None for block in trainer.model.blocks)
    assert not any("_orig_mod" in n for n in names), "compile must keep checkpoint names"
    assert trainer.ema is None or trainer.ema.model.blocks[0]._compiled_call_impl is None


def test_thirty_steps_of_new_packings_recompile_at_most_three_times(tmp_path):
    overrides = [
        f"output_dir={tmp_path}",
        "model.overrides={num_layers: 2, num_attention_heads: 2, attention_head_dim: 16, ffn_dim: 64, "
        "patch_size: [1, 4, 4]}",
        "data.num_clips=64",
        "data.frame_counts=[1, 3, 5, 7]",  # x 16, 12 or 24 tokens a frame: clips of 12 to 168 tokens
        "data.resolutions=[[16, 16], [16, 12], [24, 16]]",
        "train.global_batch_size=4",
        "train.micro_batch_tokens=64",  # micro-batches of 1 to 4 clips
        "train.ema_decay=0",
    ]
    cfg = load_config(CONFIG, overrides)
    trainer = Trainer(cfg, device=torch.device("cpu"))
    compile_blocks(trainer.model, backend="aot_eager")
    sampler = GlobalBatchSampler(trainer.train_indices, cfg.train.global_batch_size, cfg.data.seed)
    micro_batches = set()  # (tokens per clip) of every micro-batch run
    for step in range(30):
        clips = trainer.prepare([trainer.train_set[i] for i in sampler.batch(step)], step)
        trainer.train_step(clips)
        lengths = [c.num_tokens for c in clips]
        for group in pack_by_token_budget(lengths, cfg.train.micro_batch_tokens):
            micro_batches.add(tuple(lengths[i] for i in group))
    shapes = {(len(m), sum(m)) for m in micro_batches}
    assert len(shapes) >= 10 and {len(m) for m in micro_batches} >= {1, 2}, (
        f"too few distinct micro-batch shapes for the test to prove anything: {sorted(shapes)}"
    )
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1, "nothing was compiled"
    print(
        f"{recompiles()} block recompiles ({frame_recompiles()} frame recompiles), {graphs} graphs over {len(shapes)} micro-batch shapes"
    )
    # per block and summed over the block's frames (it has two graph breaks, at the attention calls)
    assert recompiles() <= 3, f"{recompiles()} recompiles over {len(shapes)} micro-batch shapes"
    assert frame_recompiles() <= 3, f"{frame_recompiles()} frame recompiles over {len(shapes)} shapes"
