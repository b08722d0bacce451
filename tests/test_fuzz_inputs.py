"""Fuzzing (issue 14): random and malformed manifests, configs and override strings go through the
loaders and the config parser. Only the project's clear errors may come out (ValueError naming the
place, or TooManyFailures), never another exception, and nothing hangs (a deadline per example)."""

import json
import os
import string
import tempfile
from pathlib import Path

import pytest
import yaml
from _data_media import make_clips
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.build import build_dataset
from data.failures import TooManyFailures
from data.manifest import COLUMNS
from data.manifest_table import read_manifest
from dit.config import Config, load_config

CLEAR = (ValueError, TooManyFailures)
FUZZ = settings(max_examples=60, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
pytestmark = pytest.mark.timeout(120)

# Values a manifest cell or a config leaf might hold, hostile ones on purpose.
cells = st.one_of(
    st.text(max_size=12),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "nan", "inf", "-1", "0", "1e400", "12", "3.5", " ", "\x00", "clip.mp4"]),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> str:
    return make_clips(str(tmp_path_factory.mktemp("fuzz_media")), captions=False)[0]


def _through_loaders(path: str) -> None:
    try:
        read_manifest(path)
        build_dataset(path, progress=False, probe_workers=1, max_failure_share=1.0)
    except CLEAR:
        pass


@FUZZ
@given(
    header=st.just(list(COLUMNS)) | st.lists(st.sampled_from([*COLUMNS, "extra", ""]), max_size=7),
    rows=st.lists(st.lists(cells, min_size=6, max_size=7) | st.lists(cells, max_size=7), max_size=4),
    raw=st.binary(max_size=80),
)
def test_csv_manifests(video, header, rows, raw):
    """Rows point at a real clip, so trusted metadata reaches the clip policy too."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.csv")
        lines = [",".join(header)] + [",".join(video if c == "clip.mp4" else str(c) for c in r) for r in rows]
        Path(path).write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + raw)
        _through_loaders(path)


@FUZZ
@given(
    records=st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {"path": st.sampled_from(["clip.mp4", "", "missing.mp4"]) | cells},
                optional={k: cells | json_values for k in COLUMNS[1:]},
            ),
            st.fixed_dictionaries({"path": st.just("clip.mp4"), **{k: cells for k in COLUMNS[1:]}}),
            json_values,
        ),
        max_size=4,
    ),
    raw=st.binary(max_size=40),
)
def test_jsonl_manifests(video, records, raw):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.jsonl")
        fixed = [
            {**r, "path": video} if isinstance(r, dict) and r.get("path") == "clip.mp4" else r
            for r in records
        ]
        text = "".join(json.dumps(r) + "\n" for r in fixed)
        Path(path).write_bytes(text.encode() + raw)
        _through_loaders(path)


# Config keys as a user would mistype them: real sections and fields, plus junk.
SECTIONS = {f: list(Config.__dataclass_fields__[f].default_factory().__dataclass_fields__)
            for f in ("model", "data", "flow", "train", "parallel")}  # fmt: skip
keys = st.one_of(
    st.sampled_from([f"{s}.{k}" for s, ks in SECTIONS.items() for k in ks] + ["output_dir"]),
    st.text(alphabet=string.ascii_letters + "._=- ", max_size=12),
)


@FUZZ
@given(
    overrides=st.lists(
        st.one_of(
            st.builds(lambda k, v: f"{k}={v}", keys, st.text(max_size=12) | cells.map(str)),
            st.builds(lambda k, v: f"{k}={json.dumps(v)}", keys, json_values),
            st.text(max_size=20),
        ),
        max_size=4,
    )
)
def test_override_strings(overrides):
    try:
        load_config(None, overrides)
    except ValueError:
        pass


@FUZZ
@given(
    doc=st.one_of(
        st.text(max_size=60),
        st.dictionaries(
            st.sampled_from([*SECTIONS, "output_dir", "junk"]),
            st.dictionaries(
                st.sampled_from([k for ks in SECTIONS.values() for k in ks] + ["junk"]),
                json_values,
                max_size=4,
            )
            | json_values,
            max_size=4,
        ).map(lambda d: yaml.safe_dump(d)),
    )
)
def test_config_files(tmp_path, doc):
    path = tmp_path / "c.yaml"
    path.write_text(doc, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(path)
    except ValueError:
        pass
