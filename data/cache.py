"""Encode a dataset once into a latent + text-embedding cache: sharded safetensors plus an index.

    python -m data.cache --source manifest.csv --vae wan --vae-path DIR \\
        --text-encoder umt5 --text-path DIR --out CACHE_DIR [--fps 16 --max-frames 81 --resolution 480]
    torchrun --nproc_per_node 8 -m data.cache ...      # the same cache, encoded by 8 processes
    ... --resume                                       # finish a killed run: whole shards are kept
    ... --image-condition first --image-encoder DIR    # for an image-to-video model (Wan2.1 I2V)

The clip policy's VAE stride is taken from the VAE, so the cached latents have exactly the token
counts the planner computes from each clip's metadata. Broken files are skipped (never replaced:
a cache should not hold duplicates) and listed in the index and the printed summary.

For an image-to-video model the cache also stores what training would otherwise compute from each
clip at every step (dit/clips.py): the VAE latent of the clip's first frame followed by zeros
(``first-last``, FLF2V: the last frame too), and the CLIP tokens of that frame (those frames) when
``--image-encoder`` is given (models with ``image_dim``). The mask is not stored: it follows from the
latent's shape. Training refuses a cache made for another model (dit/setup.py check_cache_fits).

This module encodes (``encode_chunk``: one shard's clips); data/cache_shards.py owns the layout on
disk, the split between ranks, resume and the merge; data/cache_index.py the columnar sample table.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from data import cache_shards as shards
from data.cache_dataset import FORMAT, INDEX, VERSION
from data.cache_shards import LocalWorld, World
from data.cli import RunStopped, run_cli
from data.clip_policy import parse_options
from data.failures import FailureLog, warnings_above_bars
from data.image_cond import condition_video
from data.manifest import MANIFEST_EXTS
from data.readers import BACKENDS, VideoReadError
from data.tokens import latent_shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_raising(dataset, i: int) -> dict:
    # VideoDataset.load raises on a broken file; __getitem__ would substitute another clip.
    return dataset.load(i) if hasattr(dataset, "load") else dataset[i]


def sample_entry(dataset, i: int, sample: dict) -> dict:
    """The index entry of clip ``i`` (its latent shape and text length are added once encoded)."""
    meta = dataset.meta(i)
    return {
        "key": str(i),  # the dataset index: the same whichever process encodes the clip
        "meta": [meta.num_frames, meta.height, meta.width],
        "caption": sample["caption"],
        "source": dataset.path(i) if hasattr(dataset, "path") else str(i),
    }


@dataclass(frozen=True)
class ImageCondition:
    """What an image-to-video cache stores besides each clip's latent (see the module docstring)."""

    last_frame: bool = False  # FLF2V: the last frame is given too
    encoder: object | None = None  # a data.image_encoders.ClipImageEncoder; None: no CLIP tokens

    def record(self) -> dict:
        """The cache's ``image_condition`` entry, what training compares with its model."""
        return {
            "frames": "first-last" if self.last_frame else "first",
            "image_dim": None if self.encoder is None else int(self.encoder.dim),
        }

    def frames(self, video: torch.Tensor) -> list[torch.Tensor]:
        """(3, F, H, W) -> the given frames, (3, H, W) each: what training conditions on (dit/clips.py)."""
        return [video[:, 0]] + ([video[:, -1]] if self.last_frame else [])


class _VAEBatches:
    """Videos of one shape through the VAE together, up to ``size`` per call; the latents in order."""

    def __init__(self, vae, size: int):
        self.vae, self.size, self.batch, self.latents = vae, size, [], []

    def add(self, video: torch.Tensor) -> None:
        if self.batch and (self.batch[0].shape != video.shape or len(self.batch) == self.size):
            self.flush()
        self.batch.append(video)

    def flush(self) -> None:
        if self.batch:
            # (b, c', f', h', w') -> b x (c', f', h', w')
            self.latents.extend(self.vae.encode(torch.stack(self.batch)).unbind(0))
            self.batch.clear()


