"""The tree stays ruff- and mypy-clean, and the layering rules of docs/ARCHITECTURE.md hold."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from background import Job

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _mypy(_: Path) -> list[str] | None:
    mypy = shutil.which("mypy")
    return None if mypy is None else [mypy]


MYPY = Job("test_mypy_is_clean", _mypy, cwd=ROOT)  # started early: tests/support/background.py


def test_mypy_is_clean():
    result = MYPY.result()
    if result is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    assert result.returncode == 0, result.stdout + result.stderr


PARTS = ("protocol", "transport", "weights", "demo", "enginecore", "executor", "kernels",
         "frontend")


def _module_imports() -> dict[str, set[str]]:
    """Every pagellm module -> the pagellm modules it imports, at module level or inside
    a function alike (a lazy import still ties the two), resolved to modules: `from
    pagellm.executor.worker import memory` is `pagellm.executor.worker.memory`."""
    modules = {}
    for path in (ROOT / "pagellm").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagellm"):
                module = node.module or ""
                found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found - {name}
    return graph


def _layer(module: str) -> str:
    """Which part a module belongs to, naming executor's layers apart: "executor.model",
    "executor.worker", "executor" (the process layer); pagellm's shared modules by their
    own name ("logger")."""
    names = module.split(".")[1:] or ["pagellm"]
    if names[0] == "executor" and len(names) > 1 and names[1] in ("model", "worker", "lora"):
        return f"executor.{names[1]}"
    return names[0]


def _imports(part: str) -> set[str]:
    """What a part of pagellm imports: other parts and executor's layers by their name
    (see `_layer`), anything outside pagellm by its top-level name ("torch")."""
    graph = _module_imports()
    found = {_layer(target) for module, targets in graph.items()
             if _layer(module) == part or _layer(module).startswith(part + ".")
             for target in targets} - {part}
    for path in (ROOT / "pagellm" / part).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
    return found - {"pagellm"}


def test_every_import_of_our_code_goes_through_the_pagellm_namespace():
    for path in [*(ROOT / "pagellm").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
                 *(ROOT / "benchmarks").rglob("*.py")]:
        for line in path.read_text().splitlines():
            assert not re.match(rf"\s*(from|import)\s+({'|'.join(PARTS)})\b", line), \
                (path, line)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a module graph: its strongly connected components of more
    than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                component.append(stack.pop())
                if component[-1] == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_module_imports_itself_through_others():
    """No import circle anywhere in pagellm, lazy imports included (issue 38: the
    clients' base imported its subclasses, executor.py and multiproc.py each other)."""
    assert not _circles(_module_imports())


def test_the_circle_check_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"x": {"y"}, "y": {"x"}, "z": {"x"}}) == [["x", "y"]]


def test_protocol_imports_neither_torch_nor_zmq_nor_other_packages():
    assert not _imports("protocol") & {"torch", "zmq", *PARTS, "pickle", "logger"}


def test_shared_homes_import_only_the_protocol():
    """transport (sockets, CURVE), weights (the sender and both sides' formats) and demo
    (the demo model) are used from both sides of the socket: they import no side."""
    for part in ("transport", "weights", "demo"):
        assert not _imports(part) & (set(PARTS) - {"protocol"} | {
            "executor.worker", "executor.lora", "executor.model"}), part


def test_scheduler_and_block_manager_are_free_of_torch():
    for name in ("scheduler.py", "kv_cache_manager.py", "block_pool.py", "request.py"):
        text = (ROOT / "pagellm" / "enginecore" / name).read_text()
        assert not re.search(r"^\s*(import|from)\s+(torch|pagellm\.executor)", text, re.M), \
            name


def test_imports_point_one_way():
    """frontend -> enginecore -> executor (process layer -> worker -> lora -> model) ->
    kernels."""
    layers = {"executor.worker", "executor.lora", "executor.model"}
    assert "frontend" not in _imports("enginecore") | _imports("executor") | _imports("kernels")
    assert not _imports("frontend") & {"executor", *layers}
    assert not _imports("executor") & {"enginecore", "frontend", "transport"}
    assert not _imports("executor.worker") & {"executor", "enginecore", "frontend"}
    assert not _imports("executor.lora") & {"executor", "executor.worker", "enginecore",
                                            "frontend", "weights"}
    assert not _imports("executor.model") & {"executor", "executor.worker", "executor.lora",
                                             "enginecore", "frontend", "weights"}
    assert not _imports("kernels") & {*PARTS, *layers} - {"kernels"}


@pytest.mark.parametrize("module", ["pagellm", "pagellm.protocol", "pagellm.enginecore.scheduler",
                                    "pagellm.enginecore.kv_cache_manager",
                                    "pagellm.enginecore.structured_output.manager",
                                    "pagellm.inputs", "pagellm.sampling_params"])
def test_pure_python_modules_import_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_dependency_has_a_floor_that_ci_pins():
    """CI's oldest-versions leg pins what .ci/oldest_constraints.py prints: one pin per
    requirement, at the floor pyproject.toml declares (torch: the CPU wheel CI has)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    out = subprocess.run([sys.executable, str(ROOT / ".ci/oldest_constraints.py")],
                         capture_output=True, text=True, check=True).stdout.split()
    pins = dict(line.split("==") for line in out)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra]
    names = set()
    for requirement in declared:  # extras ("lm-eval[api,hf]") are no part of the pin
        name, floor = re.fullmatch(r"([\w.-]+)(?:\[[\w,.-]+\])?>=([\w.]+)", requirement).groups()
        assert pins[name.lower()] == (floor if name != "torch" else "2.13.0"), requirement
        names.add(name.lower())
    assert len(pins) == len(names)
