"""The layout of a latent cache on disk, independent of what is encoded: chunks, shards, resume, merge.

A dataset of N clips is cut into chunks of ``shard_size`` consecutive dataset indices; chunk c becomes
``shard-{c:05d}.safetensors``, and rank r of W encodes the chunks c with c % W == r. Whatever the
number of processes, every chunk holds the same clips, so a cache made on W processes equals the
one-process cache: same samples, keys, order, tensors and failure lists.

A shard describes itself: its safetensors metadata holds the chunk's index entries, the files of the
chunk that failed to load, and the hash of the run's settings. A shard is written to a temporary name
and renamed, so a shard on disk is always whole; a rerun (``resume``) keeps every shard whose settings
hash matches and encodes only the missing chunks. ``settings.json`` (written before any shard) marks
a cache in progress and holds the settings; ``samples.safetensors`` (the columnar sample table,
data/cache_index.py) and ``index.json`` (written last, by rank 0) mark it done.

The only collective the layout needs is a sum of a few integers over all processes (``World.sum``):
it doubles as the barrier before rank 0 merges, and tells every rank whether any rank failed (once
per round of chunks while encoding, so one rank's stop stops the others at their next chunk).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from data.cache_dataset import EMPTY_TEXT, INDEX, SETTINGS
from data.cache_index import SAMPLES, SHARD, columns, save_columns


class World(Protocol):
    """The processes that build a cache together: ``LocalWorld`` for one, a process group under torchrun
    (``ProcessGroupWorld``)."""

    rank: int
    world_size: int

    def sum(self, values: list[int]) -> list[int]: ...  # element-wise sum over all ranks; a barrier


class LocalWorld:
    rank, world_size = 0, 1

    def sum(self, values: list[int]) -> list[int]:
        return list(values)


class ProcessGroupWorld:
    """``data.cache_shards.World`` over a process group: the ranks that build one cache together."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None):
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = device or torch.device("cpu")  # nccl reduces tensors on the GPU only

    def sum(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()


def num_chunks(num_items: int, shard_size: int) -> int:
    return -(-num_items // shard_size)


def chunk_items(chunk: int, num_items: int, shard_size: int) -> range:
    """Dataset indices of chunk ``chunk``: the same for any number of processes."""
    return range(chunk * shard_size, min((chunk + 1) * shard_size, num_items))


def rank_chunks(num_items: int, shard_size: int, rank: int, world_size: int) -> list[int]:
    """The chunks rank ``rank`` encodes: round robin, so every rank gets a share of the tail too."""
    return list(range(rank, num_chunks(num_items, shard_size), world_size))


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]  # tuples as lists


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
    os.replace(path + ".tmp", path)


def first_difference(a, b, key: str = "") -> tuple[str, object, object] | None:
    """(dotted key, a's value, b's value) of the first place two JSON values differ, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            found = first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else k)
            if found:
                return found
        return None
    return None if a == b else (key, a, b)


def check_out_folder(out: str, settings: dict, resume: bool) -> None:
    """Refuse a finished cache, a cache made with other settings, and a partial one without ``resume``.
    Only reads: every rank calls it before any rank writes."""
    if os.path.exists(os.path.join(out, INDEX)):
        raise ValueError(f"{out} already holds a cache; choose a new --out or delete it first")
    path = os.path.join(out, SETTINGS)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    diff = first_difference(old, json.loads(json.dumps(settings)))  # json: tuples compare as lists
    if diff:
        key, then, now = diff
        fix = f"rerun with --reader {then}" if key == "reader" and then else "rerun with the same settings"
        raise ValueError(
            f"{out} holds a partly written cache made with other settings ({key}: {then!r} there, "
            f"{now!r} now); {fix} or choose a new --out"
        )
    if not resume:
        done = len(glob.glob(os.path.join(out, "shard-*.safetensors")))
        raise ValueError(
            f"{out} holds a partly written cache ({done} shards); add --resume to finish it, "
            "or delete the folder to start over"
        )


def start(out: str, settings: dict, world: World) -> None:
    """After every rank checked the folder: rank 0 records the settings (atomic)."""
    world.sum([0])  # nobody writes before every rank has checked
    if world.rank == 0:
        os.makedirs(out, exist_ok=True)
        for tmp in glob.glob(os.path.join(out, "*.tmp")):  # half-written files of a killed run
            os.remove(tmp)
        _write_json(os.path.join(out, SETTINGS), settings)
    world.sum([0])  # the folder exists on every rank from here


def read_shard_record(out: str, chunk: int, digest: str) -> dict | None:
    """The record of a whole shard written with settings ``digest``, else None (missing, other settings,
    unreadable: the chunk is encoded again)."""
    path = os.path.join(out, SHARD.format(chunk))
    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, framework="pt") as f:
            record = json.loads((f.metadata() or {}).get("cache", "null"))
    except Exception:  # a damaged file: encode the chunk again
        return None
    if not isinstance(record, dict) or record.get("settings") != digest or record.get("chunk") != chunk:
        return None
    return record


def write_shard(out: str, chunk: int, digest: str, tensors: dict, samples: list[dict], failed: dict) -> None:
    """Shard ``chunk`` with its tensors and its record (samples, failed files, settings hash), atomically."""
    shard = SHARD.format(chunk)
    for entry in samples:
        entry["shard"] = shard
    record = {"chunk": chunk, "settings": digest, "samples": samples, "failed": failed}
    tmp = os.path.join(out, shard + f".{os.getpid()}.tmp")
    save_file(tensors, tmp, metadata={"cache": json.dumps(record, ensure_ascii=False)})
    os.replace(tmp, os.path.join(out, shard))


def merge_records(out: str, num: int, digest: str) -> tuple[list[dict], dict[str, str]]:
    """Samples and load-time failures of chunks 0..num-1, in chunk order (= dataset order)."""
    samples, failed = [], {}
    for c in range(num):
        record = read_shard_record(out, c, digest)
        if record is None:
            raise RuntimeError(f"{out}: shard of chunk {c} is missing after every rank finished")
        samples += [{**s, "chunk": c} for s in record["samples"]]
        failed.update(record["failed"])
    return samples, failed


def write_index(out: str, index: dict, samples: list[dict], empty_text_emb: torch.Tensor) -> None:
    """The caption-dropout embedding, the sample columns, then the index: written last, it marks the
    cache complete."""
    save_columns(os.path.join(out, SAMPLES), columns(samples))
    tmp = os.path.join(out, EMPTY_TEXT + ".tmp")
    save_file({"text_emb": empty_text_emb}, tmp)
    os.replace(tmp, os.path.join(out, EMPTY_TEXT))
    _write_json(os.path.join(out, INDEX), index)
