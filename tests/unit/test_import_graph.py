"""``baton/`` imports in one direction: no module of the package reaches, by any import (a
function-local one too), a module that imports it back."""

import ast
from pathlib import Path

import baton

PACKAGE = Path(baton.__file__).parent


def imports_of(path: Path) -> set[str]:
    """The ``baton.<module>`` names a file imports anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("baton.") and n.count(".") == 1}
    return found


def graph() -> dict[str, set[str]]:
    modules = {f"baton.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {m: (imports_of(p) & set(modules)) - {m} for m, p in modules.items()}


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for target in sorted(edges.get(module, ())):
            if circle := visit(target, [*path, module]):
                return circle
        done.add(module)
        return None

    return next((c for m in sorted(edges) if (c := visit(m, []))), None)


def test_baton_imports_form_no_circle() -> None:
    edges = graph()
    assert find_circle(edges) is None, edges
    # the direction itself: serving (tests) → cli → service_cli → launcher
    assert edges["baton.cli"] == {"baton.service_cli", "baton.tiny_model"}
    assert edges["baton.service_cli"] == {"baton.launcher"}
    assert edges["baton.launcher"] == set()


def test_the_check_finds_a_hidden_circle(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from baton.cli import build_parser\n")
    assert imports_of(probe) == {"baton.cli"}  # a function-local import counts
    circle = find_circle({"baton.a": {"baton.b"}, "baton.b": {"baton.c"}, "baton.c": {"baton.a"}})
    assert circle == ["baton.a", "baton.b", "baton.c", "baton.a"]
