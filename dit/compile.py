"""``model.compile: true``: torch.compile each transformer block, as torchtitan does.

Per block, not the whole model: one block's graph is small, compiles once and serves every layer
(blocks share code, and dynamo passes their parameters in as inputs), and the model's Python around
the blocks (packing, RoPE tables, CP sharding) stays eager.

Packed micro-batches change shape every step: n tokens, b clips and l text tokens all vary. Compiling
with ``dynamic=True`` makes those sizes symbolic from the first compile, so a new packing reuses the
graph instead of recompiling. Dynamo still specializes a symbolic size on 0 and 1, so b and l enter
as unbacked sizes (``_training_graphs_only``), which it never specializes: a one-clip micro-batch
shares the graph of the others. Passes under ``no_grad`` (validation, samples) run eagerly, since a
graph of theirs would never serve training (tests/test_compile.py counts the recompiles torch logs
over 30 steps of mixed packings).

Attention stays eager (``dit.model.eager_attention`` is a graph break): CP collectives never enter a
compiled region, and the per-clip loops of the varlen kernels are not unrolled into the graph. What
compiles is the rest of the block: projections, norms, RoPE, modulation, FFN, which is where the
small fused elementwise kernels pay off.

``nn.Module.compile`` compiles in place, so parameter names (and so checkpoints, EMA, LoRA) are those
of the eager model.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from dit.model import VideoDiT


def _training_graphs_only(compiled: Callable, eager: Callable) -> Callable:
    """The block as training calls it: ``compiled`` under autograd, ``eager`` under ``no_grad``.

    Dynamo guards on the grad mode, so a forward under ``no_grad`` (validation at step 0, samples)
    would compile a graph of its own for every frame, which no training step ever reuses; those
    passes run eagerly instead.

    Compiled calls get the clip count b and the text length l of their arguments as unbacked sizes:
    dynamo specializes a backed size on 0 and 1 (a one-clip micro-batch, a one-token text would each
    compile a graph of their own); an unbacked one never is, so every packing shares one graph. The
    block's code reads them only where that is safe (``guard_or_false`` in ``dit.model.per_token``).
    ``modulation`` arrives as a view of the time projection's (b, 6 D) output, and dynamo makes a view's
    base a graph input of its own, whose b it specializes (``2 <= modulation._base.size()[0]`` after a
    first micro-batch of several clips); a copy has no base.
    """

    def call(x, text, modulation, rope, seq_lens, cu_seqlens, text_cu_seqlens, *rest, **kwargs):
        if not torch.is_grad_enabled():
            return eager(x, text, modulation, rope, seq_lens, cu_seqlens, text_cu_seqlens, *rest, **kwargs)
        modulation = modulation.clone() if modulation._base is not None else modulation
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
        # _call_impl: the eager call with the module's hooks (FSDP's among them), as compile wraps it
        block._compiled_call_impl = _training_graphs_only(block._compiled_call_impl, block._call_impl)
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


@contextlib.contextmanager
def logged_recompiles() -> Iterator[list[str]]:
    """The recompiles torch reports under ``TORCH_LOGS=recompiles``, collected while inside: one message
    per frame recompiled ("Recompiling function ... triggered by ..."), kept in the yielded list and
    not printed."""
    import torch._dynamo.guards as guards

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    log, handler = guards.recompiles_log, Collect(logging.DEBUG)
    enabled, level, propagate = guards.is_recompiles_enabled, log.level, log.propagate
    guards.is_recompiles_enabled = lambda: True  # what TORCH_LOGS=recompiles switches on
    log.setLevel(logging.DEBUG)
    log.propagate = False
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
        guards.is_recompiles_enabled = enabled
