"""``data.reader`` and its deprecated alias ``data.options.backend`` in the config itself (dit/config.py:
``DataConfig.__post_init__`` for a config built in Python, ``from_dict`` for files and overrides). In the
mutation bench's ``dit/config.py`` subset: no video is read (tests/test_data_reader_key.py follows each
name to the decoder). Planted, each caught here: the options dict not copied before the alias is popped
(in ``__post_init__`` and in ``from_dict``: the caller's dict loses it, so a second config built from it
reads 'auto'); ``reader == 'auto'`` flipped (the alias alone refused as disagreeing); the alias's reader
dropped (the config keeps 'auto'); a Python-built reader not validated; the ``from_dict`` resolution
skipped (an explicit ``data.reader=auto`` beside the alias accepted)."""

from __future__ import annotations

import warnings

import pytest

from dit.config import Config, DataConfig, from_dict, load_config


def _quiet(build):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the alias's deprecation: tested in data/
        return build()


def test_a_python_built_config_takes_the_alias_and_leaves_the_callers_options_alone():
    options = {"backend": "pyav", "min_frames": 3}
    first = _quiet(lambda: DataConfig(options=options))
    assert (first.reader, first.options) == ("pyav", {"min_frames": 3})
    assert options == {"backend": "pyav", "min_frames": 3}  # not popped from the caller's dict
    second = _quiet(lambda: DataConfig(options=options))
    assert second.reader == "pyav"
    same = _quiet(lambda: DataConfig(reader="pyav", options={"backend": "pyav"}))
    assert same.reader == "pyav" and same.options == {}


def test_a_python_built_config_refuses_a_bad_reader_and_a_disagreeing_alias():
    with pytest.raises(ValueError, match=r"^data.reader='ffmpeg' is not a video reader; choose one of "):
        DataConfig(reader="ffmpeg")
    with pytest.raises(ValueError, match=r"^data.reader='decord' and data.options.backend='pyav' disagree; "):
        _quiet(lambda: DataConfig(reader="decord", options={"backend": "pyav"}))
    assert DataConfig().reader == "auto" and DataConfig(reader="decord").reader == "decord"


def test_a_config_file_resolves_the_alias_where_an_explicit_auto_is_visible():
    cfg = _quiet(lambda: load_config("configs/tiny.yaml", ["data.options={backend: pyav}"]))
    assert cfg.data.reader == "pyav" and "backend" not in cfg.data.options
    # data.reader=auto written out next to the alias: two names for the reader that disagree
    with pytest.raises(ValueError, match=r"^data.reader='auto' and data.options.backend='pyav' disagree; "):
        _quiet(lambda: load_config("configs/tiny.yaml", ["data.reader=auto", "data.options={backend: pyav}"]))
    raw = {"data": {"options": {"backend": "pyav"}}}
    for _ in range(2):  # the caller's dict is read, not changed: the same config twice
        assert _quiet(lambda: from_dict(Config, raw)).data.reader == "pyav"
    assert raw == {"data": {"options": {"backend": "pyav"}}}
