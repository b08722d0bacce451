"""A built-in text encoder for the tiny config: fixed random word vectors plus word-order signal.

It has no weights to download and nothing to train: each lower-case word maps to a vector drawn from
a generator seeded by the word's CRC32, so every process and every run agrees. The DiT's own text
projection learns what the words mean. It has the interface real encoders (T5/UMT5 from a local
path, ``data/text_encoders.py``) have: ``dim`` and ``encode(captions) -> [(l_i, dim)]``.
"""

from __future__ import annotations

import math
import re
import zlib

import torch


class HashedTextEncoder:
    def __init__(self, dim: int = 64, max_words: int = 64, seed: int = 0):
        if dim % 2:
            raise ValueError(f"text encoder dim must be even, got {dim}")
        self.dim = dim
        self.max_words = max_words
        self.seed = seed
        self._cache: dict[str, torch.Tensor] = {}
        position = torch.arange(max_words, dtype=torch.float32)[:, None]
        freq = torch.exp(-math.log(100.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.position_signal = torch.zeros(max_words, dim)  # (max_words, dim), small next to word vectors
        self.position_signal[:, 0::2] = 0.3 * torch.sin(position * freq)
        self.position_signal[:, 1::2] = 0.3 * torch.cos(position * freq)

    def _word(self, word: str) -> torch.Tensor:
        if word not in self._cache:
            g = torch.Generator().manual_seed(zlib.crc32(word.encode()) ^ self.seed)
            self._cache[word] = torch.randn(self.dim, generator=g)
        return self._cache[word]

    @torch.no_grad()
    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        out = []
        for caption in captions:
            words = re.findall(r"[a-z]+", caption.lower())[: self.max_words]
            if not words:
                # The empty caption (guidance's unconditional input) is one end-of-text row, as a
                # T5/UMT5 encoder keeps its EOS token: every caption has a token, so the text
                # projections take part in every step (no parameter is left without a gradient in
                # one path and with a zero one in another) and no micro-batch has zero-length text.
                out.append(self._word("<end>")[None])  # "<end>" is never a word: words are [a-z]+
                continue
            vectors = torch.stack([self._word(w) for w in words])
            out.append(vectors + self.position_signal[: len(words)])
        return out
