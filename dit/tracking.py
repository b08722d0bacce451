"""Where a run's metrics and validation clips go: ``train.report_to`` = any of jsonl, tensorboard, wandb.

    tracker = Tracker(out_dir, ["jsonl", "tensorboard"], config_dict, resume_step=None)
    tracker.log({"step": 10, "loss": 0.31, "lr": 1e-4, "cp_hist": {"2": 3}})
    tracker.log_video("val/red_circle", video_CFHW, step=10, fps=8)   # (3, f, h, w) in [-1, 1]
    tracker.close()

Only the logging rank builds one (the trainers' ``is_main``); other ranks get ``Tracker.disabled()``.
- jsonl: ``<out>/metrics.jsonl``, one JSON line per call (the trainer truncates it on resume).
- tensorboard: ``<out>/tensorboard/`` through ``torch.utils.tensorboard.SummaryWriter``; on resume
  the writer purges events after the checkpoint step, so the curves read like one run.
- wandb: offline unless the user set ``WANDB_MODE`` (nothing reaches the network by default);
  the run id is kept in ``<out>/wandb_run_id`` so a resumed run continues the same wandb run.
Nested dicts (``cp_hist``) become ``cp_hist/2`` scalars; strings and lists stay in the jsonl only.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import torch

# tracker -> (module to import, the pip extra that installs it)
_NEEDS = {"tensorboard": ("tensorboard", "tracking"), "wandb": ("wandb", "tracking")}


def check_trackers_installed(report_to: list[str]) -> None:
    """One-line ValueError at start-up for a tracker whose library is missing."""
    import importlib.util

    for name in report_to:
        if name in _NEEDS and importlib.util.find_spec(_NEEDS[name][0]) is None:
            module, extra = _NEEDS[name]
            raise ValueError(
                f"train.report_to has {name!r} but {module} is not installed: "
                f'pip install -e ".[{extra}]" (or drop {name} from train.report_to)'
            )


def flat_scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """Numbers of ``record`` (nested dicts as ``a/b``), without ``step``; bools and strings dropped."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" and not prefix:
            continue
        if isinstance(value, dict):
            out.update(flat_scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


class Tracker:
    def __init__(
        self,
        out: str | Path,
        report_to: list[str],
        config: dict | None = None,
        resume_step: int | None = None,
        project: str = "dynamic-cp-video",
    ):
        check_trackers_installed(report_to)
        self.out = Path(out)
        self.report_to = list(report_to)
        self._tb = None
        self._wandb = None
        if "tensorboard" in self.report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events at or after it (left by the run that died) are hidden on reload
            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=purge)
        if "wandb" in self.report_to:
            os.environ.setdefault("WANDB_MODE", "offline")  # the user's own setting wins
            import wandb

            self.out.mkdir(parents=True, exist_ok=True)
            id_file = self.out / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
            self._wandb = wandb.init(
                project=project, name=self.out.name, id=run_id, resume="allow", dir=str(self.out),
                config=config or {},
            )  # fmt: skip

    @classmethod
    def disabled(cls) -> Tracker:
        """A tracker that writes nothing (ranks other than the logging one)."""
        return cls("", [])

    def log(self, record: dict) -> None:
        """One metrics record; ``record['step']`` is its x axis."""
        step = int(record["step"])
        if "jsonl" in self.report_to:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        scalars = flat_scalars(record)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_video(
        self,
        name: str,
        video: torch.Tensor,
        step: int,
        fps: int = 8,
        caption: str = "",
        mp4: Path | None = None,
    ) -> Path | None:
        """A validation clip, (3, f, h, w) in [-1, 1] as ``dit.sampling.generate`` returns it.

        Written as ``<out>/samples/<name>_step<step>.mp4``. TensorBoard gets its frames side by side
        as one image (its own video summary needs moviepy); wandb gets the mp4. Returns the mp4 path
        (None when no tracker asked for it). ``mp4``: the clip already written there (the trainer's
        validation clips), so it is not encoded twice.
        """
        if not self.report_to:
            return None
        import imageio.v3 as iio

        from dit.sample_output import to_uint8_frames

        frames = to_uint8_frames(video)  # (f, h, w, 3) uint8
        path = mp4
        if path is None:
            path = self.out / "samples" / f"{name.replace('/', '_')}_step{step:06d}.mp4"
            path.parent.mkdir(parents=True, exist_ok=True)
            iio.imwrite(path, frames.numpy(), fps=fps, codec="libx264", macro_block_size=1)
        if self._tb is not None:
            strip = torch.cat(list(frames), dim=1)  # (h, f*w, 3)
            self._tb.add_image(name, strip.numpy(), step, dataformats="HWC")
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Video(str(path), fps=fps, caption=caption)}, step=step)
        return path

    def log_images(self, name: str, images: torch.Tensor, step: int) -> None:
        """Images as (n, h, w, 3) uint8 (e.g. ``dit.sample_output.frame_grid`` output with a leading 1)."""
        if self._tb is not None:
            self._tb.add_images(name, images.numpy(), step, dataformats="NHWC")
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: [wandb.Image(im.numpy()) for im in images]}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
