"""The mutation tool's operators produce the bugs they are named after (tools/mutation.py)."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "mutation_bench", Path(__file__).parents[1] / "tools" / "mutation.py"
)
mutation = importlib.util.module_from_spec(_spec)
sys.modules["mutation_bench"] = mutation  # dataclasses look their module up there
_spec.loader.exec_module(mutation)


def _variants(source: str, kind: str) -> dict[str, str]:
    """description -> the mutated source, for the mutants whose description starts with ``kind``."""
    out = {}
    for m in mutation.mutants(source):
        if m.what.startswith(kind):
            tree = ast.parse(source)
            mutation._Mutator(mutation._skipped_nodes(tree), target=m.index).visit(tree)
            out[f"{m.line}:{m.what}"] = ast.unparse(tree)
    return out


def _run(source: str, fn: str, *args):
    namespace: dict = {}
    exec(compile(source, "<snippet>", "exec"), namespace)
    return namespace[fn](*args)


REDUCE = """
import statistics
import numpy as np

def speed(xs):
    return float(np.median(np.asarray(xs)))

def total(xs):
    return sum(xs)

def worst(xs):
    return max(xs)

def avg(xs):
    return np.asarray(xs).mean()
"""


def test_reducing_calls_are_swapped_for_the_reductions_a_slip_would_write():
    variants = _variants(REDUCE, "call ")
    assert sorted(variants) == [
        "12:call max -> min",
        "15:call mean -> median",
        "6:call median -> max",
        "6:call median -> mean",
        "9:call sum -> max",
    ]
    xs = [1.0, 1.0, 1.0, 10.0]  # one straggler: the median ignores it, the mean and max do not
    assert _run(REDUCE, "speed", xs) == 1.0
    assert _run(variants["6:call median -> mean"], "speed", xs) == 3.25
    assert _run(variants["6:call median -> max"], "speed", xs) == 10.0
    assert "np.mean(np.asarray(xs))" in variants["6:call median -> mean"]
    assert _run(variants["9:call sum -> max"], "total", [1, 2, 3]) == 3
    assert _run(variants["12:call max -> min"], "worst", [1, 2, 3]) == 1
    assert (
        "np.asarray(xs).median()" in variants["15:call mean -> median"]
    )  # an attribute call keeps its object


def test_a_bare_name_is_only_swapped_for_a_builtin():
    # median imported as a bare name: 'mean' may not be in scope (a NameError is no planted bug), 'max' is
    variants = _variants("from statistics import median\n\ndef f(xs):\n    return median(xs)\n", "call ")
    assert list(variants) == ["4:call median -> max"]


FLAGS = """
def shift(sigmas, s):
    return [s * x / (1 + (s - 1) * x) for x in sigmas]

def schedule(n, shift_by=1.0):
    return [i / n for i in range(n, 0, -1)] if shift_by == 1.0 else shift([i / n for i in range(n, 0, -1)], shift_by)

def sample(n, s):
    sigmas = schedule(n, shift_by=s)
    return sigmas

def apply(sigmas, s):
    sigmas = shift(sigmas, s)
    return len(sigmas)
"""


def test_a_dropped_keyword_is_a_flag_read_and_ignored():
    variants = _variants(FLAGS, "drop keyword")
    assert list(variants) == ["9:drop keyword shift_by="]
    mutant = variants["9:drop keyword shift_by="]
    assert "schedule(n)" in mutant
    assert _run(FLAGS, "sample", 2, 3.0) == [1.0, 0.75]
    assert _run(mutant, "sample", 2, 3.0) == [1.0, 0.5]  # --shift 3 silently does nothing


def test_a_used_call_is_replaced_by_its_first_argument():
    variants = _variants(FLAGS, "drop call")
    # 'schedule(n, ...)' -> 'n' (line 9) and 'shift(sigmas, s)' -> 'sigmas' (line 13); the return of a
    # conditional (line 6) and 'len(...)' (a type change, not a forgotten step) are not call sites
    assert sorted(variants) == [
        "13:drop call, keep its first argument",
        "9:drop call, keep its first argument",
    ]
    mutant = variants["13:drop call, keep its first argument"]
    assert "sigmas = sigmas" in mutant
    namespace: dict = {}
    exec(compile(mutant, "<snippet>", "exec"), namespace)
    applied = []
    namespace["shift"] = lambda xs, s: applied.append(s) or xs
    assert namespace["apply"]([0.5], 3.0) == 1 and applied == []  # the shift is never applied


def test_docstrings_and_error_messages_are_not_mutated():
    source = 'def f(x):\n    """max(x) here."""\n    if x < 0:\n        raise ValueError(str(max(x, 0)))\n    return x\n'
    assert sorted(m.what for m in mutation.mutants(source)) == [
        "cmp#0 < -> <=",
        "const 0 -> 1",
        "return None",
    ]


@pytest.mark.parametrize("path", sorted(mutation.TARGETS))
def test_every_target_and_its_tests_exist(path):
    root = Path(__file__).parents[1]
    assert (root / path).is_file()
    tests = mutation.TARGETS[path]
    for i, t in enumerate(tests):
        if not t.startswith("-") and (i == 0 or tests[i - 1] != "-k"):  # options and -k expressions aside
            if "::" in t:  # a node id: the test must exist (a renamed test would silently drop out)
                name = t.split("::")[1].split("[")[0]  # a parametrized case: its function
                assert f"def {name}(" in (root / t.split("::")[0]).read_text(), t
            assert (root / t.split("::")[0]).is_file(), t


def test_a_scope_keeps_the_mutants_of_the_functions_it_names_with_their_indices():
    """``SCOPES`` (sample.py's argument handling): only the mutants inside the named module-level
    functions run and count, numbered as in the whole module so ``--only`` means the same mutant with
    and without ``--whole``; a name that is not a function stops the bench. Planted: the span's end
    line left out (``<=`` -> ``<``), the indices renumbered -> this test fails."""
    source = "def parse(x):\n    return x + 1\n\n\ndef slow(x):\n    return x * 2\n\n\ndef check(x):\n    return x > 0\n"
    whole = mutation.in_scope(source, None)
    assert [m.line for m in whole] == [2, 2, 2, 6, 6, 6, 10, 10, 10]
    scoped = mutation.in_scope(source, ("parse", "check"))
    assert [m.index for m in scoped] == [0, 1, 2, 6, 7, 8]
    assert scoped == [whole[i] for i in (0, 1, 2, 6, 7, 8)]
    with pytest.raises(SystemExit, match=r"\['pars'\]: no such module-level function"):
        mutation.in_scope(source, ("pars",))
    for path, functions in mutation.SCOPES.items():  # every scope names functions of its module
        assert path in mutation.TARGETS and mutation.in_scope(
            (Path(__file__).parents[1] / path).read_text(), functions
        )
