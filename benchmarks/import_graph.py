"""The import graph of the captionkit package, read from the source (AST, nothing imported),
and its cycles.

    python benchmarks/import_graph.py [--root src/captionkit] [--edges]

Every ``import`` and ``from ... import`` statement of every module under the root counts,
wherever it stands: at the top, inside a function (a deferred import), under ``if
TYPE_CHECKING``. ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to
``a.b`` (a package's ``__init__``). Importing ``a.b.c`` also runs ``a/__init__`` and
``a/b/__init__``; those implicit edges are not drawn, because a package that imports its own
submodules (``captionkit.models`` importing its families) would otherwise always be a cycle.
A cycle is a strongly connected component of more than one module (or a module importing
itself). Prints the modules, the number of edges, and each cycle; exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "src" / "captionkit"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root`` (a package folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` statement names (``from ..x import y`` -> ``pkg.x``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif target in known:
                    out.add(target)
    return out


def import_graph(root: Path = DEFAULT_ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    names = module_names(root)
    return {m: imports_of(m, p, set(names)) for m, p in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the package folder (default: src/captionkit)")
    p.add_argument("--edges", action="store_true", help="also print every module's imports")
    args = p.parse_args(argv)
    graph = import_graph(args.root)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges (deferred imports included)")
    if args.edges:
        for m in sorted(graph):
            print(f"  {m} -> {', '.join(sorted(graph[m])) or '-'}")
    found = cycles(graph)
    for c in found:
        print(f"cycle of {len(c)} modules: {', '.join(c)}")
    if not found:
        print("no import cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
