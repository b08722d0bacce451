"""dit/config.py's newest rules at their boundaries and their documented defaults: the Wan2.2 fields
(model.boundary_ratio, flow.clean_first_frame) and the fault-tolerance ones (train.async_checkpoint,
parallel.timeout_s). Written from the survivors of ``tools/mutation.py dit/config.py``; in its
subset. Planted (each fails here): the open interval (0, 1) of the boundary closed at either end or
widened to 2, the share's upper bound made open or widened, defaults 1.0 / True / 200 s, a timeout
of 0 s accepted."""

from __future__ import annotations

import pytest

from dit.config import Config, load_config

CASES = [
    (["model.expert=high", "model.boundary_ratio=0.875"], None),
    (["model.expert=high", "model.boundary_ratio=0.999"], None),
    (["model.expert=low", "model.boundary_ratio=0.001"], None),
    (["model.expert=high", "model.boundary_ratio=1.0"], "model.boundary_ratio=1.0 must be in (0, 1)"),
    (["model.expert=high", "model.boundary_ratio=1.5"], "model.boundary_ratio=1.5 must be in (0, 1)"),
    (["model.expert=high", "model.boundary_ratio=0.0"], "model.boundary_ratio=0.0 must be in (0, 1)"),
    (["flow.clean_first_frame=1.0"], None),
    (["flow.clean_first_frame=0.0"], None),
    (["flow.clean_first_frame=1.5"], "flow.clean_first_frame=1.5 must be in [0, 1]"),
    (["flow.clean_first_frame=-0.1"], "flow.clean_first_frame=-0.1 must be in [0, 1]"),
    (["parallel.timeout_s=0.001"], None),
    (["parallel.timeout_s=0"], "parallel.timeout_s=0"),
    (["parallel.timeout_s=-1"], "parallel.timeout_s=-1"),
]


@pytest.mark.parametrize("items, error", CASES, ids=[" ".join(i) for i, _ in CASES])
def test_each_rule_at_its_boundary(items, error):
    if error is None:
        load_config(None, items)
    else:
        with pytest.raises(ValueError) as err:
            load_config(None, items)
        assert error in str(err.value)


def test_documented_defaults():
    """Text-to-video only, synchronous checkpoints, 100 s collectives (torchtitan's), no expert."""
    for cfg in (Config(), load_config(None, [])):
        assert cfg.flow.clean_first_frame == 0.0
        assert cfg.train.async_checkpoint is False
        assert cfg.parallel.timeout_s == 100.0
        assert cfg.model.expert is None and cfg.model.boundary_ratio is None


def test_a_yaml_error_names_the_parsers_problem(tmp_path):
    """The problem yaml reports, not its context line ('while parsing ...'); a file yaml cannot even
    read (a NUL byte: no problem, only a message) gives that message's first line. Planted: the
    context's first line instead of the problem, the message's second line -> fails."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  betas: [0.9, 0.99\n")
    with pytest.raises(ValueError) as err:
        load_config(bad, [])
    assert "is not valid YAML at line" in str(err.value) and "expected ',' or ']'" in str(err.value)
    bad.write_text("train: \x00\n")
    with pytest.raises(ValueError) as err:
        load_config(bad, [])
    assert "is not valid YAML" in str(err.value) and "unacceptable character" in str(err.value)
