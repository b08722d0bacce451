"""Procedural clips of moving coloured shapes, with captions that describe them.

Built in so that the tiny config trains with no download: every clip is a deterministic function of
(seed, index), shapes move at a constant speed in one direction (wrapping at the edges), and the caption
names each shape's colour, kind and direction and the background. Frame count and resolution are drawn
per clip from the configured choices, so a batch has the mixed lengths Dynamic-CP is built for.
``meta(i)`` needs no rendering: the planner can read every clip's length before any pixels exist.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from data.types import ClipMeta

# RGB in [-1, 1]
COLOURS = {
    "red": (1.0, -1.0, -1.0),
    "green": (-1.0, 1.0, -1.0),
    "blue": (-1.0, -1.0, 1.0),
    "yellow": (1.0, 1.0, -1.0),
    "white": (1.0, 1.0, 1.0),
    "cyan": (-1.0, 1.0, 1.0),
}
BACKGROUNDS = {"black": (-1.0, -1.0, -1.0), "gray": (-0.2, -0.2, -0.2), "dark blue": (-1.0, -1.0, -0.4)}
TEXTURES = ("plain", "striped")
SHAPES = ("circle", "square")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def check_colours(colours) -> tuple[str, ...]:
    """The palette shapes are drawn from: ``colours`` (names in COLOURS), or every colour when None.

    A palette without some colour trains a base model that never sees that word, so a fine-tune (a LoRA)
    can teach it later; ``bench/lora_demo.py`` does that.
    """
    if colours is None:
        return tuple(COLOURS)
    if isinstance(colours, str) or not colours:
        raise ValueError(
            f"data.options.colours={colours!r} must be a non-empty list of names from {list(COLOURS)}"
        )
    unknown = [c for c in colours if c not in COLOURS]
    if unknown:
        raise ValueError(f"data.options.colours: unknown colour(s) {unknown}; choose from {list(COLOURS)}")
    return tuple(colours)


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    direction: str
    radius: float  # pixels
    x: float  # centre at frame 0, pixels
    y: float
    speed: float  # pixels per frame


@dataclass(frozen=True)
class ClipSpec:
    num_frames: int
    height: int
    width: int
    background: str
    texture: str
    shapes: tuple[Shape, ...]

    @property
    def caption(self) -> str:
        parts = [f"a {s.colour} {s.kind} moving {s.direction}" for s in self.shapes]
        texture = "" if self.texture == "plain" else f"{self.texture} "
        return f"{' and '.join(parts)} on a {texture}{self.background} background"


def render(spec: ClipSpec) -> torch.Tensor:
    """ClipSpec -> (3, f, h, w) float32 video in [-1, 1]."""
    f, h, w = spec.num_frames, spec.height, spec.width
    bg = torch.tensor(BACKGROUNDS[spec.background]).view(3, 1, 1, 1)
    video = bg.expand(3, f, h, w).clone()
    ys = torch.arange(h, dtype=torch.float32).view(1, h, 1)
    xs = torch.arange(w, dtype=torch.float32).view(1, 1, w)
    if spec.texture == "striped":  # diagonal stripes, slightly brighter than the background
        stripes = ((xs + ys) // 4 % 2 == 0).expand(f, h, w)
        video = torch.where(stripes, video + 0.3, video)
    t = torch.arange(f, dtype=torch.float32).view(f, 1, 1)
    for s in spec.shapes:
        dx, dy = DIRECTIONS[s.direction]
        cx = (s.x + dx * s.speed * t) % w  # (f, 1, 1), wrapping keeps the shape in view
        cy = (s.y + dy * s.speed * t) % h
        # distance on the torus, so a shape crossing an edge re-enters on the other side whole
        ddx = torch.minimum((xs - cx).abs(), w - (xs - cx).abs())
        ddy = torch.minimum((ys - cy).abs(), h - (ys - cy).abs())
        if s.kind == "circle":
            mask = ddx**2 + ddy**2 <= s.radius**2
        else:
            mask = (ddx <= s.radius) & (ddy <= s.radius)
        colour = torch.tensor(COLOURS[s.colour]).view(3, 1, 1, 1)
        video = torch.where(mask.unsqueeze(0), colour, video)
    return video.clamp(-1, 1)


class SyntheticClips(Dataset):
    """``num_clips`` procedural clips; clip i is the same for the same seed on every process."""

    def __init__(
        self,
        num_clips: int = 2048,
        frame_counts: tuple[int, ...] = (1, 5, 9),
        resolutions: tuple[tuple[int, int], ...] = ((16, 16), (16, 24), (24, 16)),
        max_shapes: int = 2,
        seed: int = 0,
        colours: tuple[str, ...] | None = None,
    ):
        if num_clips <= 0:
            raise ValueError(f"data.num_clips must be positive, got {num_clips}")
        if not frame_counts or not resolutions:
            raise ValueError("data.frame_counts and data.resolutions need at least one entry each")
        self.num_clips = num_clips
        self.frame_counts = tuple(frame_counts)
        self.resolutions = tuple(tuple(r) for r in resolutions)
        self.max_shapes = max_shapes
        self.seed = seed
        self.colours = check_colours(colours)

    def __len__(self) -> int:
        return self.num_clips

    def spec(self, index: int) -> ClipSpec:
        rng = random.Random(self.seed * 1_000_003 + index)
        num_frames = rng.choice(self.frame_counts)
        height, width = rng.choice(self.resolutions)
        shapes = []
        for _ in range(rng.randint(1, self.max_shapes)):
            radius = rng.uniform(0.18, 0.28) * min(height, width)
            shapes.append(
                Shape(
                    kind=rng.choice(SHAPES),
                    colour=rng.choice(self.colours),
                    direction=rng.choice(list(DIRECTIONS)),
                    radius=radius,
                    x=rng.uniform(0, width),
                    y=rng.uniform(0, height),
                    speed=rng.uniform(0.6, 1.5),
                )
            )
        return ClipSpec(
            num_frames, height, width, rng.choice(list(BACKGROUNDS)), rng.choice(TEXTURES), tuple(shapes)
        )

    def meta(self, index: int) -> ClipMeta:
        s = self.spec(index)
        return ClipMeta(s.num_frames, s.height, s.width)

    def __getitem__(self, index: int) -> dict:
        s = self.spec(index)
        return {"video": render(s), "caption": s.caption, "index": index}
