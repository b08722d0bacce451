"""The package layout's rules, so that a new import cannot quietly break them.

- ``dynamic_cp/planning/`` is pure Python: no torch, nothing of the runtime, attention or training config.
- ``dynamic_cp/attention/`` knows nothing of plans: of planning it may use only the rank layout.
- ``dit/`` never touches ``torch.distributed`` or ``dynamic_cp``: parallelism stays out of the model.
- ``data/`` is the bottom layer: it imports neither ``dit`` nor ``dynamic_cp``.
- No import circle in ``data/`` or ``dynamic_cp/`` (imports inside functions count too).
- No product file (``dit/``, ``data/``, ``dynamic_cp/``, ``train.py``, ``sample.py``) over 450 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            # ``from pkg import mod`` imports the module pkg.mod when there is one
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _hits(imports: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imports if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("path", _files("dynamic_cp/planning"), ids=lambda p: p.name)
def test_planning_imports_no_torch_runtime_or_training_config(path):
    bad = _hits(_imports(path), ("torch", "dynamic_cp.runtime", "dynamic_cp.attention", "dit.config"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: planning must stay pure Python"


@pytest.mark.parametrize("path", _files("dynamic_cp/attention"), ids=lambda p: p.name)
def test_attention_knows_nothing_of_plans(path):
    imports = _hits(_imports(path), ("dynamic_cp.runtime", "dynamic_cp.planning"))
    bad = [m for m in imports if m not in ("dynamic_cp.planning", "dynamic_cp.planning.groups_layout")]
    bad = [m for m in bad if not m.startswith("dynamic_cp.planning.groups_layout.")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: attention may use only planning.groups_layout"


@pytest.mark.parametrize("path", _files("dit"), ids=lambda p: p.name)
def test_model_never_touches_distributed(path):
    bad = _hits(_imports(path), ("torch.distributed", "dynamic_cp"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: dit/ sees local tensors only"


@pytest.mark.parametrize("path", _files("data"), ids=lambda p: p.name)
def test_data_imports_nothing_above_it(path):
    bad = _hits(_imports(path), ("dit", "dynamic_cp"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: data/ is the bottom layer (CONTRIBUTING.md)"


def test_planning_loads_without_torch_in_a_fresh_interpreter():
    # The static check above misses what a dependency drags in; this one sees the real sys.modules.
    mods = [_module_name(p) for p in _files("dynamic_cp/planning")]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
        "'dynamic_cp.runtime', 'dynamic_cp.attention')) or m == 'dit.config')\n"
        "print(len(bad), sorted({m.split('.')[0] + '.' + m.split('.')[1] if '.' in m else m for m in bad}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0 []", (
        f"importing dynamic_cp.planning loaded (count, packages): {out.stdout.strip()}"
    )


def _cycle(package: str) -> list[str] | None:
    """One import circle among the modules of ``package``, or None."""
    files = {_module_name(p): p for p in _files(package)}
    graph = {m: sorted(i for i in _imports(p) if i in files and i != m) for m, p in files.items()}
    # A submodule import also runs its packages' __init__; they are docstrings here, so edges stay direct.
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("package", ["data", "dynamic_cp", "dit"])
def test_no_import_circle(package):
    found = _cycle(package)
    assert found is None, f"import circle in {package}/: {' -> '.join(found)}"


MAX_LINES = 450  # a file past this mixes jobs: split it where the jobs split (CONTRIBUTING.md)


def test_no_product_file_over_450_lines():
    product = [*_files("dit"), *_files("data"), *_files("dynamic_cp"), ROOT / "train.py", ROOT / "sample.py"]
    long = {
        str(p.relative_to(ROOT)): n for p in product if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these where their jobs split: {long}"
