"""Mutation score of the core pure modules: does a small planted bug fail their tests?

    PYTHONPATH=$PWD nice -n 19 python tools/mutation.py                  # every module below
    PYTHONPATH=$PWD python tools/mutation.py dit/flow.py                  # one module
    PYTHONPATH=$PWD python tools/mutation.py dit/flow.py --only 12 31     # re-run mutants 12 and 31
    PYTHONPATH=$PWD python tools/mutation.py --list dit/flow.py           # print the mutants, run nothing
    PYTHONPATH=$PWD python tools/mutation.py dit/ema.py --tests tests/test_trainer_guards.py  # other tests
    PYTHONPATH=$PWD python tools/mutation.py --sample 60 dynamic_cp/planning/planner.py  # an estimate
    PYTHONPATH=$PWD python tools/mutation.py sample.py --whole    # beyond its scope (SCOPES below)

Each mutant is one small change of the module's syntax tree:
- a comparison flipped at its boundary (``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``,
  ``in`` <-> ``not in``, ``is`` <-> ``is not``);
- an arithmetic operator swapped (``+`` <-> ``-``, ``*`` <-> ``/``, ``//`` -> ``/``, ``%`` -> ``//``,
  ``**`` -> ``*``);
- an integer constant off by one (n -> n + 1), a float scaled (x -> 2x; 0.0 -> 1.0), a bool negated;
- ``and`` <-> ``or``; ``not x`` -> ``x``;
- a ``return value`` that returns ``None`` instead;
- a reducing call replaced by another (``median`` -> ``mean`` / ``max``, ``mean`` -> ``median``,
  ``max`` <-> ``min``, ``sum`` -> ``max``; ``np.median(x)``, ``x.mean()`` and the builtins alike);
- a keyword argument dropped from a call (``f(x, shift=s)`` -> ``f(x)``: a flag read and ignored),
  and a call whose result is used replaced by its first argument (``x = shift(x, s)`` -> ``x = x``:
  a transform that is read but never applied).
Docstrings, annotations, f-strings and the arguments of ``raise`` (error messages) are not mutated.

How a mutant runs: this process imports the third-party libraries once (torch, hypothesis, ...) by
collecting the tests, then forks one child per mutant. The child forgets every module of this
repository, serves the mutated module's code from an import hook (so every importer, including other
project modules, sees the mutant), and runs the module's fast test subset with ``pytest -x``. A
failing run kills the mutant; a run over the time limit counts as killed too (an infinite loop is a
caught bug), and is reported separately. The source file on disk is never touched.

Score = killed / (mutants - equivalent). Equivalent mutants (no observable change) are listed with
their reasons in ``tools/mutation_equivalent.txt`` as ``path:line:col description  # reason``; see
docs/testing.md. This is a tool (minutes of CPU), not part of ``python -m pytest``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.util
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT_FILE = ROOT / "tools" / "mutation_equivalent.txt"

# module -> the fast test subset that guards it (seconds per mutant once imports are warm). Entries
# are pytest arguments: files, node ids (test_fsdp.py's process-spawning tests stay out of the
# subset), or options; an option such as ``-k`` applies to every file of the list.
_FSDP_PURE = [
    f"tests/test_fsdp.py::{name}"
    for name in (
        "test_fsdp_config_errors_name_the_field",
        "test_explicit_modes_resolve_to_themselves",
        "test_auto_picks_the_fastest_mode_that_fits",
        "test_auto_without_a_fitting_mode_names_the_knobs",
        "test_auto_keeps_a_lora_run_replicated_and_refuses_lora_under_fsdp",
        "test_memory_gb_must_be_positive",
    )
]
TARGETS: dict[str, list[str]] = {
    "dynamic_cp/planning/planner.py": ["tests/test_planner.py", "tests/test_planner_bruteforce.py"],
    "dynamic_cp/planning/simulator.py": ["tests/test_simulate.py"],
    "dynamic_cp/planning/cost_model.py": ["tests/test_cost_model.py"],
    "dynamic_cp/attention/sharding.py": ["tests/test_sharding.py"],
    "dit/packing.py": ["tests/test_packing.py"],
    "dit/flow.py": ["tests/test_flow.py"],
    "dit/families/hunyuan_video15/model.py": [
        "tests/test_hunyuan_video15_parity.py",
        "tests/test_hunyuan_video15_model.py",
    ],
    "dit/families/hunyuan_video15/layers.py": [
        "tests/test_hunyuan_video15_parity.py",
        "tests/test_hunyuan_video15_model.py",
    ],
    "dit/families/registry.py": ["tests/test_families.py"],
    "dit/checkpoint.py": ["tests/test_checkpoint.py"],
    "dynamic_cp/planning/rounds.py": ["tests/test_rounds.py", "tests/test_fsdp_planning.py"],
    "dynamic_cp/planning/rounds_planner.py": [
        "tests/test_rounds_planner_steps.py",
        "tests/test_fsdp_planning.py",
        "tests/test_rounds.py",
    ],
    "dynamic_cp/planning/memory.py": ["tests/test_memory_by_hand.py", "tests/test_memory.py"],
    "dynamic_cp/planning/cost_fit.py": ["tests/test_cost_fit_by_hand.py", "tests/test_cost_fit.py"],
    "dynamic_cp/runtime/cost_learning.py": [
        "tests/test_cost_learning_files.py",
        "tests/test_cost_learning.py",
        "-k",
        "not four_ranks",
    ],
    "dynamic_cp/runtime/fsdp.py": ["tests/test_fsdp_one_rank.py", *_FSDP_PURE],
    "dynamic_cp/runtime/fsdp_checkpoint.py": ["tests/test_fsdp_checkpoint_one_rank.py"],
    "dit/lora.py": [
        "tests/test_lora_files.py",
        "tests/test_lora_scale.py",
        "tests/test_lora_edges.py",
        "tests/test_wan_i2v.py::test_lora_loads_into_diffusers_i2v_without_missing_keys",
        "tests/test_pipeline_lora.py::test_stage_lora_merge_and_export_without_processes",
    ],
    "dit/ema.py": ["tests/test_ema.py", "tests/test_trainer_guards.py"],
    "dit/optim.py": ["tests/test_optim.py"],
    "dit/fp8_base.py": ["tests/test_fp8_base.py"],
    "dit/block_offload.py": ["tests/test_block_offload.py"],
    "dit/fp8_train.py": ["tests/test_fp8_train.py"],
    "dit/expert_offload.py": [
        "tests/test_expert_offload.py",
        "tests/test_expert_offload_ranks.py",
        "tests/test_sample_lowmem.py",
    ],
    "dit/sampling.py": [
        "tests/test_sampling_steps.py",
        "tests/test_sampling_guidance.py",
        "tests/test_sampling_wan22_steps.py",
    ],
    "dit/sample_conditioning.py": [
        "tests/test_sampling_steps.py",
        "tests/test_sampling_guidance.py",
        "tests/test_sampling_wan22_steps.py",
    ],
    "dit/sample_output.py": [
        "tests/test_sampling_steps.py",
        "tests/test_sampling_guidance.py",
        "tests/test_sampling_wan22_steps.py",
    ],
    "dynamic_cp/planning/sampling_planner.py": ["tests/test_sampling_planner.py"],
    "dynamic_cp/planning/pipeline_stages.py": ["tests/test_pipeline_stages.py"],
    "dynamic_cp/planning/pipeline_schedule.py": ["tests/test_pipeline_schedule.py"],
    # spawned gloo ranks (~10 s a world size): the W=3 and W=4 parity cases and the stage checkpoint
    # the strategies' own test first (cheap), then one spawned parity case per strategy and path
    "dynamic_cp/runtime/step_strategies.py": [
        "tests/test_step_strategies.py",
        "tests/test_per_layer_plan.py",
        "tests/test_default_path_worlds.py::test_defaults_train_and_equal_one_process[3]",
        "tests/test_pipeline.py::test_pipeline_equals_one_process[4]",
        "tests/test_wan22_both.py::test_both_experts_on_gloo_ranks_equal_one_process",
        "tests/test_runtime.py::test_uneven_batch_leaves_a_rank_without_data",
    ],
    "dynamic_cp/runtime/pipeline.py": [
        "tests/test_step_strategies.py::test_the_pipeline_timeline_sums_each_micro_batch_over_the_stages",
        "tests/test_pipeline.py",
        "-k",
        "timeline or 3 or 4",
    ],
    "dynamic_cp/runtime/pipeline_checkpoint.py": [
        "tests/test_pipeline.py",
        "tests/test_pipeline_lora.py",
        "-k",
        "checkpoint",
    ],
    "dit/stages.py": ["tests/test_pipeline.py", "-k", "3 or 4 or carried"],
    "dynamic_cp/planning/pipeline_sim.py": ["tests/test_pipeline_sim.py"],
    "dynamic_cp/planning/pipeline_order.py": ["tests/test_pipeline_order.py"],
    "dynamic_cp/planning/compare_pipeline.py": ["tests/test_pipeline_order.py"],
    "dynamic_cp/planning/pipeline_memory.py": ["tests/test_pipeline_order.py", "tests/test_pipeline_sim.py"],
    "data/native_stderr.py": ["tests/test_data_robustness.py", "-k", "native"],
    "dit/config.py": [
        "tests/test_config_validation.py",
        "tests/test_config.py",
        "tests/test_config_cli.py",
        "tests/test_config_wan22_faults.py",
        "tests/test_config_reader.py",
    ],
    # argument handling only (SCOPES); the rest of sample.py is test_sample_cli.py's (--whole --tests ...)
    "sample.py": [
        "tests/test_sample_args.py",
        "tests/test_sample_cli.py::test_help_names_every_flag_and_keeps_the_usage_example",
        "tests/test_sample_cli.py::test_help_of_the_remaining_flags",
    ],
}
# Modules measured in some of their functions only (the others need slow tests of their own): the
# mutants outside them are not run, not counted and not listed; --whole measures the whole module.
SCOPES: dict[str, tuple[str, ...]] = {"sample.py": ("main", "request_defaults")}  # its argument handling

COMPARE_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
BINOP_SWAP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
}
BOOL_SWAP = {ast.And: ast.Or, ast.Or: ast.And}
# a reducing call -> the reductions a slip could put in its place (``np.median`` -> ``np.mean``, ...)
REDUCE_SWAP = {
    "median": ("mean", "max"),
    "nanmedian": ("nanmean",),
    "mean": ("median",),
    "nanmean": ("nanmedian",),
    "max": ("min",),
    "min": ("max",),
    "amax": ("amin",),
    "amin": ("amax",),
    "sum": ("max",),
}
BUILTIN_REDUCE = {"max", "min", "sum"}  # bare names: only swap between builtins (no NameError mutants)
# calls whose result is not "the first argument transformed": dropping them is a type change, not a
# forgotten step, so the call-dropping operator leaves them alone
NOT_TRANSFORMS = {
    "len",
    "int",
    "float",
    "str",
    "bool",
    "range",
    "isinstance",
    "issubclass",
    "list",
    "tuple",
    "dict",
    "set",
    "frozenset",
    "sorted",
    "reversed",
    "enumerate",
    "zip",
    "print",
    "getattr",
    "hasattr",
    "setattr",
    "type",
    "super",
    "repr",
    "iter",
    "next",
    "id",
    "hash",
    "callable",
    "vars",
    "open",
    "Path",
    "object",
    "max",
    "min",
    "sum",
    "any",
    "all",
    "map",
    "filter",
    "divmod",
    "format",
    "ord",
    "chr",
}
SYMBOL = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
    ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-",
    ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.And: "and",
    ast.Or: "or",
}  # fmt: skip


@dataclass
class Mutant:
    index: int
    line: int
    col: int
    what: str

    def key(self, path: str) -> str:
        return f"{path}:{self.line}:{self.col} {self.what}"


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, annotations, f-strings, raise arguments."""
    skip: set[int] = set()

    def drop(node):
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                drop(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(node.returns)
            for a in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
                drop(a.annotation)
            for a in (node.args.vararg, node.args.kwarg):
                if a is not None:
                    drop(a.annotation)
        elif isinstance(node, ast.AnnAssign):
            drop(node.annotation)
        elif isinstance(node, (ast.JoinedStr, ast.Raise)):
            drop(node)
    return skip


class _Mutator(ast.NodeTransformer):
    """Visits mutation sites in a fixed order; applies the one numbered ``target`` (or none: -1)."""

    def __init__(self, skip: set[int], target: int = -1):
        self.skip, self.target, self.sites = skip, target, []

    def _site(self, node, what: str) -> bool:
        self.sites.append(Mutant(len(self.sites), node.lineno, node.col_offset, what))
        return len(self.sites) - 1 == self.target

    def visit_Compare(self, node):
        self.generic_visit(node)
        if id(node) in self.skip:
            return node
        for i, op in enumerate(node.ops):
            new = COMPARE_SWAP.get(type(op))
            if new and self._site(node, f"cmp#{i} {SYMBOL[type(op)]} -> {SYMBOL[new]}"):
                node.ops[i] = new()
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        new = BINOP_SWAP.get(type(node.op))
        if id(node) not in self.skip and new:
            if self._site(node, f"binop {SYMBOL[type(node.op)]} -> {SYMBOL[new]}"):
                node.op = new()
        return node

    def visit_AugAssign(self, node):
        self.generic_visit(node)
        new = BINOP_SWAP.get(type(node.op))
        if id(node) not in self.skip and new:
            if self._site(node, f"augassign {SYMBOL[type(node.op)]}= -> {SYMBOL[new]}="):
                node.op = new()
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        if id(node) not in self.skip:
            new = BOOL_SWAP[type(node.op)]
            if self._site(node, f"boolop {SYMBOL[type(node.op)]} -> {SYMBOL[new]}"):
                node.op = new()
        return node

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if id(node) not in self.skip and isinstance(node.op, ast.Not):
            if self._site(node, "drop not"):
                return node.operand
        return node

    def visit_Constant(self, node):
        if id(node) in self.skip:
            return node
        v = node.value
        if isinstance(v, bool):
            if self._site(node, f"const {v} -> {not v}"):
                return ast.copy_location(ast.Constant(not v), node)
        elif isinstance(v, int):
            if self._site(node, f"const {v} -> {v + 1}"):
                return ast.copy_location(ast.Constant(v + 1), node)
        elif isinstance(v, float):
            new = 1.0 if v == 0.0 else 2 * v
            if self._site(node, f"const {v} -> {new}"):
                return ast.copy_location(ast.Constant(new), node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if id(node) in self.skip:
            return node
        func = node.func
        name = (
            func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        )
        for new in REDUCE_SWAP.get(name, ()):
            if isinstance(func, ast.Name) and new not in BUILTIN_REDUCE:
                continue
            if self._site(node, f"call {name} -> {new}"):
                if isinstance(func, ast.Name):
                    node.func = ast.copy_location(ast.Name(new, ast.Load()), func)
                else:
                    node.func = ast.copy_location(ast.Attribute(func.value, new, ast.Load()), func)
        for i, kw in enumerate(node.keywords):
            if kw.arg is not None and self._site(node, f"drop keyword {kw.arg}="):
                node.keywords = node.keywords[:i] + node.keywords[i + 1 :]
                break
        return node

    def _drop_call(self, call):
        """A used call ``f(a, ...)`` -> ``a``: the transform is written but never applied."""
        if not isinstance(call, ast.Call) or id(call) in self.skip or not call.args:
            return call
        if (
            isinstance(call.args[0], ast.Starred)
            or isinstance(call.func, ast.Name)
            and call.func.id in NOT_TRANSFORMS
        ):
            return call
        if self._site(call, "drop call, keep its first argument"):
            return call.args[0]
        return call

    def visit_Assign(self, node):
        self.generic_visit(node)
        node.value = self._drop_call(node.value)
        return node

    def visit_Return(self, node):
        self.generic_visit(node)
        if id(node) in self.skip or node.value is None:
            return node
        if isinstance(node.value, ast.Constant) and node.value.value is None:
            return node
        if self._site(node, "return None"):
            node.value = ast.copy_location(ast.Constant(None), node.value)
            return node
        node.value = self._drop_call(node.value)
        return node


def mutants(source: str) -> list[Mutant]:
    tree = ast.parse(source)
    m = _Mutator(_skipped_nodes(tree))
    m.visit(tree)
    return m.sites


def in_scope(source: str, functions: tuple[str, ...] | None) -> list[Mutant]:
    """The mutants inside the module-level functions named ``functions`` (all of them for None), with
    their indices in the whole module, so ``--only`` and ``--list`` agree with and without a scope."""
    sites = mutants(source)
    if functions is None:
        return sites
    defs = [n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    missing = set(functions) - {n.name for n in defs}
    if missing:
        raise SystemExit(f"scope {sorted(missing)}: no such module-level function; fix SCOPES")
    spans = [(n.lineno, n.end_lineno) for n in defs if n.name in functions]
    return [m for m in sites if any(a <= m.line <= b for a, b in spans)]


def mutated_code(source: str, path: str, index: int):
    tree = ast.parse(source)
    m = _Mutator(_skipped_nodes(tree), target=index)
    tree = ast.fix_missing_locations(m.visit(tree))
    return compile(tree, path, "exec")


class _ServeMutant(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, name: str, path: str, code):
        self.name, self.path, self.code = name, path, code

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self.path)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = self.path
        exec(self.code, module.__dict__)


def _forget_project_modules() -> None:
    root = str(ROOT)
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None) or ""
        if f.startswith(root) or name in ("conftest",) or name.startswith("tests."):
            del sys.modules[name]


def _pytest_args(tests: list[str]) -> list[str]:
    return [
        *tests,
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "--hypothesis-seed=0",
        "--rootdir",
        str(ROOT),
    ]


def _run_child(module: str | None, code, tests: list[str], timeout_s: float) -> tuple[str, float]:
    """Fork; in the child run the tests (against the mutant when given). -> (outcome, seconds)."""
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            sys.dont_write_bytecode = True
            _forget_project_modules()
            if module is not None:
                sys.meta_path.insert(0, _ServeMutant(module, str(ROOT / _path_of(module)), code))
            import pytest

            try:  # a failing example is enough: shrinking it to the simplest one only costs time here
                from hypothesis import Phase, settings

                settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])
                settings.load_profile("mutation")
            except ImportError:
                pass
            rc = pytest.main(_pytest_args(tests))
            os._exit(int(rc))
        except BaseException:
            os._exit(99)
    deadline = t0 + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            return ("survived" if rc == 0 else "killed"), time.perf_counter() - t0
        if time.perf_counter() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.perf_counter() - t0
        time.sleep(0.05)


