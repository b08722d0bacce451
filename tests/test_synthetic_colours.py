"""data.options.colours restricts the synthetic palette (the LoRA demo's base never sees a colour)."""

import pytest

from data.build import build_dataset
from data.synthetic import COLOURS, SyntheticClips
from dit.config import DataConfig
from dit.setup import build_datasets


def _colours(ds):
    return {s.colour for i in range(len(ds)) for s in ds.spec(i).shapes}


def test_default_palette_is_every_colour_and_unchanged():
    ds = SyntheticClips(64, max_shapes=2)
    assert _colours(ds) == set(COLOURS)
    assert ds.spec(3) == SyntheticClips(64, max_shapes=2, colours=list(COLOURS)).spec(3)


def test_colours_restrict_train_and_val_sets_through_the_config():
    cfg = DataConfig(num_clips=48, num_val_clips=16, options={"colours": ["red", "blue"], "patch": [1, 2, 2]})
    train, _, val, _ = build_datasets(cfg, (1, 2, 2))
    assert _colours(train) == _colours(val) == {"red", "blue"}
    assert all("cyan" not in train[i]["caption"] for i in range(8))
    only = build_dataset("synthetic", num_clips=8, colours=["cyan"], vae_stride=(1, 1, 1), patch=(1, 1, 1))
    assert _colours(only) == {"cyan"} and "a cyan " in only[0]["caption"]


@pytest.mark.parametrize("colours", [["red", "orange"], [], "red"])
def test_bad_palettes_are_value_errors(colours):
    with pytest.raises(ValueError, match="colours"):
        SyntheticClips(8, colours=colours)


def test_unknown_synthetic_option_is_a_value_error():
    with pytest.raises(ValueError, match="does not take data.options"):
        build_datasets(DataConfig(options={"palette": ["red"]}), (1, 2, 2))
