"""A LoRA teaches the tiny model a colour word its base never saw, end to end on CPU, with numbers.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/lora_demo.py --out /work/demo12 \
        [--base-steps 1000] [--lora-steps 300] [--colour cyan] [--images docs/images]

1. Base: configs/tiny.yaml on synthetic clips whose palette lacks ``--colour``
   (``data.options.colours``), so the word never occurs in a base caption. ``--base RUN`` reuses a
   trained base instead.
2. LoRA: ``model.pretrained=<base>/checkpoints/<latest>/ema``, ``model.lora={rank: 16}`` on clips of
   ``--colour`` only, with validation clips (``train.sample_every``) of the demo prompts.
3. Measure: the base with the run's LoRA at scale 0 (= the base) and at scale 1, the sampling path of
   ``sample.py --checkpoint <base> --lora <lora run> --lora-scale S``: every kind and direction of
   shape in ``--colour`` on black (8 prompts x ``--seeds`` seeds), and the same for a control colour
   the base knows. On each clip, "shape pixels" are those farther than 0.5 (max over RGB, on the
   [-1, 1] scale) from the black background; printed: their mean RGB (0-255), its distance to the
   colour's RGB, and the share of shape pixels whose nearest palette colour is the prompt's.
4. Writes ``lora_demo.json`` in ``--out`` and, with ``--images``, the before / after frame grids of
   the demo prompts (seed 0, 4x enlarged) as ``lora_<colour>_before.png`` / ``_after.png``.

On a shared 2-core machine one thread per process is much faster than two (1.0 against 3.3 s per base
step at load 5-7), hence OMP_NUM_THREADS=1 above.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# the base's data: configs/tiny.yaml at 16x16 px only (about half the tokens per step)
BASE_DATA = ["data.resolutions=[[16, 16]]"]
KINDS = ("circle", "square")
DIRECTIONS = ("right", "left", "up", "down")


def demo_prompts(colour: str, control: str) -> list[str]:
    return [
        f"a {colour} circle moving right on a black background",
        f"a {colour} square moving down on a gray background",
        f"a {control} square moving down on a black background",
    ]


def train(out: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny.yaml"),
           f"output_dir={out}", *overrides]  # fmt: skip
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def shape_stats(videos: list[torch.Tensor], colour: str) -> dict:
    """Shape pixels of clips on black: mean RGB (0-255), distance to ``colour``, share nearest to it."""
    from data.synthetic import BACKGROUNDS, COLOURS

    palette = torch.tensor(list(COLOURS.values()))  # (k, 3)
    target = list(COLOURS).index(colour)
    bg = torch.tensor(BACKGROUNDS["black"])
    pixels = torch.cat([v.permute(1, 2, 3, 0).reshape(-1, 3) for v in videos])  # (n, 3) in [-1, 1]
    shape = pixels[(pixels - bg).abs().amax(dim=1) > 0.5]
    if not len(shape):
        return {"shape_pixel_share": 0.0, "mean_rgb": None, "distance": None, "nearest_share": 0.0}
    mean = (shape.mean(0) + 1) * 127.5
    want = (palette[target] + 1) * 127.5
    nearest = torch.cdist(shape, palette).argmin(dim=1)
    return {
        "shape_pixel_share": round(len(shape) / len(pixels), 3),
        "mean_rgb": [round(float(c)) for c in mean],
        "distance": round(float((mean - want).norm()), 1),
        "nearest_share": round(float((nearest == target).float().mean()), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for the two runs and lora_demo.json")
    parser.add_argument("--colour", default="cyan", help="the colour the base never sees (data/synthetic.py)")
    parser.add_argument("--control", default="red", help="a colour the base knows, measured alongside")
    parser.add_argument("--base", default=None, help="a trained base run to reuse (skips step 1)")
    parser.add_argument("--base-steps", type=int, default=1000)
    parser.add_argument("--lora-steps", type=int, default=300)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--sample-every", type=int, default=100, help="validation clips of the LoRA run")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per measured prompt")
    parser.add_argument("--images", default=None, help="also write the before/after grids here")
    args = parser.parse_args(argv)

    from data.synthetic import COLOURS

    if args.colour not in COLOURS or args.control not in COLOURS or args.colour == args.control:
        raise ValueError(f"--colour and --control must be two different names from {list(COLOURS)}")
    out = Path(args.out)
    prompts = demo_prompts(args.colour, args.control)
    sample_prompts = "train.sample_prompts=[" + ", ".join(prompts) + "]"
    palette = [c for c in COLOURS if c != args.colour]

    base = Path(args.base) if args.base else out / "base"
    if not args.base:
        train(base, [f"data.options={{colours: [{', '.join(palette)}]}}", *BASE_DATA,
                     f"train.max_steps={args.base_steps}", "train.sample_every=200", sample_prompts])  # fmt: skip

    from dit.checkpoint import resolve_checkpoint

    base_step = resolve_checkpoint(base)
    lora = out / "lora"
    train(lora, [
        f"model.pretrained={base_step / 'ema'}", f"model.lora={{rank: {args.rank}}}",
        f"data.options={{colours: [{args.colour}]}}", *BASE_DATA, f"train.max_steps={args.lora_steps}",
        f"train.lr={args.lora_lr}", "train.warmup_steps=20", f"train.checkpoint_every={args.lora_steps}",
        "train.val_every=50", f"train.sample_every={args.sample_every}", sample_prompts,
    ])  # fmt: skip

    import yaml

    from dit.config import Config, from_dict
    from dit.sample_output import write_clips
    from dit.sampler_setup import load_sampling_model
    from dit.sampling import generate
    from dit.setup import build_text_encoder

    cfg = from_dict(Config, yaml.safe_load((base_step / "config.yaml").read_text()))
    frames, height, width = cfg.train.sample_shape
    results = {"colour": args.colour, "control": args.control, "base": str(base_step), "lora": str(lora)}
    for name, scale in (("before", 0.0), ("after", 1.0)):
        torch.manual_seed(0)
        model = load_sampling_model(cfg, base_step / "ema", str(lora), scale).eval()
        encoder = build_text_encoder(cfg.data, model.config.text_dim, "cpu")

        def sample(texts, seed, model=model, encoder=encoder):
            with torch.no_grad():
                return generate(model, encoder, None, texts, frames, height, width, steps=cfg.train.sample_steps,
                                guidance=cfg.train.sample_guidance, seed=seed, shift=cfg.flow.shift)  # fmt: skip

        results[name] = {}
        for colour in (args.colour, args.control):
            texts = [f"a {colour} {k} moving {d} on a black background" for k in KINDS for d in DIRECTIONS]
            videos = [v for seed in range(args.seeds) for v in sample(texts, seed)]
            results[name][colour] = shape_stats(videos, colour)
            print(f"{name:6s} {colour:6s} {results[name][colour]}", flush=True)
        if args.images:
            paths = write_clips(sample(prompts, 0), prompts, out / "grids" / name, 0, upscale=4)
            grid = Path(args.images) / f"lora_{args.colour}_{name}.png"
            grid.parent.mkdir(parents=True, exist_ok=True)
            grid.write_bytes(paths[-1].read_bytes())
            print("wrote", grid)
    want = [round((c + 1) * 127.5) for c in COLOURS[args.colour]]
    print(f"{args.colour} is RGB {want}; shape pixels' mean RGB before {results['before'][args.colour]['mean_rgb']}, "
          f"after {results['after'][args.colour]['mean_rgb']}")  # fmt: skip
    (out / "lora_demo.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
