"""Video readers: probe metadata and decode frames *by index*: torchcodec, decord or PyAV.

``auto`` picks the first installed in that order, fastest first at the clip workload (docs/data.md).

Only the frames a clip needs are decoded: decord seeks to them, PyAV stops at the last one needed.
Every failure surfaces as ``VideoReadError`` with the path and a short reason, so callers can
skip, count and log it instead of crashing (see data/failures.py).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from fractions import Fraction
from importlib import import_module

import numpy as np

from data.native_stderr import QUIET_NATIVE_STDERR

BACKENDS = ("auto", "decord", "pyav", "torchcodec")
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")  # a still image is a one-frame clip


class VideoReadError(RuntimeError):
    """A file could not be probed or decoded. ``reason`` is a short tag for counting."""

    def __init__(self, path: str, reason: str, detail: str = ""):
        self.path, self.reason, self.detail = str(path), reason, detail
        super().__init__(f"{path}: {reason}" + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class VideoInfo:
    """Source metadata of one file, as a manifest row stores it."""

    num_frames: int
    height: int
    width: int
    fps: float


def _check_file(path: str) -> None:
    # Cheap checks first: they give clearer reasons than a decoder error string.
    if not os.path.exists(path):
        raise VideoReadError(path, "missing_file")
    if not os.path.isfile(path):
        raise VideoReadError(path, "not_a_file", "a directory or device, not a video file")
    if not os.access(path, os.R_OK):
        raise VideoReadError(path, "unreadable", "no read permission")
    if os.path.getsize(path) == 0:
        raise VideoReadError(path, "zero_bytes")


def _decord():
    """decord, or None where it is not installed (it ships wheels for x86_64 Linux only; everything
    works without it, slower). Imported on first use, as PyAV is: the two hold about 20 MB of resident
    memory, which a rank that only plans (a latent cache) never needs (bench/bench_index.py)."""
    try:
        decord = import_module("decord")
    except Exception:  # ImportError, or a broken native library: the platform decides
        return None
    decord.logging.set_level(decord.logging.QUIET)
    return decord


@functools.cache  # a wheel that cannot load its libraries would retry them on every clip
def _torchcodec():
    """torchcodec's decoders, or None where it is not installed or cannot load (an optional extra: it
    needs system FFmpeg libraries, and its PyPI wheels from 0.14 on link CUDA's libraries; README)."""
    try:
        return import_module("torchcodec.decoders")
    except Exception:  # ImportError, or RuntimeError/OSError from loading its native libraries
        return None


def choose_reader(
    reader: str | None, backend: str | None, keys: tuple[str, str] = ("reader", "backend")
) -> str:
    """The reader named by ``reader`` (data.reader, --reader) or by its deprecated alias ``backend``
    (data.options.backend, --option backend=); None = not given, neither given = 'auto'. A ValueError
    in one line for a name not in ``BACKENDS`` or two that disagree. ``keys`` name the two in messages."""
    for key, value in zip(keys, (reader, backend)):
        if value is not None and value not in BACKENDS:
            raise ValueError(f"{key}={value!r} is not a video reader; choose one of {', '.join(BACKENDS)}")
    if backend is not None:
        warnings.warn(f"{keys[1]} is deprecated: name the video reader with {keys[0]}", DeprecationWarning, 2)
    if reader is not None and backend is not None and reader != backend:
        raise ValueError(
            f"{keys[0]}={reader!r} and {keys[1]}={backend!r} disagree; drop {keys[1]} (the old name of {keys[0]})"
        )
    return reader or backend or "auto"


