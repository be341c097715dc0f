"""No import circle inside the controller, nor inside the trainer.

Every ``import`` and ``from ... import`` of every module under ``dflashctl/`` counts,
including those inside functions (a function-level import only hides a circle until
that function runs); imports under ``if TYPE_CHECKING:`` do not (they never run).
The graph's cycles are named module by module, each edge with the line that makes
it, so the import to move is plain from the failure.

That importing every controller module loads no torch, triton or transformers is
checked in tests/test_cli.py (``test_the_controller_never_imports_torch``).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "dflashctl"

Edges = dict[str, dict[str, list[str]]]  # module -> imported module -> ["path:line", ...]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (the package directory)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: module level, in functions, in classes,
    in try/else branches; not the body of ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (a module, or an attribute of the nearest one)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, package: str) -> Edges:
    """The package-internal import edges of every module, with where each is made."""
    modules = module_names(root, package)
    edges: Edges = {m: {} for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        where = path.relative_to(root.parent)
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from pkg import name`: the submodule pkg.name if there is one, else pkg.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                owner = _owner(target, modules)
                lines = edges[module].setdefault(owner, []) if owner not in (None, module) else None
                if lines is not None and f"{where}:{node.lineno}" not in lines:
                    lines.append(f"{where}:{node.lineno}")
    return edges


def _strongly_connected(edges: Edges) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
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
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def _shortest_path(edges: Edges, source: str, target: str, within: set[str]) -> list[str]:
    paths = {source: [source]}
    frontier = [source]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(edges[node]):
                if succ in within and succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    following.append(succ)
        if target in paths:
            return paths[target]
        frontier = following
    raise AssertionError(f"no path {source} -> {target} inside its own component")


def cycles(edges: Edges) -> list[str]:
    """Each import circle, written ``a -> b -> a`` with the lines making each edge.

    One shortest circle through every edge that lies on a circle, so every edge to
    cut is named; a circle found through several edges is written once."""
    found: dict[frozenset, str] = {}
    for component in _strongly_connected(edges):
        members = set(component)
        for module in component:
            for target in sorted(edges[module]):
                if target not in members:
                    continue
                loop = [module, *_shortest_path(edges, target, module, members)]
                key = frozenset(zip(loop, loop[1:]))
                if key not in found:
                    where = "; ".join(f"{a} -> {b} at {', '.join(edges[a][b])}" for a, b in zip(loop, loop[1:]))
                    found[key] = f"{' -> '.join(loop)}  ({where})"
    return sorted(found.values())


# --------------------------------------------------------------------------- the controller


def test_the_controller_has_no_import_circle():
    edges = import_graph(REPO / PACKAGE, PACKAGE)
    assert len(edges) > 20 and edges["dflashctl.launch"], "the walk found no modules or no imports"
    circles = cycles(edges)
    assert not circles, "import circles inside dflashctl/:\n  " + "\n  ".join(circles)


def test_the_trainer_has_no_import_circle():
    # Data flows one way: checkpoint and model read serving's metadata rules; restore
    # rebuilds a drafter from all three; none of them imports its reader back.
    edges = import_graph(REPO / "trainer", "trainer")
    assert len(edges) > 20 and "trainer.serving" in edges["trainer.checkpoint"], "the walk found no trainer imports"
    circles = cycles(edges)
    assert not circles, "import circles inside trainer/:\n  " + "\n  ".join(circles)


# --------------------------------------------------------------------------- the checker itself


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_a_function_level_import_closes_a_circle(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from pkg.b import thing\n",
        "b.py": "thing = 1\ndef later():\n    from pkg import a\n    return a\n",
        "c.py": "import pkg.a\n",  # imports into the circle: not part of it
    })
    assert cycles(import_graph(root, "pkg")) == ["pkg.a -> pkg.b -> pkg.a  (pkg.a -> pkg.b at pkg/a.py:1; "
                                                 "pkg.b -> pkg.a at pkg/b.py:3)"]


def test_imports_under_type_checking_do_not_count(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from pkg.b import thing\n",
        "b.py": """\
            from typing import TYPE_CHECKING
            import typing
            thing = 1
            if TYPE_CHECKING:
                from pkg.a import other
            if typing.TYPE_CHECKING:
                import pkg.a
            else:
                import json
            """,
    })
    edges = import_graph(root, "pkg")
    assert edges["pkg.b"] == {} and cycles(edges) == []
    (tmp_path / "pkg" / "b.py").write_text("if True:\n    from pkg.a import other\n")
    assert cycles(import_graph(root, "pkg"))


def test_relative_and_subpackage_imports_and_longer_circles(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from . import b\n",
        "b.py": "from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import name\n",
        "d.py": "from pkg import sub\n",
    })
    edges = import_graph(root, "pkg")
    assert edges["pkg.b"] == {"pkg.sub.c": ["pkg/b.py:1"]} and edges["pkg.d"] == {"pkg.sub": ["pkg/d.py:1"]}
    (circle,) = cycles(edges)
    assert circle.startswith("pkg.a -> pkg.b -> pkg.sub.c -> pkg.a  (")


def test_every_edge_of_a_tangle_is_named(tmp_path):
    root = _package(tmp_path, {
        "a.py": "import pkg.b\nimport pkg.c\n",
        "b.py": "import pkg.a\n",
        "c.py": "import pkg.a\n",
    })
    assert [c.split("  (")[0] for c in cycles(import_graph(root, "pkg"))] == [
        "pkg.a -> pkg.b -> pkg.a", "pkg.a -> pkg.c -> pkg.a"]
