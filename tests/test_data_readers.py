"""Readers on real H.264 and VP9 files: metadata, frames by index, decord against PyAV."""

import av
import numpy as np
import pytest
from _data_media import CLIPS, LEVEL, frame_indices, make_clips, make_indexed_video

from data.media import make_video
from data.readers import VideoReadError, _torchcodec, probe, read_frames

# An optional extra (README): the tests that need it are skipped, with this reason, where it cannot load.
TORCHCODEC = pytest.param(
    "torchcodec",
    marks=pytest.mark.skipif(
        _torchcodec() is None, reason="torchcodec is not installed or cannot load its FFmpeg libraries"
    ),
)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return make_clips(str(tmp_path_factory.mktemp("clips")), captions=False)


@pytest.mark.parametrize("backend", ["decord", "pyav", TORCHCODEC])
def test_probe_reads_true_metadata(clips, backend):
    for path, (_, w, h, fps, n) in zip(clips, CLIPS):
        info = probe(path, backend)
        assert (info.num_frames, info.height, info.width) == (n, h, w), path
        assert info.fps == pytest.approx(fps, rel=1e-3), path


def _sequential(path):
    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


def test_frames_by_index_match_sequential_decode(clips, tmp_path):
    # short keyframe intervals, so that seeking to a keyframe (not decoding from frame 0) is exercised
    gops = [make_video(tmp_path / f"gop{ext}", 32, 24, 25, 40, gop=8) for ext in (".mp4", ".webm")]
    for path, (_, w, h, _, n) in zip(clips + gops, CLIPS + [("", 32, 24, 25, 40)] * 2):
        every = _sequential(path)  # (n, h, w, 3), every frame decoded in order
        assert every.shape == (n, h, w, 3) and every.dtype == np.uint8
        for picks in ([n - 1, 0, n // 2, n // 2], [n // 2, n - 1], [n - 3, n - 2]):  # out of order, repeated
            for backend in ("decord", "pyav"):
                got = read_frames(path, picks, backend)
                # decord and PyAV share ffmpeg's decoder; colour conversion may differ by a level or two
                diff = np.abs(got.astype(int) - every[picks].astype(int)).mean()
                assert diff < 3.0, (path, backend, picks, diff)
                assert backend == "decord" or (got == every[picks]).all()  # same decoder: bit-exact


@pytest.mark.parametrize("ext", [".mp4", ".webm"])
@pytest.mark.parametrize("backend", ["decord", "pyav", TORCHCODEC])
def test_frames_by_index_are_exactly_the_requested_frames(tmp_path, ext, backend):
    """Frame i of this clip is grey LEVEL * i, so each returned frame names its own index: an
    off-by-one reader fails here, where the mean difference of neighbouring test-pattern frames
    (0.45-0.96 levels) hides inside the tolerance above."""
    n = 30
    path = make_indexed_video(str(tmp_path / f"indexed{ext}"), n, gop=8)
    for picks in ([0], [n - 1, 0, 13, 13], [9, 17, 25], [1, 2, 3, 4, 5, 6, 7, 8], [n - 2, n - 1]):
        got = read_frames(path, picks, backend)
        assert frame_indices(got) == picks, (backend, picks, [float(f.mean()) for f in got])
        assert all(abs(float(f.mean()) - LEVEL * i) < LEVEL / 4 for f, i in zip(got, picks))


@pytest.mark.parametrize("backend", [TORCHCODEC])
def test_torchcodec_frames_equal_pyav_frames(clips, tmp_path, backend):
    """The same frame indices through torchcodec and through PyAV, on H.264 and VP9 files made with
    imageio-ffmpeg's ffmpeg, with short keyframe intervals so both seek: equal bit for bit (the same
    FFmpeg decoders and RGB conversion), and the same metadata. Planted an off-by-one in
    _read_torchcodec (indices + 1) -> fails."""
    gops = [make_video(tmp_path / f"gop{ext}", 32, 24, 25, 40, gop=8) for ext in (".mp4", ".webm")]
    for path in clips + gops:
        n = probe(path, "pyav").num_frames
        assert probe(path, "torchcodec") == probe(path, "pyav"), path
        for picks in ([n - 1, 0, n // 2, n // 2], [n // 2, n - 1], list(range(n))):
            a, b = read_frames(path, picks, "torchcodec"), read_frames(path, picks, "pyav")
            assert a.dtype == b.dtype == np.uint8 and a.shape == b.shape and (a == b).all(), (path, picks)
        with pytest.raises(VideoReadError) as e:
            read_frames(path, [0, n], "torchcodec")
        assert e.value.reason == "too_few_frames"


def test_reading_past_the_end_is_a_counted_error(clips):
    path, n = clips[0], CLIPS[0][4]
    for backend in ("decord", "pyav"):
        with pytest.raises(VideoReadError) as e:
            read_frames(path, [0, n + 5], backend)
        assert e.value.reason == "too_few_frames" and e.value.path == path


def test_broken_inputs_raise_video_read_error(tmp_path):
    (tmp_path / "zero.mp4").write_bytes(b"")
    (tmp_path / "text.mp4").write_text("not a video")
    (tmp_path / "dir.mp4").mkdir()
    cases = {
        "zero.mp4": "zero_bytes",
        "text.mp4": "not_a_video_or_corrupt",
        "dir.mp4": "not_a_file",
        "gone.mp4": "missing_file",
    }
    for name, reason in cases.items():
        for backend in ("auto", "pyav"):
            with pytest.raises(VideoReadError) as e:
                probe(tmp_path / name, backend)
            assert e.value.reason == reason, (name, backend, e.value)


def test_unknown_backend_is_a_value_error(clips):
    with pytest.raises(ValueError, match="decord"):
        probe(clips[0], "opencv")


def test_planning_imports_no_video_decoder(tmp_path):
    """A rank that builds its dataset and plans (token counts from metadata) imports neither decord nor
    PyAV: about 20 MB of resident memory per rank (bench/bench_index.py: 309 -> 288 MB), loaded on the
    first decode instead. Planted `import av` back at the top of data/readers.py -> this test fails."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "a.mp4").write_bytes(b"")  # rows with metadata are trusted: never opened while planning
    (tmp_path / "m.csv").write_text("path,text,num_frames,height,width,fps\na.mp4,a dog,33,64,64,16\n")
    code = (
        "import sys\n"
        "from data.build import build_dataset\n"
        "import data.cache, data.cache_dataset, data.scan, dit.batching, dynamic_cp.planning.planner\n"
        f"ds = build_dataset({str(tmp_path / 'm.csv')!r}, progress=False)\n"
        "assert ds.meta(0).num_frames == 33\n"
        "print(sorted(m for m in ('av', 'decord', 'torchcodec') if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)}, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported at start-up: {out.stdout}"


def test_pyav_reads_in_a_process_forked_after_this_one_read(clips):
    """A DataLoader worker or a gloo rank is forked from a process that may have decoded already: its
    reads must not reuse the parent's colour converter, whose threads it does not have (issue 58: a
    rank hung at its first clip). Planted: ``frame.to_ndarray(format="rgb24")`` in ``_read_pyav``, PyAV's
    per-thread converter -> the child's read never returns and ``get`` times out."""
    import multiprocessing

    want = read_frames(clips[0], [0, 1], "pyav")  # this process decodes first, as the test before did
    with multiprocessing.get_context("fork").Pool(1) as child:  # leaving terminates the child
        # a read takes well under a second; minutes on a loaded host still mean a hang, not slowness
        got = child.apply_async(read_frames, (clips[0], [0, 1], "pyav")).get(timeout=120)
    np.testing.assert_array_equal(got, want)
