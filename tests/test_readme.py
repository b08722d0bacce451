"""The README is the contract: its commands are CI's, its flags exist, and its links resolve.

A newcomer copies the README's commands as written. The set-up and test commands must be the ones
`.ci/run` runs (so CI proves them on a fresh clone), the quick start must load its config, and
every other command must name a script that exists with flags that script defines. Every link of
the README, CONTRIBUTING.md and the docs/ pages leads to a file and, with an anchor, a heading.
Running the quick start itself (14 minutes of training) is `.ci/run`'s cost to avoid; its pieces
are covered by tests/test_train.py and tests/test_sample*.py.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(text: str) -> list[list[str]]:
    """Every command of the README's bash blocks and backticked table cells, as argv lists."""
    lines = [ln for block in _bash_blocks(text) for ln in block.splitlines()]
    lines += re.findall(r"\| `([^`|]*(?:python|pip)[^`|]*)` \|", text)
    commands = []
    for line in lines:
        line = line.split("  #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in line.split("&&"):
            argv = shlex.split(part)
            while argv and re.match(r"^[A-Z_]+=", argv[0]):  # leading VAR=value assignments
                argv = argv[1:]
            commands.append(argv)
    return commands


def _defined_flags(path: Path) -> set[str]:
    """The --flags a script's argparse defines, read from its source (nothing is imported)."""
    flags = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("-"):
                    flags.add(arg.value)
    return flags


def _script_of(argv: list[str]) -> Path | None:
    if argv[:2] == ["python", "-m"]:
        module = argv[2]
        if module == "pytest":
            return None
        path = ROOT / (module.replace(".", "/") + ".py")
        return path if path.exists() else ROOT / module.replace(".", "/") / "__main__.py"
    if argv[0] == "python" and argv[1].endswith(".py"):
        return ROOT / argv[1]
    return None


def test_readme_is_short():
    assert len(README.read_text().splitlines()) < 250


def test_setup_and_test_commands_are_what_ci_runs():
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [" ".join(argv) for argv in _commands(README.read_text())]
    setup = "pip install -c constraints.txt -e .[dev]"
    assert setup in commands
    assert 'pip install -c constraints.txt -e ".[dev]"' in ci
    assert "python -m pytest -q" in commands
    assert "python -m pytest -q" in ci


def test_quick_start_trains_the_tiny_config_then_samples_from_it():
    from dit.config import load_config

    blocks = _bash_blocks(README.read_text())
    quick = next(b for b in blocks if "train.py" in b and "sample.py" in b)
    train, sample = [shlex.split(p) for p in quick.strip().split("&&")]
    assert train[:2] == ["python", "train.py"] and sample[:2] == ["python", "sample.py"]
    config = train[train.index("--config") + 1]
    cfg = load_config(str(ROOT / config), [a for a in train[2:] if "=" in a])
    # sample.py reads the run train.py wrote
    assert sample[sample.index("--checkpoint") + 1] == cfg.output_dir


@pytest.mark.parametrize("argv", _commands(README.read_text()), ids=lambda a: " ".join(a)[:60])
def test_every_command_names_a_script_and_flags_that_exist(argv):
    script = _script_of(argv)
    if script is None:
        return  # pip and pytest: checked against .ci/run above
    assert script.exists(), f"{' '.join(argv)}: {script.relative_to(ROOT)} does not exist"
    flags = {a.split("=")[0] for a in argv if a.startswith("--")}
    missing = flags - _defined_flags(script)
    assert not missing, f"{script.relative_to(ROOT)} defines no {sorted(missing)}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves_to_a_file_and_heading(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file) if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert not broken, f"{page.name}: links that lead nowhere: {broken}"
