"""Read a latent + text-embedding cache written by ``python -m data.cache``.

``meta(i)`` is the clip's pixel-space shape from the index (so ``num_tokens(*meta, vae_stride)``
works as for a pixel dataset); ``__getitem__`` returns a latent sample. Shards open lazily, once per
process, so the dataset is safe to hand to DataLoader workers.
"""

from __future__ import annotations

import json
import os

from safetensors import safe_open
from torch.utils.data import Dataset

from data.cache_index import SAMPLES, ColumnSamples
from data.failures import FailureLog
from data.types import ClipMeta

# The cache format is the reader's: the writer (data.cache) imports these, never the other way.
FORMAT = "dcp-latent-cache"
# 2: the per-sample table moved from index.json to samples.safetensors (data/cache_index.py)
# 3: image-to-video conditioning ("image_condition" in the index; "<k>.image_latent", "<k>.image_emb")
VERSION = 3
INDEX = "index.json"
EMPTY_TEXT = "empty_text.safetensors"  # the text encoder's output for ""
SETTINGS = "settings.json"  # written first: a cache in progress, and the settings every shard must match


def is_cache(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX))


def check_not_partial(path: str) -> None:
    """A cache whose encoding was killed is not a folder of videos: say how to finish it."""
    if os.path.isfile(os.path.join(path, SETTINGS)) and not is_cache(path):
        raise ValueError(
            f"{path} is a partly written latent cache (no {INDEX} yet): finish it by rerunning "
            "python -m data.cache with the same arguments and --resume"
        )


class LatentCacheDataset(Dataset):
    def __init__(self, root: str, max_failure_share: float = 0.05):
        index_path = os.path.join(root, INDEX)
        if not os.path.isfile(index_path):
            raise ValueError(f"{root} has no {INDEX}: build the cache with python -m data.cache first")
        with open(index_path, encoding="utf-8") as f:
            self.index = json.load(f)
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{index_path} is not a {FORMAT} index (format={self.index.get('format')!r})")
        if self.index.get("version", 1) > VERSION:
            raise ValueError(
                f"{index_path} is a version {self.index['version']} cache; this code reads up to version "
                f"{VERSION}: update the code, or re-run python -m data.cache with this version"
            )
        self.root = root
        # version 1 listed every sample in index.json (still read); version 2 keeps them in columns
        self.samples = (
            self.index["samples"] if "samples" in self.index else ColumnSamples(os.path.join(root, SAMPLES))
        )
        if not self.samples:
            raise ValueError(f"{root}: the cache holds no samples; see 'failed' and 'skipped' in {INDEX}")
        self.vae_stride = tuple(self.index["vae"]["stride"])
        self.latent_channels = self.index["latent_channels"]
        self.text_dim = self.index["text_dim"]
        self.vae_kind = self.index["vae"]["kind"]
        # {"frames": "first" | "first-last", "image_dim": int | None}, or None: no image-to-video
        # conditioning (a text-to-video cache, or one written before version 3)
        self.image_condition = self.index.get("image_condition")
        empty = os.path.join(root, EMPTY_TEXT)
        # (l, d) embedding of the empty caption; None for caches written before it was stored
        self.empty_text_emb = (
            safe_open(empty, framework="pt").get_tensor("text_emb").float() if os.path.isfile(empty) else None
        )
        self.failures = FailureLog(total=len(self.samples), max_failure_share=max_failure_share)
        self._handles: dict[str, object] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.samples)

    def meta(self, i: int) -> ClipMeta:
        if isinstance(self.samples, ColumnSamples):
            return ClipMeta(*(int(x) for x in self.samples.meta[i]))  # no row read: planning is cheap
        return ClipMeta(*self.samples[i]["meta"])

    def caption(self, i: int) -> str:
        if isinstance(self.samples, ColumnSamples):
            return self.samples.caption(i)
        return self.samples[i]["caption"]

    def _shard(self, name: str):
        if os.getpid() != self._pid:  # a forked worker must not share the parent's file handles
            self._handles, self._pid = {}, os.getpid()
        if name not in self._handles:
            self._handles[name] = safe_open(os.path.join(self.root, name), framework="pt")
        return self._handles[name]

    def load(self, i: int) -> dict:
        s = self.samples[i]
        shard = self._shard(s["shard"])
        latent = shard.get_tensor(f"{s['key']}.latent").float()  # (c', f', h', w')
        text_emb = shard.get_tensor(f"{s['key']}.text_emb").float()  # (l, d)
        if list(latent.shape) != s["latent_shape"]:
            raise ValueError(
                f"latent of sample {i} has shape {list(latent.shape)}, index says {s['latent_shape']}"
            )
        out = {"latent": latent, "text_emb": text_emb, "index": i}
        if self.image_condition is not None:  # the mask is not stored: dit/clips.py builds it
            out["image_latent"] = shard.get_tensor(f"{s['key']}.image_latent").float()  # (c', f', h', w')
            if out["image_latent"].shape != latent.shape:
                raise ValueError(
                    f"image latent of sample {i} has shape {list(out['image_latent'].shape)}, its latent "
                    f"{list(latent.shape)}"
                )
            if self.image_condition["image_dim"] is not None:
                out["image_emb"] = shard.get_tensor(f"{s['key']}.image_emb").float()  # (m, image_dim)
        return out

    def __getitem__(self, i: int) -> dict:
        try:
            return self.load(i)
        except Exception as e:  # a damaged shard: count it, substitute a sample of the same shape
            path = os.path.join(self.root, self.samples[i]["shard"])
            self.failures.fail(path, "cache_read_error", str(e)[:200])
            target = self.meta(i)
            for k in range(1, len(self)):
                j = (i + k) % len(self)
                if self.meta(j) != target:
                    continue
                try:
                    sample = self.load(j)
                except Exception:
                    continue
                sample["index"] = i
                sample["failures"] = [(path, "cache_read_error")]
                return sample
            raise RuntimeError(f"cache sample {i} is unreadable and no sample has its shape {target}") from e
