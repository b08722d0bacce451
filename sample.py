"""Sample clips from a checkpoint and write them as .mp4 (and optionally a PNG frame grid).

    python sample.py --checkpoint runs/tiny --prompt "a red circle moving right on a black background"

Loads the EMA weights by default. Same seed and arguments, same clip. ``--lora FILE_OR_DIR`` adds a
diffusers-format Wan LoRA (ours, diffusers', finetrainers', DiffSynth-Studio's) to any checkpoint,
scaled by ``--lora-scale``; a LoRA run's own checkpoint loads its base and adapters by itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.cli import add_debug_flag, run_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", required=True, help="run directory (its latest checkpoint) or a step_* dir"
    )
    parser.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    parser.add_argument("--prompts-file", help="a text file with one prompt per line")
    parser.add_argument(
        "--weights", choices=("ema", "model"), default="ema", help="EMA (default) or raw weights"
    )
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="Euler steps")
    parser.add_argument(
        "--guidance", type=float, default=4.0, help="classifier-free guidance scale; 1 disables"
    )
    parser.add_argument(
        "--shift",
        type=float,
        default=None,
        help="sigma shift; default: the run's flow.shift, else by token count",
    )
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--image", default=None, help="first frame for an image-to-video model (PNG/JPEG)")
    parser.add_argument("--last-image", default=None, help="last frame for a first-last-frame (FLF2V) model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=int, default=8)
    parser.add_argument(
        "--upscale",
        type=int,
        default=1,
        help="nearest-neighbour enlargement of the written files (default 1: the size asked for)",
    )
    parser.add_argument("--grid", action="store_true", help="also write a PNG grid of all frames")
    parser.add_argument("--lora", default=None, help="a Wan LoRA .safetensors file (or its folder) to add")
    parser.add_argument("--lora-scale", type=float, default=1.0, help="strength of --lora (0 = the base)")
    parser.add_argument("--out", default=None, help="output directory (default: <run>/samples)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    return run_cli(lambda: run(args), args.debug)


def run(args) -> int:
    import torch
    import yaml

    from data.image_encoders import image_inputs_for
    from dit.checkpoint import resolve_checkpoint
    from dit.config import Config, from_dict
    from dit.sampling import generate, write_clips
    from dit.setup import build_text_encoder, build_vae

    if args.upscale < 1:
        raise ValueError(f"--upscale {args.upscale}: use 1 (the size asked for) or a larger whole factor")
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompt given; pass --prompt TEXT (repeatable) or --prompts-file FILE")
    step_dir = resolve_checkpoint(args.checkpoint)
    weights = step_dir / args.weights
    if not weights.is_dir():
        raise ValueError(
            f"{weights} does not exist; this checkpoint has no {args.weights} weights, try --weights model"
        )
    cfg = from_dict(Config, yaml.safe_load((step_dir / "config.yaml").read_text()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_sampling_model(cfg, weights, args.lora, args.lora_scale).to(device).eval()
    text_encoder = build_text_encoder(cfg.data, model.config.text_dim, device)
    vae = build_vae(cfg.data, device)
    image_kwargs = image_inputs_for(model.config, cfg.data, args.image, args.last_image, device)
    videos = generate(
        model, text_encoder, vae, prompts, args.frames, args.height, args.width,
        steps=args.steps, guidance=args.guidance, seed=args.seed,
        shift=args.shift if args.shift is not None else cfg.flow.shift,
        negative_prompt=args.negative_prompt, **image_kwargs,
    )  # fmt: skip
    out = Path(args.out) if args.out else step_dir.parent.parent / "samples"
    for path in write_clips(videos, prompts, out, args.seed, args.fps, args.upscale, grid=args.grid):
        print(path)
    return 0


def load_sampling_model(cfg, weights: Path, lora: str | None, lora_scale: float):
    """A checkpoint's weights (a LoRA run's: its base + the saved adapter), then ``lora`` on top."""
    import torch

    from dit import lora as lora_lib
    from dit.model import VideoDiT
    from dit.setup import build_model

    if (weights / lora_lib.WEIGHT_NAME).is_file():  # a LoRA run saved only its adapter
        torch.manual_seed(cfg.train.seed)  # a base without model.pretrained is the run's seeded init
        model = build_model(cfg.model)  # the base it trained on
        lora_lib.load_lora(model, weights, adapter_name="trained")
        lora_lib.merge_lora(model)  # folded in, so that --lora below is the only adapter
    else:
        model = VideoDiT.from_pretrained(weights)
    if lora is not None:
        lora_lib.load_lora(model, lora)
        lora_lib.set_lora_scale(model, lora_scale)
    return model


if __name__ == "__main__":
    sys.exit(main())
