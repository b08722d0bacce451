"""One entry point from config to dataset: ``build_dataset(source, **options)``.

source:
    "synthetic"                 built-in procedural clips (data/synthetic.py)
    a folder                    every video under it, captions from sidecar <name>.txt
    a .csv / .jsonl manifest    Open-Sora columns path,text,num_frames,height,width,fps
    a cache folder              written by python -m data.cache (has index.json): latent samples
    "pkg.module:ClassName"      your own dataset class (data/plugin.py)

options: the ClipPolicy fields (data/clip_policy.py) for folders and manifests, plus the ones in
``LOADING_OPTIONS``. docs/data.md lists them all with defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

from data.clip_policy import ClipPolicy
from data.manifest import MANIFEST_EXTS

POLICY_OPTIONS = tuple(f.name for f in dataclasses.fields(ClipPolicy))
LOADING_OPTIONS = {
    "max_failure_share": "share of broken files above which the run stops (default 0.05)",
    "backend": "the deprecated name of 'reader'",
    "probe_workers": "threads that probe files lacking metadata (default 8)",
    "progress": "show a progress bar while probing (default True)",
    "plugin_args": "dict of keyword arguments for a plug-in class",
}
# Options every source accepts, because a trainer passes them whatever the source is.
SHAPE_OPTIONS = ("vae_stride", "patch")
# The video reader (data.reader): 'auto' (torchcodec, else decord, else PyAV), 'torchcodec', 'decord' or
# 'pyav'. Every source accepts it too; only folders and manifests decode videos.
READER_OPTION = "reader"


def _unknown(source: str, options: dict, allowed) -> None:
    extra = sorted(set(options) - set(allowed))
    if extra:
        raise ValueError(
            f"data source {source!r} does not take option(s) {extra}; it takes {sorted(allowed)}"
        )


def build_dataset(source: str, **options):
    """A dataset with ``meta(i)`` and ``__getitem__(i)`` as in data/types.py."""
    if not isinstance(source, str) or not source:
        raise ValueError(
            "data.source is empty: use 'synthetic', a folder, a .csv/.jsonl/.parquet manifest, a cache folder or pkg.module:Class"
        )
    if options.get(READER_OPTION) is not None:  # checked for every source, as the config checks it
        from data.readers import choose_reader

        choose_reader(options[READER_OPTION], None)
    if source == "synthetic":
        from data.synthetic import SyntheticClips  # the lead's module; imported only when asked for

        takes = [p for p in inspect.signature(SyntheticClips).parameters if p != "self"]
        _unknown(source, options, list(takes) + list(SHAPE_OPTIONS) + [READER_OPTION])
        return SyntheticClips(**{k: v for k, v in options.items() if k in takes})

    if os.path.isdir(source):
        from data.cache_dataset import check_not_partial, is_cache

        if is_cache(source):
            return _cache(source, options)
        check_not_partial(source)
        from data.manifest import list_folder

        return _videos(source, list_folder(source), options)

    if source.endswith(MANIFEST_EXTS):
        if not os.path.isfile(source):
            raise ValueError(
                f"manifest {source} does not exist; check data.source (relative paths start at the working directory)"
            )
        from data.manifest_table import read_table

        return _videos(source, read_table(source), options)

    from data.plugin import PluginDataset, is_plugin

    if is_plugin(source):
        _unknown(source, options, ("plugin_args", "vae_stride", "patch", READER_OPTION))
        stride = options.get("vae_stride")
        extra = {"vae_stride": tuple(stride)} if stride is not None else {}
        return PluginDataset(source, **extra, **(options.get("plugin_args") or {}))
    raise ValueError(
        f"data source {source!r} is neither 'synthetic', an existing folder, a .csv/.jsonl/.parquet manifest, "
        "nor pkg.module:ClassName. Check the path."
    )


def _videos(source: str, rows, options: dict):
    from data.readers import choose_reader
    from data.video_dataset import VideoDataset

    allowed = POLICY_OPTIONS + tuple(k for k in LOADING_OPTIONS if k != "plugin_args") + (READER_OPTION,)
    _unknown(source, options, allowed)
    policy = ClipPolicy(**{k: v for k, v in options.items() if k in POLICY_OPTIONS})
    loading = {k: v for k, v in options.items() if k not in POLICY_OPTIONS + ("backend", READER_OPTION)}
    reader = choose_reader(options.get(READER_OPTION), options.get("backend"))
    return VideoDataset(rows, policy, name=source, backend=reader, **loading)


def _cache(source: str, options: dict):
    from data.cache_dataset import LatentCacheDataset

    _unknown(source, options, ("max_failure_share", "vae_stride", "patch", READER_OPTION))
    ds = LatentCacheDataset(source, options.get("max_failure_share", 0.05))
    stride = options.get("vae_stride")
    if stride is not None and tuple(stride) != ds.vae_stride:
        fix = (
            "; it holds Wan2.1 VAE latents but data.vae=wan2.2 (TI2V): rebuild it with python -m data.cache "
            "--vae wan2.2 --vae-path /ckpt/Wan2.2-TI2V-5B-Diffusers"
            if tuple(stride) == (4, 16, 16) and ds.latent_channels == 16
            else "; rebuild the cache with the VAE data.vae names, or set data.vae to the cache's"
        )
        raise ValueError(
            f"cache {source} was encoded with vae_stride {ds.vae_stride}, the config asks for {tuple(stride)}{fix}"
        )
    return ds
