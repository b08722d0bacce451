"""Plug in your own dataset class by name: ``source="my_pkg.my_module:MyDataset"``.

The class is built as ``MyDataset(**plugin_args)`` and needs ``__len__`` and ``__getitem__(i)``
returning either a clip and caption
    {"video": (3, f, h, w) float in [-1, 1]  or  (f, h, w, 3) uint8, "caption": str}
or precomputed latents and text embeddings
    {"latent": (c', f', h', w'), "text_emb": (l, d)}.
``meta(i) -> ClipMeta`` (pixel-space shape) is optional but strongly advised: without it the
wrapper loads sample i once to learn its shape, and the planner waits on that. The wrapper checks
every sample against ``meta(i)`` so a wrong shape fails loudly instead of corrupting a plan.
"""

from __future__ import annotations

import importlib

import torch
from torch.utils.data import Dataset

from data.tokens import latent_shape
from data.types import ClipMeta


def is_plugin(source: str) -> bool:
    module, _, name = source.partition(":")
    return bool(module and name) and "/" not in module and "\\" not in module and name.isidentifier()


def load_class(source: str):
    module_name, _, class_name = source.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"data source {source!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    if not hasattr(module, class_name):
        raise ValueError(f"data source {source!r}: module {module_name!r} has no {class_name!r}")
    return getattr(module, class_name)


class PluginDataset(Dataset):
    """Wraps a user dataset: adds ``index``, converts uint8 clips, checks shapes against ``meta``."""

    def __init__(self, source: str, vae_stride: tuple[int, int, int] = (1, 1, 1), **plugin_args):
        self.source = source
        self.inner = load_class(source)(**plugin_args)
        self.vae_stride = tuple(getattr(self.inner, "vae_stride", vae_stride))
        """Latent samples: the stride that maps ``meta`` to the latent shape (the plug-in may set it)."""
        self._metas: dict[int, ClipMeta] = {}
        if len(self.inner) == 0:
            raise ValueError(f"data source {source!r} has no samples (len() == 0)")

    def __len__(self) -> int:
        return len(self.inner)

    def meta(self, i: int) -> ClipMeta:
        if hasattr(self.inner, "meta"):
            return self.inner.meta(i)
        if i not in self._metas:  # no metadata from the plug-in: learn the shape from the sample
            s = self._convert(self.inner[i])
            if "video" in s:
                self._metas[i] = ClipMeta(*s["video"].shape[1:])
            else:
                raise ValueError(
                    f"{self.source}: latent samples need a meta(i) method giving the pixel shape"
                )
        return self._metas[i]

    @staticmethod
    def _convert(sample: dict) -> dict:
        video = sample.get("video")
        if video is not None:
            video = torch.as_tensor(video)
            if video.dtype == torch.uint8:  # (f, h, w, 3) uint8 as readers and numpy produce
                video = video.permute(3, 0, 1, 2).float() / 127.5 - 1.0
            sample["video"] = video.float()
        return sample

    def __getitem__(self, i: int) -> dict:
        sample = self._convert(dict(self.inner[i]))
        meta = self.meta(i)
        if "video" in sample:
            if "caption" not in sample:
                raise ValueError(f"{self.source}[{i}]: a clip sample needs a 'caption' (use '' for none)")
            got = tuple(sample["video"].shape)
            if got[0] != 3 or got[1:] != (meta.num_frames, meta.height, meta.width):
                raise ValueError(
                    f"{self.source}[{i}]: video of shape {got}, meta says (3, {meta.num_frames}, {meta.height}, {meta.width})"
                )
        elif "latent" in sample and "text_emb" in sample:
            want = latent_shape(meta.num_frames, meta.height, meta.width, self.vae_stride)
            if tuple(sample["latent"].shape[1:]) != want:
                raise ValueError(
                    f"{self.source}[{i}]: latent of shape {tuple(sample['latent'].shape)}, meta {meta} "
                    f"with vae_stride {self.vae_stride} says (c, {want[0]}, {want[1]}, {want[2]})"
                )
            sample["latent"], sample["text_emb"] = sample["latent"].float(), sample["text_emb"].float()
        else:
            raise ValueError(
                f"{self.source}[{i}]: return {{'video', 'caption'}} or {{'latent', 'text_emb'}}, got {sorted(sample)}"
            )
        sample["index"] = i
        return sample
