"""Loader: workers and prefetch, list batches of mixed shapes, exact resume; plug-ins by name."""

import pytest
import torch

from data.build import build_dataset
from data.loader import ResumableSampler, build_dataloader
from data.tokens import latent_shape


def _indices(batches):
    return [[s["index"] for s in b] for b in batches]


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
    loader = build_dataloader(ds, batch_size=4, num_workers=2, prefetch_factor=2, seed=0)
    batches = list(loader)
    assert len(batches) == 3 and all(isinstance(b, list) and len(b) == 4 for b in batches)
    shapes = {tuple(s["latent"].shape) for b in batches for s in b}
    assert len(shapes) > 1  # mixed shapes survive collation
    assert sorted(i for b in _indices(batches) for i in b) == list(range(12))
    assert loader.epoch == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_and_across_epochs_is_exact(num_workers):
    ds = build_dataset("data.examples.plugin:RandomLatents", plugin_args={"num_clips": 10})
    ref = build_dataloader(ds, batch_size=3, num_workers=num_workers, seed=5)
    full = _indices(b for _ in range(3) for b in ref)  # three epochs uninterrupted
    run = build_dataloader(ds, batch_size=3, num_workers=num_workers, seed=5)
    got = []
    it = run.batches()
    for _ in range(5):  # into the second epoch (4 batches per epoch), stop with workers prefetching ahead
        got.append([s["index"] for s in next(it)])
    state = run.state_dict()
    assert state["epoch"] == 1 and state["position"] == 3
    resumed = build_dataloader(ds, batch_size=3, num_workers=num_workers, seed=5)
    resumed.load_state_dict(state)
    for _ in range(2):
        got += _indices(resumed)
    flat = lambda bs: [i for b in bs for i in b]  # noqa: E731
    assert flat(got) == flat(full)
    assert sorted(flat(full)[:10]) == list(range(10)) and flat(full)[:10] != flat(full)[10:20]


def test_state_from_another_dataset_is_refused():
    s = ResumableSampler(10, seed=1)
    with pytest.raises(ValueError, match="num_samples"):
        s.load_state_dict(ResumableSampler(11, seed=1).state_dict())


def test_ranks_get_disjoint_equal_shares():
    orders = [ResumableSampler(10, seed=3, rank=r, world_size=4).order(0) for r in range(4)]
    assert all(len(o) == 3 for o in orders)
    assert set().union(*orders) == set(range(10))
    with pytest.raises(ValueError, match="rank"):
        ResumableSampler(10, rank=4, world_size=4)


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
    samples = [s for b in build_dataloader(ds, batch_size=2, num_workers=2, shuffle=False) for s in b]
    assert [s["index"] for s in samples] == list(range(5))
    for s in samples:
        torch.testing.assert_close(s["latent"], clips[s["index"]]["video"])


def test_breaking_out_and_iterating_again_continues_where_it_stopped():
    ds = build_dataset("data.examples.plugin:RandomLatents", plugin_args={"num_clips": 10})
    ref = [s["index"] for b in build_dataloader(ds, 3, num_workers=2, seed=5) for s in b]
    loader = build_dataloader(ds, 3, num_workers=2, seed=5)
    got = []
    for batch in loader:  # a trainer that stops for validation, then carries on with the same loader
        got += [s["index"] for s in batch]
        break
    got += [s["index"] for batch in loader for s in batch]
    assert got == ref and loader.state_dict()["epoch"] == 1