def _module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".")


def _path_of(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _load_equivalent() -> dict[str, str]:
    out = {}
    if EQUIVALENT_FILE.exists():
        for line in EQUIVALENT_FILE.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, reason = line.partition("  # ")
                out[key.strip()] = reason.strip()
    return out


def _warm_imports(tests: list[str]) -> None:
    """Import the test files' third-party libraries here once, so each fork starts warm."""
    import pytest

    fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        pytest.main([*tests, "--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
    finally:
        os.dup2(fd, 1)
    _forget_project_modules()


def run_module(
    path: str,
    only: list[int] | None,
    timeout_factor: float,
    equivalent: dict,
    tests: list[str] | None = None,
    functions: tuple[str, ...] | None = None,
) -> dict:
    tests = tests or TARGETS[path]
    source = (ROOT / path).read_text()
    sites = in_scope(source, functions)
    _warm_imports(tests)
    base, base_s = _run_child(None, None, tests, timeout_s=600)
    if base != "survived":
        raise SystemExit(f"{path}: its tests {tests} fail without any mutation; fix them first")
    timeout_s = max(10.0, timeout_factor * base_s)
    counts = {"killed": 0, "timeout": 0, "survived": 0, "equivalent": 0}
    survivors = []
    t0 = time.perf_counter()
    for m in sites:
        if only is not None and m.index not in only:
            continue
        code = mutated_code(source, str(ROOT / path), m.index)
        outcome, _ = _run_child(_module_name(path), code, tests, timeout_s)
        if outcome == "survived" and m.key(path) in equivalent:
            outcome = "equivalent"
        counts[outcome] += 1
        if outcome == "survived":
            survivors.append(m)
        print(f"  #{m.index:<4} {outcome:<10} {m.key(path)}", flush=True)
    total = sum(counts.values())
    scored = total - counts["equivalent"]
    score = (counts["killed"] + counts["timeout"]) / scored if scored else 1.0
    print(
        f"{path}: {total} mutants, killed {counts['killed']}, timeout {counts['timeout']}, "
        f"equivalent {counts['equivalent']}, survived {counts['survived']} -> score {score:.1%} "
        f"(baseline tests {base_s:.1f} s, mutants {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return {"path": path, "score": score, "survivors": survivors, **counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", default=list(TARGETS), help=f"any of {list(TARGETS)}")
    ap.add_argument("--only", type=int, nargs="+", help="mutant indices to run (see --list)")
    ap.add_argument("--list", action="store_true", help="print the mutants and run nothing")
    ap.add_argument(
        "--sample", type=int, help="run a seeded random sample of this many mutants per module (an estimate)"
    )
    ap.add_argument(
        "--tests",
        help="pytest arguments, one string, run instead of the module's subset (the old tests, for a "
        "'before' score): --tests \"tests/test_x.py -k 'not slow'\"",
    )
    ap.add_argument("--timeout-factor", type=float, default=5.0, help="per-mutant limit x baseline time")
    ap.add_argument(
        "--whole", action="store_true", help=f"every function of a module, not only its scope {SCOPES}"
    )
    args = ap.parse_args()
    for path in args.modules:
        if path not in TARGETS:
            raise SystemExit(f"unknown module {path!r}; choose from {list(TARGETS)}")
    scope = {path: None if args.whole else SCOPES.get(path) for path in args.modules}
    if args.list:
        for path in args.modules:
            for m in in_scope((ROOT / path).read_text(), scope[path]):
                print(f"#{m.index:<4} {m.key(path)}")
        return
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    try:
        import torch

        torch.set_num_threads(1)  # forked children must not inherit a busy thread pool
    except ImportError:
        pass
    equivalent = _load_equivalent()
    results = []
    for path in args.modules:
        only = args.only
        if args.sample is not None and only is None:
            import random

            indices = [m.index for m in in_scope((ROOT / path).read_text(), scope[path])]
            only = sorted(random.Random(0).sample(indices, min(args.sample, len(indices))))
        tests = shlex.split(args.tests) if args.tests else None
        results.append(run_module(path, only, args.timeout_factor, equivalent, tests, scope[path]))
    print("\nmodule                               mutants  killed  equiv  survived  score")
    for r in results:
        total = r["killed"] + r["timeout"] + r["equivalent"] + r["survived"]
        print(
            f"{r['path']:<36} {total:>7} {r['killed'] + r['timeout']:>7} {r['equivalent']:>6} "
            f"{r['survived']:>9} {r['score']:>6.1%}"
        )


if __name__ == "__main__":
    main()
