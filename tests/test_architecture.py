"""The house rules, checked on the source: who may spawn, probe, spell flags, talk to the user, and what the
pure core may import. Reads files with ``ast``; needs no engine and runs in well under a second.

A rule broken here is a design promise the README makes and the code stopped keeping: fix the code (move the
work to its owner), not the rule.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

TUNER = Path(__file__).resolve().parent.parent / "tuner"
MAX_MODULE_LINES = 500

# Package → the tuner packages it may import. Data flows one way: cli → report → frontier/quants (the two stages
# built on the single-winner study) → search → measure/quality → engine/models/hub → plan/machine/catalog → core.
ALLOWED = {
    "core": set(),
    "plan": {"core"},
    "machine": {"core"},
    "catalog": {"core", "machine"},
    "engine": {"core", "machine"},
    "models": {"core", "catalog", "machine", "engine"},
    "hub": {"core", "machine", "models", "catalog"},
    "quality": {"core", "machine", "engine", "models", "hub"},
    "measure": {"core", "machine", "engine", "models", "plan", "quality"},
    "search": {"core", "machine", "engine", "models", "plan", "quality", "measure", "hub", "catalog"},
    "frontier": {"core", "machine", "engine", "models", "plan", "quality", "measure", "catalog", "search"},
    "quants": {"core", "machine", "engine", "models", "plan", "quality", "measure", "hub", "catalog", "search"},
    "versus": {"core", "machine", "engine", "models", "plan", "quality", "measure", "hub", "catalog", "search"},
    # Sharing results over the Hub: records built from a result, read back as seeds and look-ups.
    "share": {"core", "machine", "engine", "models", "plan", "quality", "measure", "hub", "catalog", "search"},
    "report": {"core", "machine", "engine", "models", "plan", "quality", "measure", "search", "frontier", "quants",
               "catalog", "versus"},
    "cli": {"core", "machine", "engine", "models", "plan", "quality", "measure", "search", "frontier", "quants",
            "hub", "catalog", "report", "versus", "mcp_server", "share"},  # mcp_server: `moe-tune mcp` opens its door
    # The MCP server: a second front end beside cli, over the same library calls (it never imports cli).
    "mcp_server": {"core", "machine", "engine", "models", "plan", "quality", "measure", "search", "frontier",
                   "quants", "hub", "catalog", "report"},
}
PURE = ("core", "plan")  # no I/O, no clock, no environment, no third-party imports
PURE_STDLIB = {"__future__", "dataclasses", "enum", "pathlib", "collections", "typing", "math", "re", "functools",
               "itertools", "statistics", "bisect"}
# Third-party or stdlib module → the only places that may import it.
OWNERS = {
    "subprocess": ("engine/runner.py",), "multiprocessing": ("engine/runner.py",), "pty": ("engine/runner.py",),
    "psutil": ("machine/",), "pynvml": ("machine/",),
    "typer": ("cli/",), "rich": ("cli/",), "click": (),
    "optuna": ("search/study.py", "search/space.py", "frontier/pareto.py"),
    "matplotlib": ("report/",),
    "huggingface_hub": ("hub/",), "httpx": ("hub/",), "httpx2": ("hub/",),
    "mcp": ("mcp_server/",), "mcp_types": ("mcp_server/",),
    "pyarrow": ("share/shards.py",),
}
# Strings that look like llama.cpp flags but are another program's arguments: pip's `-m pip download -d DIR`,
# nvcc's `-o OUT` and `python -c CODE` for the VRAM ballast, nvcc's `-c` and pip's `-d` for the CUDA toolkit.
NOT_LLAMA_FLAGS = {"engine/sdist.py": {"-m", "-d"}, "machine/ballast.py": {"-o", "-c"},
                   # flags read in a --help to tell ik_llama.cpp from llama.cpp, never put in a line
                   "engine/kinds.py": {"-rtr", "--run-time-repack", "-ser", "--smart-expert-reduction", "-amb",
                                       "--attention-max-batch"},
                   "machine/ram_ballast.py": {"-c"},  # python -c
                   "engine/cuda_toolkit.py": {"-m", "-d", "-c", "-o"},  # pip download -d; nvcc -c; cc -o
                   "engine/cuda_wheels.py": {"-m", "-d"},  # pip download -d: NVIDIA's CUDA wheels
                   "models/trained.py": {"-m", "-d"}}  # pip download -d: the trained model's wheel
SPAWNING_OS_CALLS = re.compile(r"^(system|popen|fork|forkpty|posix_spawn\w*|exec\w+|spawn\w+)$")


@dataclass(frozen=True)
class Module:
    rel: str  # "engine/runner.py"
    package: str  # "engine"; "" for top-level modules
    tree: ast.Module
    n_lines: int


@cache
def modules() -> tuple[Module, ...]:
    out = []
    for path in sorted(TUNER.rglob("*.py")):
        rel = path.relative_to(TUNER).as_posix()
        text = path.read_text()
        package = rel.split("/")[0] if "/" in rel else ""
        out.append(Module(rel, package, ast.parse(text, rel), text.count("\n") + 1))
    return tuple(out)


def imports(mod: Module) -> list[tuple[str, int]]:
    """Every imported module name (``tuner.plan.memory``, ``subprocess``) with its line."""
    found = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
            if node.module == "tuner":  # from tuner import plan
                found += [(f"tuner.{a.name}", node.lineno) for a in node.names]
    return found


def owned_by(rel: str, owners: tuple[str, ...]) -> bool:
    return any(rel == o or (o.endswith("/") and rel.startswith(o)) for o in owners)


def llama_flags() -> set[str]:
    """Every llama.cpp flag spelled in tuner/engine/flags/ (the one place allowed to spell them)."""
    trees = [m.tree for m in modules() if m.rel.startswith("engine/flags/")]
    spelled = {n.value for t in trees for n in ast.walk(t) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {s for s in spelled if re.fullmatch(r"--?[a-z][a-z0-9-]*", s)}


def string_constants(tree: ast.Module) -> list[tuple[str, int]]:
    """String literals that are values: not docstrings, not pieces of f-strings (text, not argv items)."""
    skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    skip |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return [(n.value, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_packages_import_only_downstream_packages() -> None:
    wrong = []
    for mod in modules():
        allowed = ALLOWED.get(mod.package)
        if allowed is None:
            continue
        for name, line in imports(mod):
            parts = name.split(".")
            if parts[0] == "tuner" and len(parts) > 1 and parts[1] in ALLOWED and parts[1] != mod.package \
                    and parts[1] not in allowed:
                wrong.append(f"tuner/{mod.rel}:{line} imports {name} ({mod.package} may use {sorted(allowed)})")
    assert not wrong, "\n".join(wrong)


def test_every_module_lives_in_a_known_package() -> None:
    loose = [m.rel for m in modules() if m.package not in ALLOWED and m.rel != "__init__.py"]
    assert not loose, f"modules outside the stage packages: {loose}"


def test_only_owners_import_processes_probes_ui_and_search() -> None:
    wrong = []
    for mod in modules():
        for name, line in imports(mod):
            top = name.split(".")[0]
            if top in OWNERS and not owned_by(mod.rel, OWNERS[top]):
                wrong.append(f"tuner/{mod.rel}:{line} imports {name} (only {OWNERS[top] or 'nobody'})")
    assert not wrong, "\n".join(wrong)


def test_only_runner_spawns_processes() -> None:
    wrong = []
    for mod in modules():
        if mod.rel == "engine/runner.py":
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                    and SPAWNING_OS_CALLS.match(node.attr):
                wrong.append(f"tuner/{mod.rel}:{node.lineno} calls os.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_only_flags_spells_llama_cpp_flags() -> None:
    flags = llama_flags()
    assert {"--n-cpu-moe", "-ctk", "--host", "--log-jsonl"} <= flags  # the scan itself works
    wrong = []
    for mod in modules():
        if mod.rel.startswith("engine/flags/") or mod.package == "cli":  # cli: moe-tune's own option names
            continue
        for value, line in string_constants(mod.tree):
            if value in flags and value not in NOT_LLAMA_FLAGS.get(mod.rel, set()):
                wrong.append(f"tuner/{mod.rel}:{line} spells {value!r}: render it in tuner/engine/flags/")
    assert not wrong, "\n".join(wrong)


def test_pure_core_imports_nothing_with_side_effects() -> None:
    wrong = []
    for mod in modules():
        if mod.package not in PURE:
            continue
        for name, line in imports(mod):
            top = name.split(".")[0]
            inside = top == "tuner" and name.split(".")[1] in PURE if "." in name else False
            if not inside and top not in PURE_STDLIB:
                wrong.append(f"tuner/{mod.rel}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_pure_core_imports_without_third_party_packages() -> None:
    blocked = ["psutil", "pynvml", "gguf", "optuna", "numpy", "typer", "rich", "huggingface_hub", "matplotlib"]
    pure = [f"tuner.{m.rel[:-3].replace('/', '.')}" for m in modules() if m.package in PURE]
    code = ("import sys\n" + "".join(f"sys.modules[{b!r}] = None\n" for b in blocked)
            + "".join(f"import {p}\n" for p in pure))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]


def module_graph() -> dict[str, set[str]]:
    """Module → the tuner modules it imports, wherever the import stands (inside a function or under
    ``TYPE_CHECKING`` too: a circle hidden behind a late import is still a circle in the design)."""
    def dotted(rel: str) -> str:
        name = "tuner." + rel[:-3].replace("/", ".")
        return name.removesuffix(".__init__")

    names = {dotted(m.rel) for m in modules()}
    graph: dict[str, set[str]] = {}
    for mod in modules():
        me, found = dotted(mod.rel), set()
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}  # from tuner.engine import runner
        graph[me] = {n for n in found if n in names and n != me}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules, as the path that closes it."""
    cycles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        stack, on_path = [(start, iter(sorted(graph[start])))], [start]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif child in on_path:
                cycles.append(on_path[on_path.index(child):] + [child])
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                on_path.append(child)
    return cycles


def test_import_cycles_are_found() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    graph = module_graph()
    assert "tuner.engine.runner" in graph["tuner.engine.build"]  # the scan resolves `from tuner.engine import x`
    cycles = import_cycles(graph)
    assert not cycles, "import circles (move the shared type down a level):\n" + "\n".join(
        " → ".join(c) for c in cycles)


def test_error_classes_live_in_the_error_module() -> None:
    """One error tree in one file (tuner/core/errors.py); a private control-flow signal (``_NeedMore``) may stay
    beside the code that raises and catches it."""
    def base_name(node: ast.expr) -> str:
        return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""

    wrong = []
    for mod in modules():
        if mod.rel == "core/errors.py":
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and (
                    node.name.endswith("Error") or any(base_name(b).endswith(("Error", "Exception"))
                                                       for b in node.bases)):
                wrong.append(f"tuner/{mod.rel}:{node.lineno} defines {node.name}: move it to tuner/core/errors.py")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("mod", modules(), ids=lambda m: m.rel)
def test_modules_stay_small(mod: Module) -> None:
    assert mod.n_lines <= MAX_MODULE_LINES, f"tuner/{mod.rel} has {mod.n_lines} lines: split it by concern"
