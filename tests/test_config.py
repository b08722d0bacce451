from pathlib import Path

import pytest

from dit.config import load_config

CONFIGS = sorted(Path(__file__).resolve().parent.parent.joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_file_loads(path):
    cfg = load_config(path)
    assert cfg.train.max_steps > 0


def test_configs_exist():
    assert any(p.name == "tiny.yaml" for p in CONFIGS)


def test_overrides_apply_with_yaml_types():
    cfg = load_config(
        CONFIGS[0], ["train.max_steps=7", "flow.shift=3", "parallel.cp_sizes=[1, 2]", "output_dir=x"]
    )
    assert cfg.train.max_steps == 7
    assert cfg.flow.shift == 3.0 and isinstance(cfg.flow.shift, float)
    assert cfg.parallel.cp_sizes == [1, 2]
    assert cfg.output_dir == "x"


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.max_step=5", "unknown config key train.max_step; valid keys here are"),
        ("trian.max_steps=5", "unknown config key trian"),
        ("train.max_steps=abc", "train.max_steps='abc' must be of type int"),
        ("train.lr=0", "train.lr=0.0 must be positive"),
        ("train.mixed_precision=fp8", "train.mixed_precision='fp8'; use 'auto', 'bf16' or 'no'"),
        ("model.size=giant", "model.size='giant' is unknown; choose one of"),
        ("parallel.mode=sometimes", "parallel.mode='sometimes'"),
        ("data.caption_dropout=1.5", "data.caption_dropout=1.5 must be in"),
        ("train.max_steps", "must look like section.key=value"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(CONFIGS[0], [override])


def test_missing_config_file():
    with pytest.raises(ValueError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_float_in_exponent_notation_without_dot():
    assert load_config(CONFIGS[0], ["train.lr=1e-5"]).train.lr == 1e-5
