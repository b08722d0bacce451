"""Model FLOPs of a training step, for the tokens/s and MFU figures in the logs.

Per layer and token, forward: 12 D^2 (self-attention q/k/v/o, cross-attention q/o) + 4 D F (FFN);
attention adds 4 n^2 D per clip of n tokens (bidirectional: no causal halving). Training is about
3x forward. Cross-attention's text-side k/v projections are left out (text is short).
"""

from __future__ import annotations

from collections.abc import Sequence


def train_step_flops(seq_lens: Sequence[int], dim: int, ffn_dim: int, num_layers: int) -> float:
    linear = sum(seq_lens) * (12 * dim * dim + 4 * dim * ffn_dim)
    attention = sum(4 * n * n * dim for n in seq_lens)
    return 3.0 * num_layers * (linear + attention)
