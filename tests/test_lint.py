"""The tree stays ruff- and mypy-clean, and the layering rules of docs/ARCHITECTURE.md hold."""

from __future__ import annotations

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


MYPY = Job("test_mypy_is_clean", _mypy, cwd=ROOT)  # started early: tests/background.py


def test_mypy_is_clean():
    result = MYPY.result()
    if result is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    assert result.returncode == 0, result.stdout + result.stderr


PARTS = ("protocol", "enginecore", "executor", "kernels", "frontend")


def _imports(part: str) -> set[str]:
    """What a part of pagellm imports: other parts by their name (`pagellm.executor.x`
    counts as "executor"), pagellm's shared modules by theirs ("logger"), anything else
    by its top-level name ("torch")."""
    found = set()
    for path in (ROOT / "pagellm" / part).rglob("*.py"):
        for line in path.read_text().splitlines():
            m = re.match(r"\s*(?:from|import)\s+([a-zA-Z_][\w.]*)", line)
            if m:
                names = m.group(1).split(".")
                found.add(names[1] if names[0] == "pagellm" and len(names) > 1 else names[0])
    return found


def test_every_import_of_our_code_goes_through_the_pagellm_namespace():
    for path in [*(ROOT / "pagellm").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
                 *(ROOT / "benchmarks").rglob("*.py")]:
        for line in path.read_text().splitlines():
            assert not re.match(rf"\s*(from|import)\s+({'|'.join(PARTS)})\b", line), \
                (path, line)


def test_protocol_imports_neither_torch_nor_zmq_nor_other_packages():
    assert not _imports("protocol") & {"torch", "zmq", "frontend", "enginecore", "executor",
                                       "kernels", "pickle", "logger"}


def test_scheduler_and_block_manager_are_free_of_torch():
    for name in ("scheduler.py", "kv_cache_manager.py", "block_pool.py", "request.py"):
        text = (ROOT / "pagellm" / "enginecore" / name).read_text()
        assert not re.search(r"^\s*(import|from)\s+(torch|pagellm\.executor)", text, re.M), \
            name


def test_imports_point_one_way():
    assert "frontend" not in _imports("enginecore") | _imports("executor") | _imports("kernels")
    assert not _imports("executor") & {"enginecore", "frontend"}
    assert not _imports("kernels") & {"enginecore", "frontend", "executor"}


@pytest.mark.parametrize("module", ["pagellm", "pagellm.protocol", "pagellm.enginecore.scheduler",
                                    "pagellm.enginecore.kv_cache_manager"])
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
