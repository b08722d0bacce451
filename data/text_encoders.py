"""Text encoders from a local folder: T5 or UMT5 encoders (Wan uses UMT5-XXL, Open-Sora T5-XXL).

    enc = load_text_encoder("umt5", "/ckpt/Wan2.1-T2V-1.3B-Diffusers", max_length=512)
    embs = enc.encode(["a dog", "a cat on a mat"])   # [(l_0, dim), (l_1, dim)], padding stripped

The folder holds the model (config.json + weights) and its tokenizer; a pipeline folder with
``text_encoder/`` and ``tokenizer/`` subfolders works too.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch

TEXT_KINDS = ("t5", "umt5", "hashed")


@runtime_checkable
class TextEncoder(Protocol):
    dim: int

    def encode(self, captions: list[str]) -> list[torch.Tensor]: ...


class HFTextEncoder:
    """A transformers encoder-only model; keeps the valid tokens of each caption (the EOS included)."""

    def __init__(self, model, tokenizer, max_length: int, device="cpu", dtype=torch.float32):
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.tokenizer, self.max_length = tokenizer, max_length
        self.device = torch.device(device)
        self.dim = int(model.config.d_model)

    @torch.no_grad()
    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        if isinstance(captions, str):
            raise ValueError("encode takes a list of captions; wrap a single caption as [caption]")
        tok = self.tokenizer(
            list(captions), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        mask = tok["attention_mask"].to(self.device)
        out = self.model(input_ids=tok["input_ids"].to(self.device), attention_mask=mask).last_hidden_state
        lengths = mask.sum(dim=1).tolist()
        # An empty caption still tokenizes to EOS, so every embedding has at least one row.
        return [out[i, : max(1, n)].float().cpu() for i, n in enumerate(lengths)]


def _sub(path: str, name: str) -> str:
    p = os.path.join(path, name)
    return p if os.path.isdir(p) else path


def load_text_encoder(
    kind: str,
    path: str | os.PathLike | None = None,
    max_length: int = 512,
    device: str = "cpu",
    dtype=torch.float32,
    hashed_dim: int = 64,
    seed: int = 0,
) -> TextEncoder:
    """A T5/UMT5 encoder and its tokenizer from a local folder (or the built-in ``hashed`` one, whose
    width and seed must be the model's text_dim and the run's data.seed to match training)."""
    if kind == "hashed":  # the built-in encoder of the tiny config (data/hashed_text.py): no folder needed
        from data.hashed_text import HashedTextEncoder

        return HashedTextEncoder(dim=hashed_dim, seed=seed)
    if kind not in TEXT_KINDS:
        raise ValueError(f"text encoder kind {kind!r} is unknown; use one of {TEXT_KINDS}")
    if path is None or not os.path.isdir(path):
        raise ValueError(
            f"text encoder {kind!r} needs a local folder with the model and tokenizer; got {path!r}"
        )
    if max_length < 1:
        raise ValueError(f"max_length={max_length}: use a positive token count, e.g. 512")
    path = str(path)
    import transformers  # heavy import: only when a real encoder is asked for

    cls = transformers.UMT5EncoderModel if kind == "umt5" else transformers.T5EncoderModel
    # transformers draws a "Loading weights" bar on stderr; start-up stays quiet (a CLI's stderr is
    # for its one-line errors)
    transformers.utils.logging.disable_progress_bar()
    model = cls.from_pretrained(_sub(path, "text_encoder"), dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(_sub(path, "tokenizer"))
    return HFTextEncoder(model, tokenizer, max_length, device, dtype)