def encode_chunk(
    dataset,
    vae,
    text_encoder,
    items,
    *,
    dtype: str,
    vae_batch: int = 1,
    failures=None,
    bar=None,
    image: ImageCondition | None = None,
):
    """Load and encode the clips ``items`` -> (tensors, samples, failed) of one shard.

    Consecutive clips of equal shape go through the VAE together (up to ``vae_batch``), the chunk's
    captions through the text encoder in one call. Only one VAE batch of pixels is held at a time.
    A clip that fails to load is recorded in ``failed`` (path -> reason) and left out, never replaced.
    With ``image``, each clip's condition video (its first frame, then zeros) follows the clip through
    the VAE, and its first frame goes through the CLIP encoder.
    """
    samples, failed, image_embs = [], {}, []
    batches = _VAEBatches(vae, vae_batch)  # clip, [its condition video,] next clip, ...
    for i in items:
        try:
            sample = _load_raising(dataset, i)
        except VideoReadError as e:
            if failures is None:
                raise
            failed[e.path] = e.reason
            failures.fail(e.path, e.reason, e.detail)  # raises above max_failure_share
            continue
        finally:
            if bar is not None:
                bar.update()
        video = sample["video"]  # (3, F, H, W) in [-1, 1]
        batches.add(video)
        if image is not None:
            given = image.frames(video)
            batches.add(condition_video(given[0], video.shape[1], given[1] if image.last_frame else None))
            if image.encoder is not None:  # (k, m, d) -> (k * m, d): FLF2V's two images as one row
                image_embs.append(image.encoder.encode(torch.stack(given)).flatten(0, 1))
        samples.append(sample_entry(dataset, i, sample))
    batches.flush()
    latents = batches.latents[0 :: 1 if image is None else 2]
    cond_latents = [] if image is None else batches.latents[1::2]
    embs = text_encoder.encode([s["caption"] for s in samples]) if samples else []
    tensors, to = {}, DTYPES[dtype]
    for k, (entry, latent, emb) in enumerate(zip(samples, latents, embs)):
        f, h, w = entry["meta"]
        want = latent_shape(f, h, w, vae.stride)
        assert tuple(latent.shape[1:]) == want, f"VAE gave {tuple(latent.shape)}, metadata says {want}"
        # clone: a slice of a batch shares its storage, which safetensors refuses to save
        tensors[f"{entry['key']}.latent"] = latent.to(to).clone()
        tensors[f"{entry['key']}.text_emb"] = emb.to(to).contiguous()
        if image is not None:
            tensors[f"{entry['key']}.image_latent"] = cond_latents[k].to(to).clone()  # (c', f', h', w')
        if image_embs:
            tensors[f"{entry['key']}.image_emb"] = image_embs[k].to(to).contiguous()  # (m, image_dim)
        entry.update(latent_shape=list(latent.shape), text_len=int(emb.shape[0]))
    return tensors, samples, failed


def _reader(dataset) -> str | None:
    """The video reader that decodes the dataset's clips, 'auto' resolved (None: no video files). A
    setting, because readers' pixels differ: decord's colour conversion is a level or two off PyAV's
    and torchcodec's (docs/data.md "Decode speed"), so shards decoded by two readers would mix."""
    backend = getattr(dataset, "backend", None)
    if backend is None:
        return None
    from data.readers import check_backend

    return check_backend(backend)


