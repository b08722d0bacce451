"""Real media for the data tests, encoded with imageio-ffmpeg's ffmpeg (H.264 mp4, VP9 webm)."""

from __future__ import annotations

import os
import random

from data.media import make_video

# (name, width, height, fps, frames): several resolutions, rates, durations and both codecs.
CLIPS = [
    ("h264_48x32_24fps.mp4", 48, 32, 24, 30),
    ("vp9_32x24_30fps.webm", 32, 24, 30, 21),
    ("h264_64x36_25fps.mp4", 64, 36, 25, 50),
    ("vp9_40x56_12fps.webm", 40, 56, 12, 13),
    ("h264_32x32_8fps.mp4", 32, 32, 8, 3),
]


def make_clips(folder: str, captions: bool = True) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, w, h, fps, n in CLIPS:
        p = make_video(os.path.join(folder, name), w, h, fps, n)
        if captions:
            with open(os.path.splitext(p)[0] + ".txt", "w") as f:
                f.write(f"a test pattern, {w}x{h} at {fps} fps")
        paths.append(p)
    return paths


def make_broken(folder: str, good_mp4: str) -> dict[str, str]:
    """Broken files next to good ones: name -> expected failure reason."""
    os.makedirs(folder, exist_ok=True)
    data = open(good_mp4, "rb").read()
    out = {}

    def write(name, payload, reason):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(payload)
        out[os.path.join(folder, name)] = reason

    write("zero.mp4", b"", "zero_bytes")
    write("notes.mp4", b"this is not a video\n" * 20, "not_a_video_or_corrupt")
    write("truncated.mp4", data[: len(data) // 2], "not_a_video_or_corrupt")  # moov atom lost
    # Seeded, never os.urandom: FFmpeg's LRC (lyrics) probe claims any file whose first byte is "[" and
    # PyAV opens it as a subtitle file, so ~1 random payload in 250 failed as no_video_stream, not as
    # the reason above (test_data_robustness.py::test_broken_media_are_the_same_bytes_every_run).
    write("garbage.webm", random.Random(31).randbytes(4096), "not_a_video_or_corrupt")
    return out


LEVEL = 8  # grey level step between frames of an index-encoded clip


def make_indexed_video(path: str, num_frames: int, gop: int = 8, size: int = 32, fps: int = 25) -> str:
    """A clip whose frame i is flat grey LEVEL * i: its content names its index, so a reader that
    returns a neighbouring frame is caught exactly (a moving test pattern changes too little between
    neighbours for a tolerance to tell them apart). Short GOPs make the readers seek."""
    import subprocess

    from data.media import CODECS, ffmpeg_exe

    if LEVEL * (num_frames - 1) > 255:
        raise ValueError(f"num_frames={num_frames}: at most {255 // LEVEL + 1} distinct grey levels")
    raw = b"".join(bytes([LEVEL * i]) * (size * size) for i in range(num_frames))
    ext = os.path.splitext(path)[1].lower()
    cmd = [ffmpeg_exe(), "-y", "-hide_banner", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "gray"]
    cmd += ["-s", f"{size}x{size}", "-r", str(fps), "-i", "-", *CODECS[ext], "-g", str(gop), path]
    subprocess.run(cmd, input=raw, check=True)
    return path


def frame_indices(frames) -> list[int]:
    """(f, h, w, 3) uint8 frames of an index-encoded clip -> the index each frame shows."""
    return [round(float(f.mean()) / LEVEL) for f in frames]
