"""The trainer's data path (``dit.batching.step_loader``): workers and prefetch, list batches of mixed
shapes, a resume that starts at the checkpoint's step; plug-ins by name.

It replaced ``data.loader``'s ResumableLoader (one path, not two): the clip order is a pure function
of (seed, step), so the data position in a checkpoint is the step number.
"""

import pytest
import torch

from data.build import build_dataset
from data.tokens import latent_shape
from dit.batching import step_loader


def _indices(batches):
    return [[s["index"] for s in b] for b in batches]


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_plugin_examples_load_by_name():
    clips = build_dataset("data.examples.plugin:ColourRamps", plugin_args={"num_clips": 3, "num_frames": 5})
    s = clips[2]
    assert s["video"].shape == (3, 5, 32, 48) and s["video"].dtype == torch.float32 and s["index"] == 2
    assert (
        s["caption"] == "a colour ramp number 2 sliding right"
        and -1 <= s["video"].min() <= s["video"].max() <= 1
    )
    lat = build_dataset("data.examples.plugin:RandomLatents", plugin_args={"num_clips": 6})
    for i in range(len(lat)):
        m = lat.meta(i)
        assert lat[i]["latent"].shape[1:] == latent_shape(m.num_frames, m.height, m.width, lat.vae_stride)
    with pytest.raises(ValueError, match="cannot import"):
        build_dataset("no_such_pkg.mod:Thing")
    with pytest.raises(ValueError, match="has no"):
        build_dataset("data.examples.plugin:Nope")


def test_batches_are_lists_of_variable_shapes_through_workers():
    ds = build_dataset("data.examples.plugin:RandomLatents", plugin_args={"num_clips": 12})
    batches = _take(step_loader(ds, range(12), batch_size=4, seed=0, num_workers=2), 3)  # one epoch
    assert all(isinstance(b, list) and len(b) == 4 for b in batches)
    shapes = {tuple(s["latent"].shape) for b in batches for s in b}
    assert len(shapes) > 1  # mixed shapes survive collation
    assert sorted(i for b in _indices(batches) for i in b) == list(range(12))  # each clip once an epoch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_and_across_epochs_is_exact(num_workers):
    ds = build_dataset("data.examples.plugin:RandomLatents", plugin_args={"num_clips": 10})
    full = _indices(_take(step_loader(ds, range(10), 3, seed=5, num_workers=num_workers), 8))
    # a run killed after step 5 (mid second epoch, workers prefetching ahead) resumes at step 5
    resumed = _indices(_take(step_loader(ds, range(10), 3, seed=5, start_step=5, num_workers=num_workers), 3))
    assert resumed == full[5:]
    flat = [i for b in full for i in b]
    assert sorted(flat[:10]) == list(range(10)) and flat[:10] != flat[10:20]  # reshuffled per epoch


def test_latent_cache_reads_in_workers(tmp_path):
    from data.cache import build_cache
    from data.hashed_text import HashedTextEncoder
    from data.vaes import IdentityVAE

    clips = build_dataset("data.examples.plugin:ColourRamps", plugin_args={"num_clips": 5, "num_frames": 3})
    build_cache(
        clips,
        IdentityVAE(),
        HashedTextEncoder(),
        str(tmp_path / "c"),
        shard_size=2,
        dtype="float32",
        progress=False,
    )
    ds = build_dataset(str(tmp_path / "c"))
    assert ds.vae_stride == (1, 1, 1)
    samples = [s for b in _take(step_loader(ds, range(5), 5, seed=0, num_workers=2), 2) for s in b]
    assert sorted(s["index"] for s in samples[:5]) == list(range(5))
    for s in samples:
        torch.testing.assert_close(s["latent"], clips[s["index"]]["video"])
