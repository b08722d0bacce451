"""Make small real video files with the ffmpeg binary bundled by imageio-ffmpeg (tests and bench/).

Real encoders (libx264, libvpx-vp9) so that readers are tested on what users have, not on arrays.
"""

from __future__ import annotations

import os
import subprocess

CODECS = {  # extension -> ffmpeg encoder arguments
    ".mp4": ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"],
    ".webm": ["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-pix_fmt", "yuv420p"],
    ".mkv": ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"],
}


def ffmpeg_exe() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def make_video(
    path: str | os.PathLike, width: int, height: int, fps: float, num_frames: int, gop: int | None = None
) -> str:
    """Encode a moving test pattern of exactly ``num_frames`` frames; the codec follows the extension.
    ``gop``: keyframe interval in frames (None: the encoder's default, 250 for x264)."""
    path = str(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in CODECS:
        raise ValueError(f"make_video: extension {ext!r} unsupported; use one of {sorted(CODECS)}")
    cmd = [ffmpeg_exe(), "-y", "-hide_banner", "-loglevel", "error", "-f", "lavfi"]
    cmd += ["-i", f"testsrc2=size={width}x{height}:rate={fps}", "-frames:v", str(num_frames)]
    gop_args = [] if gop is None else ["-g", str(gop)]
    subprocess.run(cmd + CODECS[ext] + gop_args + [path], check=True)
    return path
