"""Clip policy from metadata alone: frame snapping, resolution by token budget, skips, crops."""

import pytest

from data.clip_policy import ClipPolicy, ClipSkip
from data.readers import VideoInfo
from data.types import ClipMeta


def test_design_table_token_counts():
    p = ClipPolicy(fps=16, max_frames=81)
    m = p.plan(VideoInfo(num_frames=200, height=720, width=1280, fps=16))
    assert m == ClipMeta(81, 720, 1280) and p.tokens(m) == 75_600
    m = p.plan(VideoInfo(num_frames=200, height=480, width=832, fps=16))
    assert p.tokens(m) == 32_760


def test_frames_follow_target_fps_and_snap_to_4k_plus_1():
    p = ClipPolicy(fps=12)  # 30 frames at 24 fps -> 15 frames at 12 fps -> 13 = 4*3 + 1
    info = VideoInfo(30, 32, 48, 24.0)
    assert p.plan(info).num_frames == 13
    assert p.frame_indices(info, p.plan(info), 0) == [2 * k + 3 for k in range(13)]  # centred window
    pixel = ClipPolicy(fps=12, vae_stride=(1, 1, 1), patch=(1, 1, 1))
    assert pixel.plan(info).num_frames == 15  # pixel space keeps any count
    assert ClipPolicy(frame_rule="any").plan(info).num_frames == 30


def test_resolution_keeps_aspect_and_multiples():
    p = ClipPolicy(resolution=256)
    for h, w in [(720, 1280), (1080, 1920), (480, 640), (1280, 720), (500, 500)]:
        m = p.plan(VideoInfo(9, h, w, 24))
        assert m.height % 16 == 0 and m.width % 16 == 0
        assert abs(m.width / m.height - w / h) < 0.15 * w / h
        assert 0.8 * 256**2 <= m.height * m.width <= 1.2 * 256**2


def test_token_budget_shrinks_resolution_then_frames():
    p = ClipPolicy(max_tokens=4096)
    m = p.plan(VideoInfo(81, 720, 1280, 16))
    assert p.tokens(m) <= 4096 and m.num_frames == 81
    assert abs(m.width / m.height - 16 / 9) < 0.2
    tiny = ClipPolicy(max_tokens=4)  # below one latent frame of 2x2 patches at 81 frames: fewer frames
    m = tiny.plan(VideoInfo(81, 32, 32, 16))
    assert tiny.tokens(m) <= 4 and (m.num_frames - 1) % 4 == 0


def test_skips_are_reasons_not_crashes():
    with pytest.raises(ClipSkip) as e:
        ClipPolicy(min_frames=17).plan(VideoInfo(10, 64, 64, 24))
    assert e.value.reason == "too_short"
    with pytest.raises(ClipSkip) as e:
        ClipPolicy(min_tokens=1000).plan(VideoInfo(5, 64, 64, 24))
    assert e.value.reason == "too_few_tokens"


def test_random_crop_depends_on_index_and_seed_only():
    import numpy as np

    frames = np.random.default_rng(0).integers(0, 255, (5, 40, 60, 3), dtype=np.uint8)
    p = ClipPolicy(crop="random", resolution=None, vae_stride=(1, 1, 1), patch=(1, 8, 8), seed=3)
    meta = ClipMeta(5, 24, 48)  # resized to 32x48, then cropped to 24 rows: 8 rows of freedom
    a, b = p.to_tensor(frames, meta, 7), p.to_tensor(frames, meta, 7)
    assert a.shape == (3, 5, 24, 48) and (a == b).all()
    others = [p.to_tensor(frames, meta, i) for i in range(8)]
    assert any(not (o == a).all() for o in others)
    c = ClipPolicy(crop="centre", vae_stride=(1, 1, 1), patch=(1, 8, 8)).to_tensor(frames, meta, 0)
    assert c.min() >= -1 and c.max() <= 1


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"crop": "left"}, "crop"),
        ({"frame_rule": "8k"}, "frame_rule"),
        ({"fps": 0}, "fps"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"resolution": 4}, "resolution"),
    ],
)
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ClipPolicy(**kwargs)
