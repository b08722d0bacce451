"""The per-sample table of a latent cache as columns (numpy arrays in one safetensors file), read lazily.

At a million clips a JSON list of per-sample dicts is hundreds of MB parsed on every rank. Here each
field is one array, and a rank reads only what it touches: ``meta`` (the pixel shape the planner turns
into token counts, 12 bytes a clip) whole, every other field one row at a time through safetensors'
memory-mapped slices. Strings (caption, source) are UTF-8 bytes end to end with an offsets array.

    samples.safetensors
      meta          (n, 3) int32   pixel frames, height, width after the clip policy
      latent_shape  (n, 4) int32   (c', f', h', w')
      text_len      (n,)   int32
      key           (n,)   int64   the clip's dataset index: tensors "<key>.latent", "<key>.text_emb"
      chunk         (n,)   int32   its shard: SHARD.format(chunk)
      caption_bytes (total,) uint8, caption_offsets (n + 1,) int64; the same for source
"""

from __future__ import annotations

import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SAMPLES = "samples.safetensors"
SHARD = "shard-{:05d}.safetensors"
STRINGS = ("caption", "source")


def strings(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes of all strings end to end, and offsets: string i is bytes[offsets[i]:offsets[i + 1]]."""
    encoded = [v.encode("utf-8") for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), offsets


def columns(samples: list[dict]) -> dict[str, np.ndarray]:
    """``samples`` (dicts with key, chunk, meta, latent_shape, text_len, caption, source) -> columns."""
    n = len(samples)
    arrays = {
        "meta": np.array([s["meta"] for s in samples], dtype=np.int32).reshape(n, 3),
        "latent_shape": np.array([s["latent_shape"] for s in samples], dtype=np.int32).reshape(n, 4),
        "text_len": np.array([s["text_len"] for s in samples], dtype=np.int32),
        "key": np.array([int(s["key"]) for s in samples], dtype=np.int64),
        "chunk": np.array([s["chunk"] for s in samples], dtype=np.int32),
    }
    for name in STRINGS:
        arrays[f"{name}_bytes"], arrays[f"{name}_offsets"] = strings([s[name] for s in samples])
    return arrays


def save_columns(path: str, arrays: dict[str, np.ndarray]) -> None:
    tmp = path + ".tmp"
    save_file(arrays, tmp)
    os.replace(tmp, path)  # atomic: a reader never sees half a table


class ColumnSamples:
    """Sequence of per-sample dicts (the shape of a version-1 index's ``samples`` list), read lazily.

    ``meta`` is held whole (what planning needs); ``[i]`` reads row i from the memory-mapped file.
    The file is reopened in a forked DataLoader worker rather than shared."""

    def __init__(self, path: str):
        self.path = path
        self._handle, self._pid = None, None
        self.meta = self._file().get_tensor("meta")  # (n, 3) int32: every clip's pixel shape

    def _file(self):
        if self._pid != os.getpid():
            self._handle, self._pid = safe_open(self.path, framework="np"), os.getpid()
        return self._handle

    def __len__(self) -> int:
        return len(self.meta)

    def _row(self, name: str, i: int):
        return self._file().get_slice(name)[i : i + 1][0]

    def _string(self, name: str, i: int) -> str:
        start, end = (int(x) for x in self._file().get_slice(f"{name}_offsets")[i : i + 2])
        return (
            bytes(self._file().get_slice(f"{name}_bytes")[start:end]).decode("utf-8") if end > start else ""
        )

    def caption(self, i: int) -> str:
        return self._string("caption", i)

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return {
            "key": str(int(self._row("key", i))),
            "shard": SHARD.format(int(self._row("chunk", i))),
            "meta": [int(x) for x in self.meta[i]],
            "latent_shape": [int(x) for x in self._row("latent_shape", i)],
            "text_len": int(self._row("text_len", i)),
            "caption": self.caption(i),
            "source": self._string("source", i),
        }
