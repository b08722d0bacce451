"""A tiny image-to-video model learns to animate a given first frame, end to end on CPU, with numbers.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/i2v_demo.py --out /tmp/i2vdemo [--steps 700] \
        [--run RUN] [--clips 16] [--images docs/figures]

1. Train (unless ``--run`` names a trained run): configs/tiny.yaml as an image-to-video model, 3 noisy
   + 1 mask + 3 image channels in pixel space (no CLIP: the channels alone), on synthetic 16x16 clips of
   5 and 9 frames; the condition is each clip's own first frame (``dit/image_cond.py``).
2. Sample held-out clips (the validation seed, never trained on) from their first frame and caption,
   the path of ``sample.py --image``, 9 frames.
3. Measure, per clip, on the [-1, 1] scale: the first frame's mean absolute error against the given
   image, against the error of a sample of the same clip conditioned on a black image instead (the
   image is the only difference); and motion, the shape's centroid
   shift in pixels from the first to the last frame (shape pixels: farther than 0.5 from the frame's
   median colour, its background), for the samples and for the true clips, and the distance between
   the sample's and the true clip's last-frame centroids. A model that copied the image would show
   no shift.
4. Writes ``i2v_demo.json`` in ``--out`` and, with ``--images``, a PNG grid: per clip a row of the true
   clip and a row of the sample (4x enlarged).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRAIN = [
    "model.overrides={in_channels: 7, out_channels: 3}",
    "data.frame_counts=[5, 9]",
    "data.resolutions=[[16, 16]]",
    "train.val_every=100000",
]
FRAMES = 9


def centroid(frame: torch.Tensor) -> torch.Tensor | None:
    """(3, h, w) -> (y, x) mean position of the shape pixels, or None when there are none. Shape pixels
    differ from the frame's median colour (the background: it covers most of a 16 px frame) by more
    than 0.5 in some channel."""
    background = frame.flatten(1).median(dim=1).values[:, None, None]  # (3, 1, 1)
    mask = (frame - background).abs().amax(0) > 0.5
    if not mask.any():
        return None
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return torch.stack([ys.float().mean(), xs.float().mean()])


def shift(video: torch.Tensor) -> float:
    a, b = centroid(video[:, 0]), centroid(video[:, -1])
    return float("nan") if a is None or b is None else float((b - a).norm())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--run", default=None, help="a trained run to measure (skips training)")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--clips", type=int, default=16, help="held-out clips to sample")
    ap.add_argument("--images", default=None, help="folder for the PNG grid")
    args = ap.parse_args(argv)
    out = Path(args.out)
    run = Path(args.run) if args.run else out / "run"
    if not args.run:
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
               f"output_dir={run}", *TRAIN, f"train.max_steps={args.steps}"]  # fmt: skip
        subprocess.run(cmd, check=True)

    import yaml

    from data.synthetic import SyntheticClips
    from dit.checkpoint import resolve_checkpoint
    from dit.config import Config, from_dict
    from dit.sample_output import frame_grid
    from dit.sampling import generate
    from dit.setup import build_text_encoder
    from sample import load_sampling_model

    step = resolve_checkpoint(run)
    cfg = from_dict(Config, yaml.safe_load((step / "config.yaml").read_text()))
    model = load_sampling_model(cfg, step / "ema", None, 1.0).eval()
    encoder = build_text_encoder(cfg.data, model.config.text_dim, "cpu")
    held_out = SyntheticClips(
        args.clips, seed=cfg.data.seed + 10_000, frame_counts=(FRAMES,), resolutions=((16, 16),),
        max_shapes=cfg.data.max_shapes,
    )  # fmt: skip
    rows, truth, samples, blind = [], [], [], []
    for i in range(args.clips):
        clip = held_out[i]
        video, caption = clip["video"], clip["caption"]
        kw = dict(
            steps=cfg.train.sample_steps, guidance=cfg.train.sample_guidance, shift=cfg.flow.shift, seed=i
        )
        sample = generate(model, encoder, None, [caption], FRAMES, 16, 16, image=video[:, 0], **kw)[0]
        # the same run with a black first frame: how close frame 0 gets without the image
        other = generate(
            model, encoder, None, [caption], FRAMES, 16, 16, image=torch.full_like(video[:, 0], -1), **kw
        )[0]
        truth.append(video)
        samples.append(sample)
        blind.append(float((other[:, 0] - video[:, 0]).abs().mean()))
        rows += [video, sample]
    first_err = [float((s[:, 0] - v[:, 0]).abs().mean()) for s, v in zip(samples, truth)]
    results = {
        "run": str(step),
        "clips": args.clips,
        "first_frame_mae": sum(first_err) / len(first_err),
        "first_frame_mae_black_image": sum(blind) / len(blind),
        "sample_shift_px": [shift(s) for s in samples],
        "true_shift_px": [shift(v) for v in truth],
    }
    mean = lambda xs: sum(x for x in xs if x == x) / max(1, sum(1 for x in xs if x == x))  # noqa: E731
    ends = [(centroid(s[:, -1]), centroid(v[:, -1])) for s, v in zip(samples, truth)]
    results["last_frame_centroid_error_px"] = [
        float("nan") if None in e else float((e[0] - e[1]).norm()) for e in ends
    ]
    results["mean_last_frame_centroid_error_px"] = mean(results["last_frame_centroid_error_px"])
    results["mean_sample_shift_px"] = mean(results["sample_shift_px"])
    results["mean_true_shift_px"] = mean(results["true_shift_px"])
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, list)}, indent=1))
    out.mkdir(parents=True, exist_ok=True)
    (out / "i2v_demo.json").write_text(json.dumps(results, indent=1))
    if args.images:
        import imageio.v2 as imageio

        path = Path(args.images) / "i2v_demo_grid.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        imageio.imwrite(path, frame_grid(rows[:8], upscale=4).numpy())
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
