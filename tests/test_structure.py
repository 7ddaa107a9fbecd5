"""The tree's structure rules, read from the source: runtime/ never imports compiler/, no import circle
between modules, and no module outside the backend registry tells backends apart by their names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "compiler")
REGISTRY = {"runtime/backends/registry.py", "runtime/backends/tensorrt.py", "runtime/backends/onnxruntime.py"}
# The strings that name a backend kind, a target, or the manifest key that marks a TensorRT engine.
BACKEND_NAMES = {"onnxruntime", "tensorrt", "engine"}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file (at the top or inside a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_runtime_never_imports_the_compiler():
    offenders = sorted(f"{name} imports {target}" for name, targets in graph().items() if name.startswith("runtime")
                       for target in targets if target.startswith("compiler"))
    assert not offenders, offenders


def test_no_module_imports_itself_round_a_circle():
    """A module importing the packages that hold it is no circle (they are imported first); any other is."""
    edges = {name: targets - packages_holding(name) for name, targets in graph().items()}
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def packages_holding(name: str) -> set[str]:
    """The packages that hold `name` (their __init__ runs before it: importing one is no circle)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def backend_name_comparisons(tree: ast.AST) -> list[int]:
    """Lines that compare a value to a backend's name, or test a mapping for the engine key."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = any(isinstance(o, ast.Constant) and o.value in BACKEND_NAMES for o in operands)
        if named and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("package", PACKAGES)
def test_only_the_registry_tells_backends_apart_by_name(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in REGISTRY:
            continue
        offenders += [f"{relative}:{line}" for line in backend_name_comparisons(ast.parse(path.read_text()))]
    assert not offenders, ("compare through runtime.backends.registry (kind_of, Target, memory_on_host, ...): "
                           f"{offenders}")


def test_the_rules_catch_what_they_are_for(tmp_path):
    """The checks above find a comparison by name and a circle where there is one."""
    tree = ast.parse('if entry.get("target") == "tensorrt" or "engine" in entry:\n    pass\n')
    assert backend_name_comparisons(tree) == [1, 1]
    assert backend_name_comparisons(ast.parse('if kind_of(entry) is TENSORRT:\n    pass\n')) == []
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("import pkg.a\n")
    known = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    assert imports_of("pkg.a", known["pkg.a"], known) == {"pkg.b"}
    assert imports_of("pkg.b", known["pkg.b"], known) == {"pkg.a"}
