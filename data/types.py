"""What every dataset in data/ yields, and the metadata the planner reads before any pixels load.

A dataset is a ``torch.utils.data.Dataset`` with two extra methods:

    meta(i) -> ClipMeta      the shape the clip will have after the clip policy, read from metadata only
    __getitem__(i) -> dict   one of the two sample kinds below

Pixel samples:  {"video": (c, f, h, w) float32 in [-1, 1], "caption": str, "index": int}
Latent samples: {"latent": (c', f', h', w') float32, "text_emb": (l, d) float32, "index": int}

``f, h, w`` of a pixel sample equal ``meta(i)``; the token count therefore follows from ``meta(i)``
(``data.tokens.num_tokens``) without decoding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClipMeta:
    """Shape of a clip as the model will see it in pixel space (after fps, frame and resolution policy)."""

    num_frames: int
    height: int
    width: int
