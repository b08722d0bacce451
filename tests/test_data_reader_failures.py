"""Every failure reason of data/readers.py, and the decord -> PyAV fallbacks, on real files.

Each reason is a tag that the failure log counts (data/failures.py), so each one is checked by name.
"""

import os
import subprocess

import pytest
from _data_media import frame_indices, make_indexed_video

from data import readers
from data.media import ffmpeg_exe
from data.readers import VideoInfo, VideoReadError, probe, read_frames

N = 20


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_indexed_video(str(tmp_path_factory.mktemp("clip") / "indexed.mp4"), N, gop=8)


def _reason(fn, *args) -> str:
    with pytest.raises(VideoReadError) as e:
        fn(*args)
    assert e.value.path == str(args[0])
    return e.value.reason


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_read_frames_reasons_for_broken_files(tmp_path, backend):
    (tmp_path / "zero.mp4").write_bytes(b"")
    (tmp_path / "text.mp4").write_text("not a video")
    (tmp_path / "dir.mp4").mkdir()
    cases = {"zero.mp4": "zero_bytes", "text.mp4": "not_a_video_or_corrupt", "dir.mp4": "not_a_file",
             "gone.mp4": "missing_file"}  # fmt: skip
    for name, reason in cases.items():
        assert _reason(read_frames, tmp_path / name, [0], backend) == reason, name


def test_unreadable_file(clip, monkeypatch):
    real_access = os.access  # root reads any file, so deny the permission check instead of chmod
    monkeypatch.setattr(readers.os, "access", lambda p, mode: False if p == clip else real_access(p, mode))
    assert _reason(probe, clip) == "unreadable"
    assert _reason(read_frames, clip, [0]) == "unreadable"


def test_file_without_a_video_stream(tmp_path):
    path = str(tmp_path / "sound.mp4")
    cmd = [ffmpeg_exe(), "-y", "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i",
           "sine=frequency=440:duration=0.2", "-c:a", "aac", path]  # fmt: skip
    subprocess.run(cmd, check=True)
    for backend in ("decord", "pyav"):  # decord refuses it, then PyAV names the reason
        assert _reason(probe, path, backend) == "no_video_stream", backend
        assert _reason(read_frames, path, [0], backend) == "no_video_stream", backend


def test_images_broken_and_past_their_one_frame(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 6), (10, 20, 30)).save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    assert probe(tmp_path / "ok.png") == VideoInfo(1, 6, 8, 1.0)
    assert read_frames(tmp_path / "ok.png", [0, 0]).shape == (2, 6, 8, 3)
    assert _reason(read_frames, tmp_path / "ok.png", [1]) == "too_few_frames"
    assert _reason(probe, tmp_path / "bad.png") == "not_an_image_or_corrupt"
    assert _reason(read_frames, tmp_path / "bad.png", [0]) == "not_an_image_or_corrupt"


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_empty_video_and_missing_fps(clip, monkeypatch, backend):
    prober = "_probe_decord" if backend == "decord" else "_probe_pyav"
    monkeypatch.setattr(readers, prober, lambda p: VideoInfo(0, 32, 32, 25.0))
    assert _reason(probe, clip, backend) == "empty_video"
    monkeypatch.setattr(readers, prober, lambda p: VideoInfo(N, 32, 32, 0.0))
    assert _reason(probe, clip, backend) == "no_fps"


def test_decord_decode_error_falls_back_to_pyav(clip, monkeypatch):
    class Broken:
        def __init__(self, *a, **k):
            pass

        def __len__(self):
            return N

        def get_batch(self, indices):
            raise RuntimeError("decord: corrupt packet")

    monkeypatch.setattr(readers._decord(), "VideoReader", Broken)
    with pytest.raises(VideoReadError) as e:
        readers._read_decord(clip, [0])
    assert e.value.reason == "decode_error" and "corrupt packet" in e.value.detail
    # read_frames goes on with PyAV and returns exactly the requested frames
    assert frame_indices(read_frames(clip, [3, 11, 3], "decord")) == [3, 11, 3]


def test_decord_open_failure_falls_back_to_pyav(clip, monkeypatch):
    def refuse(path):
        raise VideoReadError(path, "not_a_video_or_corrupt", "decord cannot open this container")

    monkeypatch.setattr(readers, "_decord_reader", refuse)
    assert frame_indices(read_frames(clip, [19, 0], "decord")) == [19, 0]
    assert probe(clip, "decord") == probe(clip, "pyav")


def test_decord_too_few_frames_does_not_fall_back(clip, monkeypatch):
    """Past the end is a fact about the file, not a decoder quirk: PyAV is not asked again."""

    def must_not_run(path, indices):
        raise AssertionError("PyAV was asked after decord found the file too short")

    monkeypatch.setattr(readers, "_read_pyav", must_not_run)
    assert _reason(read_frames, clip, [0, N], "decord") == "too_few_frames"


def test_pyav_decode_error(clip, monkeypatch):
    real_open = readers._open_av

    class DecodeFails:  # the real container, except that decoding raises as on a corrupt packet
        def __init__(self, path):
            self.container = real_open(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.container.close()

        def __getattr__(self, name):
            return getattr(self.container, name)

        def decode(self, *args, **kwargs):
            raise RuntimeError("av: invalid data found when processing input")

    monkeypatch.setattr(readers, "_open_av", DecodeFails)
    assert _reason(read_frames, clip, [0], "pyav") == "decode_error"


def test_pyav_without_timestamps_decodes_from_the_start(clip, monkeypatch):
    """Files without packet timestamps (some AVI) take the decode-from-frame-0 path: same frames."""
    monkeypatch.setattr(readers, "_packet_index", lambda container, stream: None)
    assert frame_indices(read_frames(clip, [N - 1, 5, 5], "pyav")) == [N - 1, 5, 5]


def test_empty_index_list_is_a_value_error(clip):
    with pytest.raises(ValueError, match="at least one frame index"):
        read_frames(clip, [])
