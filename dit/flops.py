"""Model FLOPs (forward, 2 per multiply-add), shared by the logs' TFLOP/s and MFU and by the planner's
cost model (dynamic_cp/planning/cost_model.py), so the two count the same work.

Per layer: 12 D^2 + 4 D F per token (self-attention q/k/v/o, cross-attention q/o, FFN); 4 n^2 D for the
bidirectional self-attention of a clip of n tokens (no causal halving); 4 T D^2 per clip for the
cross-attention k/v of its T text tokens. Training is about 3x forward for the linear layers.
Once per token, outside the layers: 2 D p for the patch embedding and the output projection, p = the
values a token carries in plus out (pt*ph*pw*(in + out channels): Wan2.1 128, Wan2.2 TI2V-5B 384).
"""

from __future__ import annotations

from collections.abc import Sequence


def linear_flops_per_token(dim: int, ffn_dim: int) -> int:
    return 12 * dim * dim + 4 * dim * ffn_dim


def patch_flops_per_token(dim: int, patch_values: int) -> int:
    """Patch embedding (p_in -> D) and output projection (D -> p_out), p = p_in + p_out."""
    return 2 * dim * patch_values


def attention_flops(num_tokens: int, dim: int) -> int:
    return 4 * num_tokens * num_tokens * dim


def text_kv_flops(text_tokens: int, dim: int) -> int:
    return 4 * text_tokens * dim * dim


def train_step_flops(seq_lens: Sequence[int], dim: int, ffn_dim: int, num_layers: int) -> float:
    """Training FLOPs of a step (3x forward); text k/v left out, as the text is short next to video."""
    linear = sum(seq_lens) * linear_flops_per_token(dim, ffn_dim)
    attention = sum(attention_flops(n, dim) for n in seq_lens)
    return 3.0 * num_layers * (linear + attention)
