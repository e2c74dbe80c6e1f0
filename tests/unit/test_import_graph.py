"""No import circle anywhere in ``services/``, ``shared/`` and ``baton/``.

The graph is read from the source with ``ast`` (nothing is imported). A module's edges are every
import statement in its file, at any depth: module level, inside functions, methods, ``try`` and
``if`` blocks. Each resolves to a module of the tree, or is dropped (the standard library, third
parties):

    import a.b.c                  a.b.c (or its longest prefix that is a module of the tree)
    from a.b import c             a.b.c when a/b/c.py or a/b/c/__init__.py exists, else a.b
    from . import c, from ..x import y
                                  the same, relative to the file's package

Only the module named is an edge, not the packages above it: a package's ``__init__`` that
imports its own submodules is the ordinary layout, not a circle.

Imports under ``if TYPE_CHECKING:`` (the ``else`` branch does run) are left out: they never
execute, and hiding an annotation's import there is the accepted way to type across modules
that must not import each other. Imports by a computed name (``importlib.import_module(name)``,
as ``baton/__init__.py`` and the attention registry do) are not seen.

A circle is a strongly connected component of more than one module, or a module that imports
itself; the failure names one shortest circle of each component, each edge with its file and
line.
"""

import ast
from collections import deque
from itertools import pairwise
from pathlib import Path

import baton

ROOT = Path(baton.__file__).parent.parent
TREE = ("services", "shared", "baton")

Edges = dict[str, dict[str, str]]  # module → imported module → where ("path:line")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module under ``root/<package>`` for each package, by dotted name."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a module of the tree."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:end])) in modules:
            return prefix
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path], root: Path) -> dict[str, str]:
    """The modules of the tree that ``module`` (in ``path``) imports, each with where."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, str] = {}
    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [_known(a.name, modules) for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _known(base, modules)
                for a in node.names
            ]
        for target in targets:
            if target is not None:
                found.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return found


def import_graph(root: Path, packages: tuple[str, ...] = TREE) -> Edges:
    """module → {imported module of the tree → "path:line"} for every module of ``packages``."""
    modules = module_files(root, packages)
    return {m: imports_of(m, p, modules, root) for m, p in modules.items()}


def components(edges: Edges) -> list[list[str]]:
    """The strongly connected components of ``edges`` (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in edges:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
    return found


def shortest_circle(edges: Edges, members: list[str]) -> list[str]:
    """One shortest circle through the first of ``members`` (a component), start repeated."""
    start, inside = members[0], set(members)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(edges[node]):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if target in inside and target not in came_from:
                came_from[target] = node
                queue.append(target)
    raise AssertionError(f"{members} is no circle")


def circles(edges: Edges) -> list[list[str]]:
    """One shortest circle of every component that has one (a self-import is one too)."""
    return [
        shortest_circle(edges, c) for c in components(edges) if len(c) > 1 or c[0] in edges[c[0]]
    ]


def describe(edges: Edges, circle: list[str]) -> str:
    steps = [f"    {a} -> {b}  ({edges[a][b]})" for a, b in pairwise(circle)]
    return "\n".join([" -> ".join(circle), *steps])


def test_the_whole_tree_imports_form_no_circle() -> None:
    edges = import_graph(ROOT)
    assert {m.partition(".")[0] for m in edges} == set(TREE)
    assert "services.worker.engine.executor.rank" in edges  # (the tree was found)
    found = circles(edges)
    assert not found, "import circles:\n" + "\n\n".join(describe(edges, c) for c in found)


def test_baton_imports_in_one_direction() -> None:
    """serving (tests) → cli → service_cli → launcher and engine_flags, within ``baton/``
    (cli also → tiny_model and transports, leaves)."""
    edges = import_graph(ROOT)

    def within_baton(module: str) -> set[str]:
        return {t for t in edges[module] if t.startswith("baton.")}

    assert within_baton("baton.cli") == {"baton.service_cli", "baton.tiny_model",
                                         "baton.transports"}  # fmt: skip
    assert within_baton("baton.transports") == set()
    assert within_baton("baton.service_cli") == {"baton.launcher", "baton.engine_flags"}
    assert within_baton("baton.launcher") == set()
    assert within_baton("baton.engine_flags") == set()


def test_the_executor_seam_imports_no_executor() -> None:
    edges = import_graph(ROOT)
    executor = "services.worker.engine.executor"
    assert not {t for t in edges[f"{executor}.executor"] if t.startswith(f"{executor}.")}
    assert f"{executor}.factory" in edges["services.worker.engine.core"]


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_check_finds_a_circle_of_function_local_imports(tmp_path: Path) -> None:
    write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg.b import g\n    return g\n",
        "pkg/b.py": "import os\n\n\nclass C:\n    def g(self):\n        from . import a\n",
        "pkg/c.py": "from pkg import a\n",  # into the circle, not part of it
    })  # fmt: skip
    edges = import_graph(tmp_path, ("pkg",))
    assert edges["pkg.a"] == {"pkg.b": "pkg/a.py:2"}
    assert edges["pkg.b"] == {"pkg.a": "pkg/b.py:6"}
    assert circles(edges) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert "pkg.b -> pkg.a  (" in describe(edges, circles(edges)[0])


def test_the_check_resolves_imports_and_skips_type_checking_ones(tmp_path: Path) -> None:
    write(tmp_path, {
        "pkg/__init__.py": "from pkg.sub.x import X\n",  # a package importing its own: no circle
        "pkg/sub/__init__.py": "NAME = 1\n",
        "pkg/sub/x.py": (
            "from typing import TYPE_CHECKING\n"
            "import pkg.sub.y\n"
            "from .. import sub\n"
            "from ..sub import NAME, y\n"
            "if TYPE_CHECKING:\n    from pkg.z import Z\nelse:\n    Z = None\n"
            "X = 1\n"
        ),
        "pkg/sub/y.py": "import json\n",
        "pkg/z.py": "from pkg.sub.x import X\n",  # only a type-checking edge comes back
        "pkg/self.py": "def f():\n    from pkg.self import f\n",
    })  # fmt: skip
    edges = import_graph(tmp_path, ("pkg",))
    assert set(edges["pkg"]) == {"pkg.sub.x"}
    assert set(edges["pkg.sub.x"]) == {"pkg.sub", "pkg.sub.y"}
    assert set(edges["pkg.z"]) == {"pkg.sub.x"}
    assert circles(edges) == [["pkg.self", "pkg.self"]]
