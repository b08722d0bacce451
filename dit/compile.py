"""``model.compile: true``: torch.compile each transformer block, as torchtitan does.

Per block, not the whole model: one block's graph is small, compiles once and serves every layer
(blocks share code, and dynamo passes their parameters in as inputs), and the model's Python around
the blocks (packing, RoPE tables, CP sharding) stays eager.

Packed micro-batches change shape every step: n tokens, b clips and l text tokens all vary. Compiling
with ``dynamic=True`` makes those sizes symbolic from the first compile, so a new packing reuses the
graph instead of recompiling. Dynamo still specializes a symbolic size on 0 and 1, so b and l enter
as unbacked sizes (``_unbacked_packing``), which it never specializes: a one-clip micro-batch shares
the graph of the others (30 steps of mixed packings: 1 recompile per frame at most, in the first
step; tests/test_compile.py).

Attention stays eager (``dit.model.eager_attention`` is a graph break): CP collectives never enter a
compiled region, and the per-clip loops of the varlen kernels are not unrolled into the graph. What
compiles is the rest of the block: projections, norms, RoPE, modulation, FFN, which is where the
small fused elementwise kernels pay off.

``nn.Module.compile`` compiles in place, so parameter names (and so checkpoints, EMA, LoRA) are those
of the eager model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dit.model import VideoDiT


def _unbacked_packing(compiled: Callable) -> Callable:
    """``compiled`` called with the clip count b and the text length l of its arguments as unbacked
    sizes: dynamo specializes a backed size on 0 and 1 (a one-clip micro-batch, a one-token text
    would each compile a graph of their own); an unbacked one never is, so every packing shares one
    graph. The block's code reads them only where that is safe (``guard_or_false`` in
    ``dit.model.per_token``)."""

    def call(x, text, modulation, rope, seq_lens, cu_seqlens, text_cu_seqlens, *rest, **kwargs):
        for t in (text, modulation, seq_lens, cu_seqlens, text_cu_seqlens):  # (l, D), (b, 6, D), (b,), (b+1,)
            torch._dynamo.decorators.mark_unbacked(t, 0)
        return compiled(x, text, modulation, rope, seq_lens, cu_seqlens, text_cu_seqlens, *rest, **kwargs)

    return call


def compile_blocks(model: VideoDiT, backend: str = "inductor") -> VideoDiT:
    """Compile every transformer block of ``model`` in place, with dynamic shapes; returns the model."""
    # Every block is one more frame that dynamo caches graphs for; the default cache limit (8) is
    # per code object and all blocks share DiTBlock.forward, so a few shapes never exhaust it.
    for block in model.blocks:
        block.compile(backend=backend, dynamic=True)  # sets _compiled_call_impl, what block(...) calls
        block._compiled_call_impl = _unbacked_packing(block._compiled_call_impl)
    return model


def recompiles() -> int:
    """How often the most-recompiled frame compiled beyond its first, since ``torch._dynamo.reset()``.

    A block with graph breaks runs as several frames (its forward and one resume function per
    break), and a new shape class recompiles each of them, so this counts block recompiles, not frame
    recompiles (``frame_recompiles`` sums those). Read from dynamo's per-frame compile counter;
    ``torch._dynamo.utils.counters`` has no recompile entry in torch 2.13.
    """
    from torch._dynamo.convert_frame import FRAME_COMPILE_COUNTER

    return max((n - 1 for n in FRAME_COMPILE_COUNTER.values()), default=0)


def frame_recompiles() -> int:
    """Compiles beyond the first, summed over all frames."""
    from torch._dynamo.convert_frame import FRAME_COMPILE_COUNTER

    return sum(max(0, n - 1) for n in FRAME_COMPILE_COUNTER.values())
