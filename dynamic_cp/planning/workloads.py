"""Built-in global batches drawn from the published length statistics in DESIGN.md, and trace readers.

Each workload draws clip shapes (frames, height, width) and converts them with the project's token
formula (``data.tokens.num_tokens``: causal VAE 4x8x8, patch 1x2x2). Frames follow Open-Sora 2.0's
4k+1 buckets; durations are log-normal with the published means. Seeds make every draw reproducible.

    openvid      OpenVid-1M: mean 7.2 s, 16 fps up to 129 frames, mixed 256px / 480p / 720p
    panda70m     Panda-70M: mean 8.5 s at 720p, 16 fps up to 129 frames (near-uniform, long)
    opensora     Open-Sora mix: 21% images, videos in 256px and 768px buckets, 24 fps up to 129 frames
    longtail     LVD/MiraData-like tail: mostly images and short 256px clips, a few 10-50 s 720p clips
                 up to 257 frames (234K tokens)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from data.tokens import num_tokens

RES = {"256px": (256, 256), "480p": (480, 832), "720p": (720, 1280), "768px": (768, 768)}


def _frames(seconds: np.ndarray, fps: float, max_frames: int) -> np.ndarray:
    """Seconds -> 4k+1 frame buckets, at least 5 frames (one latent step past the first)."""
    f = np.clip(np.round(seconds * fps), 5, max_frames)
    return (((f - 1) // 4) * 4 + 1).astype(int)


def _lognormal_seconds(rng, mean_s: float, n: int, sigma: float = 0.6) -> np.ndarray:
    # mean of a log-normal is exp(mu + sigma^2 / 2)
    return rng.lognormal(np.log(mean_s) - sigma**2 / 2, sigma, n)


def _tokens(frames, res_names) -> list[int]:
    return [num_tokens(int(f), *RES[r]) for f, r in zip(frames, res_names)]


def openvid(n: int, rng) -> list[int]:
    res = rng.choice(["256px", "480p", "720p"], size=n, p=[0.3, 0.5, 0.2])
    return _tokens(_frames(_lognormal_seconds(rng, 7.2, n), 16, 129), res)


def panda70m(n: int, rng) -> list[int]:
    return _tokens(_frames(_lognormal_seconds(rng, 8.5, n, 0.5), 16, 129), ["720p"] * n)


def opensora(n: int, rng) -> list[int]:
    image = rng.random(n) < 0.21
    res = rng.choice(["256px", "768px"], size=n, p=[0.6, 0.4])
    frames = _frames(_lognormal_seconds(rng, 4.0, n, 0.8), 24, 129)
    frames[image] = 1
    return _tokens(frames, res)


def longtail(n: int, rng) -> list[int]:
    kind = rng.choice(4, size=n, p=[0.25, 0.55, 0.15, 0.05])
    out = []
    for k in kind:
        if k == 0:  # image
            out.append(num_tokens(1, *RES[rng.choice(["256px", "768px"])]))
        elif k == 1:  # short low-res clip
            out.append(_tokens(_frames(_lognormal_seconds(rng, 3.0, 1), 16, 129), ["256px"])[0])
        elif k == 2:  # mid clip
            out.append(_tokens(_frames(_lognormal_seconds(rng, 5.0, 1), 16, 129), ["480p"])[0])
        else:  # LVD-2M 10-50 s, cropped at 16 s
            out.append(_tokens(_frames(rng.uniform(10, 50, 1), 16, 257), ["720p"])[0])
    return out


WORKLOADS = {"openvid": openvid, "panda70m": panda70m, "opensora": opensora, "longtail": longtail}
LONG_TAILED = ("openvid", "opensora", "longtail")


def workload(name: str, num_samples: int, seed: int = 0) -> list[int]:
    """Clip lengths (tokens) of one global batch of ``num_samples`` from a built-in workload."""
    if name not in WORKLOADS:
        raise ValueError(
            f"unknown workload {name!r}; use one of {sorted(WORKLOADS)}, or --lengths / --manifest"
        )
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be at least 1")
    return [int(x) for x in WORKLOADS[name](num_samples, np.random.default_rng(seed))]


def read_lengths(path: str) -> np.ndarray:
    """One positive integer per line (blank lines skipped), e.g. ../shared/workloads/wikipedia_lengths.txt."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"lengths file {path} does not exist")
    L = np.loadtxt(p, dtype=np.int64, ndmin=1)
    if L.size == 0 or L.min() < 1:
        raise ValueError(f"{path} must hold one positive token count per line")
    return L


def sample_batch(pool, num_samples: int, seed: int = 0) -> list[int]:
    """A global batch drawn without replacement from a trace (with replacement if the trace is short)."""
    pool = np.asarray(pool)
    rng = np.random.default_rng(seed)
    idx = rng.choice(pool.size, size=num_samples, replace=num_samples > pool.size)
    return [int(x) for x in pool[idx]]


def read_manifest(path: str, policy_options: dict | None = None) -> list[int]:
    """Tokens per clip of a CSV/JSONL manifest (Open-Sora columns path,text,num_frames,height,width,fps),
    after the same clip policy training applies (``data.options``: fps, max_frames, resolution, ...),
    so the simulation sees the clips the trainer will. Rows the policy rejects are left out."""
    from data.clip_policy import ClipPolicy
    from data.manifest_table import plan_rows, read_table
    from data.types import ClipMeta

    if not Path(path).exists():
        raise ValueError(f"manifest {path} does not exist")
    options = policy_options or {}
    valid = {f.name for f in dataclasses.fields(ClipPolicy)}
    if set(options) - valid:
        raise ValueError(
            f"unknown clip-policy option {sorted(set(options) - valid)[0]!r}; valid: {sorted(valid)}"
        )
    policy = ClipPolicy(**options)
    table = read_table(path)  # columns: a million-row manifest without a million Row objects
    if not table.has_info.all():
        j = int(np.flatnonzero(~table.has_info)[0])
        raise ValueError(
            f"manifest {path} needs columns num_frames, height, width and fps for {table.path(j)}; "
            "run python -m data.scan to fill them in"
        )
    _, metas, _ = plan_rows(table, np.arange(len(table)), policy)  # rows the policy rejects: left out
    out = [policy.tokens(ClipMeta(*m)) for m in metas.tolist()]
    if not out:
        raise ValueError(f"manifest {path} has no rows the clip policy keeps")
    return out
