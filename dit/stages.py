"""A pipeline stage of the VideoDiT: the same model holding a contiguous range of its blocks.

Stage 0 also holds the embedders (patch, time, text, image) and the last stage the head (output
norm and projection, its shift/scale table). What a stage hands the next one is the hidden states x
and the embedded inputs every block reads (``CARRIED``: text context, modulation, time embedding,
image context); their gradients come back the same way. The embedders therefore live on stage 0
only, and their gradients are complete there (every later stage's use of the context, modulation
and temb flows back into them): no weight is on two stages and no cross-stage gradient sum is
needed, at the price of carrying (l + 7u + b*m) x D values per micro-batch beside x's n x D.

Everything else a block reads (RoPE, sequence offsets, per-token rows) is computed on each stage
from the micro-batch itself (``VideoDiT.frame``): every stage holds the same clips.

Parameter names stay global (``blocks.{i}``): a stage's state dict is the whole model's restricted
to what it holds, so checkpoints of stages merge into a whole model's. The model never talks to
other processes; ``dynamic_cp/runtime/pipeline.py`` moves the tensors.

Legend: n = packed tokens held here, b = clips, u = modulation rows (b, or distinct per-token
timesteps), l = text tokens, m = image tokens per clip, D = hidden width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from dit.model import BlockInputs, VideoDiT

CARRIED = ("context", "modulation", "temb", "image_context")


class NotOnThisStage(nn.Module):
    """Stands in for a module another stage holds: no parameters, and no forward."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is held by another pipeline stage")


def keep_stage(model: VideoDiT, layers: range, first: bool, last: bool) -> VideoDiT:
    """Drop, in place, every parameter a stage of ``layers`` does not hold (see the module doc);
    returns ``model``. Run it after the whole model is built and seeded, so each stage's weights are
    exactly the whole model's."""
    for i in range(len(model.blocks)):
        if i not in layers:
            model.blocks[i] = NotOnThisStage()
    if not first:
        model.patch_embedding = NotOnThisStage()
        ce = model.condition_embedder
        for name in ("time_embedder", "time_proj", "text_embedder", "image_embedder"):
            if hasattr(ce, name):
                setattr(ce, name, NotOnThisStage())
    if not last:
        model.proj_out = NotOnThisStage()
        del model.scale_shift_table
        model.register_parameter("scale_shift_table", None)
    return model


def held_blocks(model: VideoDiT) -> list[nn.Module]:
    """The blocks this model (a stage, or the whole model) holds, in order."""
    return [b for b in model.blocks if not isinstance(b, NotOnThisStage)]


def carried_shapes(
    model: VideoDiT, inputs: BlockInputs, num_tokens: int
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of what crosses a stage boundary for one micro-batch: x, then ``CARRIED`` (the
    image context only for image-conditioned models). All follow from the micro-batch's frame, so a
    receiver allocates its buffers without being told any shape."""
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    u = inputs.seq_lens.shape[0] if inputs.rows is None else int(inputs.rows.max()) + 1 if num_tokens else 0
    shapes = [
        ("x", (num_tokens, dim)),
        ("context", (int(inputs.text_cu_seqlens[-1]), dim)),
        ("modulation", (u, 6, dim)),
        ("temb", (u, dim)),
    ]
    if inputs.image_cu_seqlens is not None:
        shapes.append(("image_context", (int(inputs.image_cu_seqlens[-1]), dim)))
    return shapes


def stage_frame(model: VideoDiT, args: tuple, extra: dict) -> BlockInputs:
    """The no-gradient block inputs of a micro-batch (``micro_batch_inputs``' ``args``, ``extra``)."""
    _, positions, seq_lens, timesteps, _, text_lens = args
    image, token_timesteps = extra.get("image"), extra.get("token_timesteps")
    return model.frame(positions, seq_lens, timesteps, text_lens, image, token_timesteps)[0]


@dataclass
class StagePart:
    """One stage's part of ``VideoDiT.forward``: ``model(*args, attention, **extra, stage=part)``
    returns (the prediction (n, p_out) on the last stage, else x (n, D) after this stage's blocks;
    the block inputs, to hand on).

    received: (x, block inputs with ``CARRIED`` set) from the stage before; None on the first stage,
    which embeds them. The blocks run exactly as in the whole forward, so a pipeline of stages
    computes the whole model's numbers."""

    layers: range
    first: bool
    last: bool
    received: tuple[torch.Tensor, BlockInputs] | None = None

    def __call__(
        self, model: VideoDiT, args: tuple, attention, extra: dict
    ) -> tuple[torch.Tensor, BlockInputs]:
        if self.first:
            x, inputs = model.embed(*args, **extra)
        else:
            x, inputs = self.received
        x = model.run_blocks(x, inputs, attention, self.layers)
        return (model.head(x, inputs) if self.last else x), inputs
