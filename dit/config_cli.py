"""The config as the command line shows it: every key with its default and its comment, and the merged
config as YAML.

The comment written beside each field in ``dit/config.py`` (and ``dit/model_config.py``) is its documentation; ``field_docs`` reads
it from the source (comment on the field's lines, else the comment block right above it), so
``train.py --help`` never keeps a second copy that could drift.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from functools import cache

import yaml

from dit.config import Config, to_dict


@cache
def _comments_by_line(module) -> dict[int, str]:
    source = inspect.getsource(module)
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


@cache
def _source_lines(module) -> list[str]:
    return inspect.getsource(module).splitlines()


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its comment} for dataclass ``cls`` of dit/config.py (or dit/model_config.py)."""
    module = sys.modules[cls.__module__]
    comments, lines = _comments_by_line(module), _source_lines(module)
    tree = ast.parse("\n".join(lines))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        beside = [comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments]
        above = []
        i = stmt.lineno - 1
        while i >= 1 and lines[i - 1].strip().startswith("#"):  # a comment block right above the field
            above.insert(0, comments[i])
            i -= 1
        docs[stmt.target.id] = " ".join(above + beside)
    return docs


def config_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, object, str]]:
    """(dotted key, default, comment) of every leaf field, in declaration order."""
    out = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += config_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", getattr(defaults, f.name), docs.get(f.name, "")))
    return out


def help_epilog() -> str:
    """The config keys block of ``train.py --help``: ``key = default`` and the comment under it."""
    lines = ["config keys (set in the --config YAML or as key=value overrides; default shown):"]
    for key, default, doc in config_keys():
        lines.append(
            f"  {key} = {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}"
        )
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def dump_config(cfg: Config) -> str:
    """The merged config as YAML that ``--config`` reads back to the same Config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
