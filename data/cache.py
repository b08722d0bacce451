"""Encode a dataset once into a latent + text-embedding cache: sharded safetensors plus index.json.

    python -m data.cache --source manifest.csv --vae wan --vae-path DIR \\
        --text-encoder umt5 --text-path DIR --out CACHE_DIR [--fps 16 --max-frames 81 --resolution 480]

The clip policy's VAE stride is taken from the VAE, so the cached latents have exactly the token
counts the planner computes from each clip's metadata. Broken files are skipped (never replaced:
a cache should not hold duplicates) and listed in the index and the printed summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from data.cache_dataset import EMPTY_TEXT, FORMAT, INDEX, VERSION
from data.clip_policy import parse_options
from data.readers import VideoReadError
from data.tokens import latent_shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_raising(dataset, i: int) -> dict:
    # VideoDataset.load raises on a broken file; __getitem__ would substitute another clip.
    return dataset.load(i) if hasattr(dataset, "load") else dataset[i]


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
) -> dict:
    """Encode every clip of a pixel dataset; returns the index that was written to ``out/index.json``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPES)}")
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size}: use at least 1 sample per shard")
    if os.path.exists(os.path.join(out, INDEX)):
        raise ValueError(f"{out} already holds a cache; choose a new --out or delete it first")
    os.makedirs(out, exist_ok=True)
    failures = getattr(dataset, "failures", None)
    samples, pending = [], []  # pending: (key, latent, caption, entry) of the shard being filled

    def flush():
        if not pending:
            return
        shard = f"shard-{len(samples) // shard_size:05d}.safetensors"
        embs = text_encoder.encode([caption for _, _, caption, _ in pending])
        tensors = {}
        for (key, latent, _, entry), emb in zip(pending, embs):
            tensors[f"{key}.latent"] = latent.to(DTYPES[dtype]).contiguous()
            tensors[f"{key}.text_emb"] = emb.to(DTYPES[dtype]).contiguous()
            entry.update(shard=shard, text_len=int(emb.shape[0]))
            samples.append(entry)
        tmp = os.path.join(out, shard + ".tmp")
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(out, shard))  # a shard on disk is always whole
        pending.clear()

    for i in tqdm(range(len(dataset)), desc="encoding clips", disable=not progress):
        try:
            sample = _load_raising(dataset, i)
        except VideoReadError as e:
            if failures is None:
                raise
            failures.fail(e.path, e.reason, e.detail)  # raises above max_failure_share
            continue
        meta = dataset.meta(i)
        latent = vae.encode(sample["video"][None])[0]  # (c', f', h', w')
        want = latent_shape(meta.num_frames, meta.height, meta.width, vae.stride)
        assert tuple(latent.shape[1:]) == want, f"VAE gave {tuple(latent.shape)}, metadata says {want}"
        entry = {
            "key": str(len(samples) + len(pending)),
            "meta": [meta.num_frames, meta.height, meta.width],
            "latent_shape": list(latent.shape),
            "caption": sample["caption"],
            "source": dataset.path(i) if hasattr(dataset, "path") else str(i),
        }
        pending.append((entry["key"], latent, sample["caption"], entry))
        if len(pending) == shard_size:
            flush()
    flush()
    # Caption dropout on cached samples needs what the encoder gives for "" (an EOS token for T5),
    # which is also what sampling uses as the unconditional input.
    empty = {"text_emb": text_encoder.encode([""])[0].to(DTYPES[dtype]).contiguous()}
    save_file(empty, os.path.join(out, EMPTY_TEXT + ".tmp"))
    os.replace(os.path.join(out, EMPTY_TEXT + ".tmp"), os.path.join(out, EMPTY_TEXT))
    index = {
        "format": FORMAT,
        "version": VERSION,
        "vae": {"kind": getattr(vae, "kind", type(vae).__name__), "stride": list(vae.stride)},
        "latent_channels": vae.latent_channels,
        "text_dim": text_encoder.dim,
        "dtype": dtype,
        **(info or {}),
        "num_samples": len(samples),
        "failed": dict(failures.failed) if failures else {},
        "skipped": dict(failures.skipped) if failures else {},
        "samples": samples,
    }
    with open(os.path.join(out, INDEX + ".tmp"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1, ensure_ascii=False)
    os.replace(
        os.path.join(out, INDEX + ".tmp"), os.path.join(out, INDEX)
    )  # written last: marks the cache complete
    return index


def main(argv: list[str] | None = None) -> int:
    from data.cli import add_debug_flag, run_cli
    from data.text_encoders import TEXT_KINDS
    from data.vaes import VAE_KINDS

    ap = argparse.ArgumentParser(prog="python -m data.cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, help="folder, .csv/.jsonl manifest or pkg.module:Class")
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
    ap.add_argument("--shard-size", type=int, default=256, help="samples per safetensors shard")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="storage dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fps", type=float)
    ap.add_argument("--max-frames", type=int)
    ap.add_argument("--resolution", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--option", action="append", default=[], help="any clip-policy option, key=value")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    if args.text_encoder != "hashed" and (args.text_dim is not None or args.text_seed is not None):
        ap.error("--text-dim and --text-seed apply to --text-encoder hashed only")
    return run_cli(lambda: run(args), args.debug)


def run(args) -> int:
    from data.build import build_dataset
    from data.text_encoders import load_text_encoder
    from data.vaes import load_vae

    vae = load_vae(args.vae, args.vae_path, device=args.device)
    text = load_text_encoder(
        args.text_encoder, args.text_path, args.max_length, device=args.device,
        hashed_dim=64 if args.text_dim is None else args.text_dim,
        seed=0 if args.text_seed is None else args.text_seed,
    )  # fmt: skip
    options = {k: getattr(args, k) for k in ("fps", "max_frames", "resolution", "max_tokens")}
    options = {k: v for k, v in options.items() if v is not None}
    options.update(parse_options(args.option))
    options["vae_stride"] = vae.stride  # the cache's latents define the stride, not a guess
    dataset = build_dataset(args.source, **options)
    policy = getattr(dataset, "policy", None)
    info = {
        "source": args.source,
        "policy": policy.to_dict() if policy else None,
        "text_encoder": args.text_encoder,
    }
    build_cache(dataset, vae, text, args.out, shard_size=args.shard_size, dtype=args.dtype, info=info)
    if hasattr(dataset, "failures"):
        print(dataset.failures.summary())
    print(f"wrote {args.out}/{INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
