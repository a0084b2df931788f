"""Packages import downward only (docs/architecture.md): each package's imports of other
inferprof packages, inside functions too, stay within what it may import."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "inferprof"

#: The base every package may import: names, versions and the settings toolkit.
BASE = {
    "semconv", "_version", "_optional", "_shadowing", "environment_variables", "_settings",
    "timing",
}

#: package (or top-level module) -> the inferprof packages it may import besides BASE.
ALLOWED = {
    "semconv": set(),
    "_version": set(),
    "_optional": set(),
    "_shadowing": set(),
    "environment_variables": set(),
    "_settings": set(),
    "timing": set(),
    "instrumentation": set(),
    "batching": {"instrumentation"},
    "fastapi": {"instrumentation"},
    "triton": {"instrumentation"},
    "_config": {"instrumentation"},
    "gpu": {"_config", "instrumentation", "cli"},
    "cli": set(),
    "collector": {"cli"},
    "report": {"collector"},
    "demo": {"_config", "instrumentation", "batching", "fastapi", "collector", "report", "cli"},
    "__init__": {"_config", "instrumentation", "batching"},
}


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n.split(".")[1] for n in names if n.startswith("inferprof."))
    return found


def test_every_package_imports_only_what_sits_below_it():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        owner = rel[0][:-3] if len(rel) == 1 else rel[0]
        for target in _imports(path) - {owner} - BASE:
            if target not in ALLOWED[owner]:
                wrong.append(f"{path.relative_to(ROOT.parent)} imports inferprof.{target}")
    assert not wrong, "\n".join(wrong)


def test_the_base_imports_nothing_above_it():
    for name in BASE:
        path = ROOT / f"{name}.py"
        assert _imports(path) <= BASE - {name} | {"semconv"}, name