def cache_settings(
    dataset, vae, text_encoder, shard_size: int, dtype: str, info: dict | None, image=None
) -> dict:
    """Everything that decides a shard's contents; a rerun must match it to reuse shards."""
    paths = hashlib.sha256()  # fed path by path: a million joined paths would be one more copy of them all
    for i in range(len(dataset)):
        paths.update((dataset.path(i) if hasattr(dataset, "path") else str(i)).encode() + b"\n")
    return {
        "format": FORMAT,
        "version": VERSION,
        "vae": {"kind": getattr(vae, "kind", type(vae).__name__), "stride": list(vae.stride)},
        "latent_channels": vae.latent_channels,
        "text_dim": text_encoder.dim,
        "dtype": dtype,
        "shard_size": shard_size,
        "image_condition": None if image is None else image.record(),  # None: for a text-to-video model
        "reader": _reader(dataset),
        **(info or {}),
        "num_items": len(dataset),
        "items_sha256": paths.hexdigest(),
    }


def build_cache(
    dataset,
    vae,
    text_encoder,
    out: str,
    *,
    shard_size: int = 256,
    dtype: str = "bfloat16",
    progress: bool = True,
    info: dict | None = None,
    resume: bool = False,
    vae_batch: int = 1,
    world: World | None = None,
    image: ImageCondition | None = None,
) -> dict:
    """Encode every clip of a pixel dataset into ``out`` (this rank's share under ``world``); rank 0
    writes ``out/index.json`` at the end. Returns a summary: shards, reused, encoded, failures.
    ``image``: also store image-to-video conditioning (see ``encode_chunk``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPES)}")
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size}: use at least 1 sample per shard")
    if vae_batch < 1:
        raise ValueError(f"vae_batch={vae_batch}: use at least 1 clip per VAE call")
    world = world or LocalWorld()
    settings = cache_settings(dataset, vae, text_encoder, shard_size, dtype, info, image)
    digest = shards.settings_hash(settings)
    shards.check_out_folder(out, settings, resume)
    shards.start(out, settings, world)
    started = time.perf_counter()
    failures = getattr(dataset, "failures", None)
    build_failed = dict(failures.failed) if failures else {}  # found while building: the same on every rank
    mine = shards.rank_chunks(len(dataset), shard_size, world.rank, world.world_size)
    rounds = len(shards.rank_chunks(len(dataset), shard_size, 0, world.world_size))  # rank 0 has the most
    reused = encoded = 0
    error = None
    with (
        tqdm(
            total=sum(len(shards.chunk_items(c, len(dataset), shard_size)) for c in mine),
            desc=f"encoding clips (rank 0 of {world.world_size})"
            if world.world_size > 1
            else "encoding clips",
            disable=not progress or world.rank != 0,
        ) as bar,
        warnings_above_bars(),
    ):
        # One sum a round, every rank (one with no chunk left too): a rank that stops (too many
        # failures, a crash) stops the others after their current chunk, not after their whole share.
        for c in (mine[k] if k < len(mine) else None for k in range(rounds)):
            try:
                items = shards.chunk_items(c, len(dataset), shard_size) if c is not None else ()
                if items and shards.read_shard_record(out, c, digest) is not None:
                    reused += 1  # written whole by an earlier run with the same settings
                    bar.update(len(items))
                elif items:
                    tensors, samples, failed = encode_chunk(
                        dataset, vae, text_encoder, items, dtype=dtype, vae_batch=vae_batch,
                        failures=failures, bar=bar, image=image,
                    )  # fmt: skip
                    shards.write_shard(out, c, digest, tensors, samples, failed)
                    encoded += 1
            except Exception as e:  # every rank must reach the sums, or the others wait forever
                error = e
            if world.sum([int(error is not None)])[0]:
                break
    num_errors, reused, encoded = world.sum([int(error is not None), reused, encoded])
    if error is not None:
        raise error
    if num_errors:
        raise RunStopped(f"another process stopped while encoding (its output says why); {out} keeps "
                         "the shards written so far: rerun with --resume")  # fmt: skip
    summary = {
        "num_shards": shards.num_chunks(len(dataset), shard_size),
        "reused": reused,
        "encoded": encoded,
    }
    merged = FailureLog(failures.total, failures.max_failure_share) if failures else FailureLog()
    error = None
    if world.rank == 0:
        try:
            samples, failed = shards.merge_records(out, summary["num_shards"], digest)
            merged.failed, merged.skipped = (
                {**build_failed, **failed},
                dict(failures.skipped) if failures else {},
            )
            merged.check()  # load-time failures of every rank together
            index = {k: v for k, v in settings.items() if k not in ("num_items", "items_sha256")}
            index.update(num_samples=len(samples), failed=merged.failed, skipped=merged.skipped)
            # Caption dropout on cached samples needs what the encoder gives for "" (an EOS token for
            # T5), which is also what sampling uses as the unconditional input.
            empty = text_encoder.encode([""])[0].to(DTYPES[dtype]).contiguous()
            shards.write_index(out, index, samples, empty)
        except Exception as e:
            error = e
    if world.sum([int(error is not None)])[0]:
        if error is not None:
            raise error
        raise RunStopped(f"rank 0 could not write the index of {out} (its output says why)")
    return {**summary, "failures": merged, "seconds": time.perf_counter() - started}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from data.cli import add_debug_flag
    from data.text_encoders import TEXT_KINDS
    from data.vaes import VAE_KINDS

    ap = argparse.ArgumentParser(prog="python -m data.cache", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--source", required=True, help="folder, .csv/.jsonl/.parquet manifest or pkg.module:Class"
    )
    ap.add_argument("--out", required=True, help="new folder for the cache")
    ap.add_argument("--vae", required=True, choices=VAE_KINDS)
    ap.add_argument("--vae-path", help="local folder of the diffusers VAE")
    ap.add_argument("--text-encoder", required=True, choices=TEXT_KINDS)
    ap.add_argument("--text-path", help="local folder of the text encoder and its tokenizer")
    ap.add_argument("--max-length", type=int, default=512, help="longest caption in tokens")
    # The built-in hashed encoder is defined by its width and seed: they must be the model's
    # text_dim and the run's data.seed, or the cached captions differ from what training encodes.
    ap.add_argument("--text-dim", type=int, help="hashed encoder only: the model's text_dim (default 64)")
    ap.add_argument("--text-seed", type=int, help="hashed encoder only: the run's data.seed (default 0)")
    # image-to-video models (dit/image_cond.py): what their training needs of each clip, cached too
    ap.add_argument(
        "--image-condition",
        choices=("first", "first-last"),
        help="for an image-to-video model: cache the VAE latent of each clip's first frame (first-last: "
        "FLF2V, and its last frame) with zeros between",
    )
    ap.add_argument(
        "--image-encoder",
        help="with --image-condition, for models with image_dim (Wan2.1 I2V/FLF2V): local CLIPVisionModel "
        "folder (the model's data.image_encoder_path) whose tokens of those frames are cached",
    )
    ap.add_argument("--shard-size", type=int, default=256, help="clips per safetensors shard")
    ap.add_argument("--vae-batch", type=int, default=1, help="clips of equal shape per VAE call")
    ap.add_argument(
        "--resume", action="store_true", help="finish a partly written cache: keep its whole shards"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="storage dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fps", type=float)
    ap.add_argument("--max-frames", type=int)
    ap.add_argument("--resolution", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--option", action="append", default=[], help="any clip-policy option, key=value")
    ap.add_argument(
        "--reader", choices=BACKENDS,
        help="video reader, as data.reader: auto (default: the first that loads: torchcodec, decord, PyAV), "
        "torchcodec, decord or pyav",
    )  # fmt: skip
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    if args.text_encoder != "hashed" and (args.text_dim is not None or args.text_seed is not None):
        ap.error("--text-dim and --text-seed apply to --text-encoder hashed only")
    if args.image_encoder is not None and args.image_condition is None:
        ap.error("--image-encoder needs --image-condition first (or first-last for FLF2V)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: run(args), args.debug)


def run(args) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        cache_from_args(args, LocalWorld(), args.device)
        return 0
    # Under torchrun: every rank encodes its share (data/cache_shards.py) in the world torchrun describes.
    import torch.distributed as dist

    from data.cache_shards import ProcessGroupWorld
    from data.torchrun import join_torchrun

    device = join_torchrun()
    try:
        world = ProcessGroupWorld(device=device)
        cache_from_args(args, world, device if args.device.startswith("cuda") else args.device)
        return 0
    finally:
        dist.destroy_process_group()


def cache_from_args(args, world: World, device) -> dict:
    """What ``python -m data.cache`` does on one rank of ``world``; -> build_cache's summary."""
    from data.build import build_dataset
    from data.text_encoders import load_text_encoder
    from data.vaes import load_vae

    if args.image_encoder is not None and not os.path.isdir(args.image_encoder):  # before the VAE loads
        raise ValueError(
            f"--image-encoder {args.image_encoder} is not a folder; pass the local CLIPVisionModel folder "
            "(the model's data.image_encoder_path, e.g. Wan2.1-I2V-14B-480P-Diffusers/image_encoder)"
        )
    vae = load_vae(args.vae, args.vae_path, device=device)
    text = load_text_encoder(
        args.text_encoder, args.text_path, args.max_length, device=device,
        hashed_dim=64 if args.text_dim is None else args.text_dim,
        seed=0 if args.text_seed is None else args.text_seed,
    )  # fmt: skip
    image = None
    if args.image_condition is not None:
        encoder = None
        if args.image_encoder is not None:
            from data.image_encoders import load_image_encoder

            encoder = load_image_encoder(args.image_encoder, device=str(device))
        image = ImageCondition(args.image_condition == "first-last", encoder)
    options = {k: getattr(args, k) for k in ("fps", "max_frames", "resolution", "max_tokens")}
    options = {k: v for k, v in options.items() if v is not None}
    options.update(parse_options(args.option))
    if args.reader is not None:  # --option backend=... is its deprecated alias (build_dataset checks both)
        options["reader"] = args.reader
    options["vae_stride"] = vae.stride  # the cache's latents define the stride, not a guess
    videos = os.path.isdir(args.source) or args.source.endswith(MANIFEST_EXTS)  # a clip policy applies
    if world.rank != 0 and videos:
        options.setdefault("progress", False)  # one probing progress bar, not one per rank
    if image is not None and image.last_frame and videos and options.get("min_frames", 1) < 2:
        raise ValueError(
            "--image-condition first-last needs clips of 2 or more frames (a first and a last): add "
            "--option min_frames=2 (and data.options.min_frames=2 to train from the videos themselves)"
        )
    dataset = build_dataset(args.source, **options)
    policy = getattr(dataset, "policy", None)
    folder = lambda p: os.path.abspath(p) if p else None  # noqa: E731
    info = {
        "source": os.path.abspath(args.source) if os.path.exists(args.source) else args.source,
        "policy": policy.to_dict() if policy else None,
        "vae_path": folder(args.vae_path),
        "text_encoder": args.text_encoder,
        "text_path": folder(args.text_path),
        "max_length": args.max_length,
        "text_seed": args.text_seed,
        "image_encoder_path": folder(args.image_encoder),
    }
    summary = build_cache(
        dataset, vae, text, args.out, shard_size=args.shard_size, dtype=args.dtype, info=info,
        resume=args.resume, vae_batch=args.vae_batch, world=world, progress=world.rank == 0, image=image,
    )  # fmt: skip
    if world.rank == 0:
        print(summary["failures"].summary())
        print(
            f"cache: {summary['num_shards']} shards, {summary['reused']} reused from an earlier run, "
            f"{summary['encoded']} encoded now on {world.world_size} process(es) in {summary['seconds']:.1f} s"
        )
        print(f"wrote {os.path.join(args.out, INDEX)}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