def check_backend(backend: str) -> str:
    """The reader ``backend`` names ('auto': the first installed); a ``ValueError`` naming the fix when
    it is unknown or not installed. Datasets call it when built, before any file is read or written."""
    if backend not in BACKENDS:
        raise ValueError(f"reader {backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if backend == "auto":  # fastest first at the clip workload (docs/data.md "Decode speed")
        if _torchcodec() is not None:
            return "torchcodec"
        return "decord" if _decord() is not None else "pyav"
    if backend == "decord" and _decord() is None:
        raise ValueError(
            "reader 'decord' is set (data.reader, --reader) but decord is not installed: pip install decord "
            "(x86_64 Linux wheels only), or set the reader to 'pyav' or 'auto'"
        )
    if backend == "torchcodec" and _torchcodec() is None:
        raise ValueError(
            "reader 'torchcodec' is set (data.reader, --reader) but torchcodec is not installed or cannot "
            "load its FFmpeg libraries: see README.md (optional extra), or set the reader to 'pyav' or 'auto'"
        )
    return backend


# ---------------------------------------------------------------- decord


def _decord_reader(path: str):
    try:
        with QUIET_NATIVE_STDERR:  # decord prints its own "ERROR opening" line before raising
            return _decord().VideoReader(path, num_threads=1)
    except Exception as e:  # decord raises RuntimeError/DECORDError with long C++ traces
        raise VideoReadError(path, "not_a_video_or_corrupt", str(e).splitlines()[0][:200]) from e


def _probe_decord(path: str) -> VideoInfo:
    vr = _decord_reader(path)
    with QUIET_NATIVE_STDERR:
        h, w = vr[0].shape[:2] if len(vr) else (0, 0)
    return VideoInfo(len(vr), int(h), int(w), float(vr.get_avg_fps()))


def _read_decord(path: str, indices: list[int]) -> np.ndarray:
    vr = _decord_reader(path)
    if max(indices) >= len(vr):
        raise VideoReadError(path, "too_few_frames", f"needs frame {max(indices)}, file has {len(vr)}")
    try:
        with QUIET_NATIVE_STDERR:
            return vr.get_batch(indices).asnumpy()  # (f, h, w, 3) uint8
    except Exception as e:
        raise VideoReadError(path, "decode_error", str(e).splitlines()[0][:200]) from e


# ---------------------------------------------------------------- PyAV


def _open_av(path: str):
    import av  # on first use: see _decord

    try:
        container = av.open(path)
    except Exception as e:
        raise VideoReadError(path, "not_a_video_or_corrupt", str(e)[:200]) from e
    if not container.streams.video:
        container.close()
        raise VideoReadError(path, "no_video_stream")
    return container


def _probe_pyav(path: str) -> VideoInfo:
    with _open_av(path) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or Fraction(0)
        num_frames = stream.frames
        if num_frames <= 0:
            # WebM/Matroska store no frame count: count packets (demux only, no decoding).
            num_frames = sum(1 for p in container.demux(stream) if p.size > 0)
        return VideoInfo(
            int(num_frames), stream.codec_context.height, stream.codec_context.width, float(rate)
        )


def _packet_index(container, stream) -> tuple[list[int], list[int]] | None:
    """Presentation timestamps of all frames, in order, and those of keyframes: demux only, no decoding.
    None when timestamps are missing (some AVI files): the caller then decodes from the start."""
    pts, keys = [], []
    for p in container.demux(stream):
        if p.size == 0:
            continue  # the flush packet at the end
        if p.pts is None:
            return None
        pts.append(p.pts)
        if p.is_keyframe:
            keys.append(p.pts)
    pts.sort()
    return (pts, keys) if pts and len(set(pts)) == len(pts) else None


def _read_pyav(path: str, indices: list[int]) -> np.ndarray:
    wanted = set(indices)
    first, last = min(indices), max(indices)
    got = {}
    # This read's own colour converter: PyAV's frame.to_ndarray keeps one per thread, whose swscale
    # slice threads a forked child (a DataLoader worker, a gloo rank) does not inherit, so the child's
    # first conversion of the same frame size waits for them forever (seen: a rank forked after the
    # parent had decoded, stuck in avpriv_slicethread_execute at "encoding clips: 0/6").
    from av.video.reformatter import VideoReformatter  # on first use, as av in _open_av

    rgb = VideoReformatter()
    with _open_av(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            index = _packet_index(container, stream) if first > 0 else None
            if index is not None and last < len(index[0]):
                # Seek to the keyframe before the first wanted frame and find frames by timestamp, as
                # decord does: a clip from the middle of a long file costs one GOP, not the whole prefix.
                pts, keys = index
                position = {t: i for i, t in enumerate(pts)}
                container.seek(max([k for k in keys if k <= pts[first]] or [pts[0]]), stream=stream)
                frames = ((position.get(f.pts, -1), f) for f in container.decode(stream))
            else:
                if index is not None:  # the packet index was read: rewind before decoding from the start
                    container.seek(0)
                frames = enumerate(container.decode(stream))
            for i, frame in frames:
                if i in wanted:
                    got[i] = rgb.reformat(frame, format="rgb24").to_ndarray()
                if i >= last:
                    break  # stop at the last frame needed: never decode the rest of the file
        except Exception as e:
            raise VideoReadError(path, "decode_error", str(e)[:200]) from e
    missing = wanted - set(got)
    if missing:
        raise VideoReadError(path, "too_few_frames", f"frames {sorted(missing)[:5]} not decodable")
    return np.stack([got[i] for i in indices])


# ---------------------------------------------------------------- torchcodec


def _torchcodec_decoder(path: str):
    try:
        with QUIET_NATIVE_STDERR:
            # exact seek mode scans the file once: frame counts and indices then match PyAV's
            return _torchcodec().VideoDecoder(path, device="cpu", seek_mode="exact", num_ffmpeg_threads=1)
    except Exception as e:  # RuntimeError with the C++ source location first
        raise VideoReadError(path, "not_a_video_or_corrupt", str(e).splitlines()[0][-200:]) from e


def _probe_torchcodec(path: str) -> VideoInfo:
    m = _torchcodec_decoder(path).metadata
    # the header's rate, as PyAV reports it (torchcodec's average_fps divides by a rounded duration)
    fps = m.average_fps_from_header or m.average_fps or 0.0
    return VideoInfo(int(m.num_frames or 0), int(m.height or 0), int(m.width or 0), float(fps))


def _read_torchcodec(path: str, indices: list[int]) -> np.ndarray:
    decoder = _torchcodec_decoder(path)
    if max(indices) >= len(decoder):
        raise VideoReadError(path, "too_few_frames", f"needs frame {max(indices)}, file has {len(decoder)}")
    try:
        with QUIET_NATIVE_STDERR:
            frames = decoder.get_frames_at(indices).data  # (f, 3, h, w) uint8
    except Exception as e:
        raise VideoReadError(path, "decode_error", str(e).splitlines()[0][-200:]) from e
    return frames.permute(0, 2, 3, 1).numpy()  # (f, h, w, 3)


# ---------------------------------------------------------------- still images


def _is_image(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in IMAGE_EXTS


def _read_image(path: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))  # (h, w, 3) uint8
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise VideoReadError(path, "not_an_image_or_corrupt", str(e)[:200]) from e


def _probe_image(path: str) -> VideoInfo:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            w, h = im.size  # header only
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise VideoReadError(path, "not_an_image_or_corrupt", str(e)[:200]) from e
    return VideoInfo(1, h, w, 1.0)  # any positive rate: one frame is one frame at every fps


# ---------------------------------------------------------------- public API


def probe(path: str | os.PathLike, backend: str = "auto") -> VideoInfo:
    """Frame count, size and fps of a file, without decoding more than the first frame."""
    path = str(path)
    _check_file(path)
    backend = check_backend(backend)
    if _is_image(path):
        return _probe_image(path)
    probers = {"decord": _probe_decord, "torchcodec": _probe_torchcodec, "pyav": _probe_pyav}
    try:
        info = probers[backend](path)
    except VideoReadError:
        if backend != "pyav":  # decord rejects some containers PyAV reads: try before giving up
            info = _probe_pyav(path)
        else:
            raise
    if info.num_frames <= 0 or info.height <= 0 or info.width <= 0:
        raise VideoReadError(path, "empty_video", f"{info}")
    if not info.fps > 0:
        raise VideoReadError(path, "no_fps", "the stream has no frame rate")
    return info


def read_frames(path: str | os.PathLike, indices: list[int], backend: str = "auto") -> np.ndarray:
    """Frames at the given source indices -> (len(indices), h, w, 3) uint8. Indices may repeat."""
    path = str(path)
    if not indices:
        raise ValueError("read_frames needs at least one frame index")
    _check_file(path)
    backend = check_backend(backend)
    if _is_image(path):
        if max(indices) > 0:
            raise VideoReadError(path, "too_few_frames", f"needs frame {max(indices)} of a still image")
        return np.stack([_read_image(path)] * len(indices))
    if backend != "pyav":
        try:
            return (_read_decord if backend == "decord" else _read_torchcodec)(path, indices)
        except VideoReadError as e:
            if e.reason == "too_few_frames":
                raise
            return _read_pyav(path, indices)  # failed to open/decode: PyAV may still manage
    return _read_pyav(path, indices)
