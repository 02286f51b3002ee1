"""minidp's import graph, read from the source (ast): which module imports which, and in which room.

A room is a folder of minidp/ (counted once) or a module at its top. Every import counts, also one inside
a function: a lazy import is still an arrow. Used by tests/test_layout.py; run it to print the counts:

    python tests/scripts/import_graph.py [PACKAGE_DIR]
"""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules(package_dir: str) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file under package_dir (a package named by its folder)."""
    top = os.path.basename(package_dir.rstrip("/"))
    found = {}
    for dirpath, _, files in os.walk(package_dir):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), package_dir)[:-3].split(os.sep)
                parts = [top, *rel]
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = os.path.join(dirpath, name)
    return found


def imports_of(name: str, path: str, known: dict) -> set[str]:
    """The known modules that module `name` (file `path`) imports; `from pkg import mod` counts as pkg.mod."""
    is_package = path.endswith("__init__.py")
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & set(known)
            targets.update(submodules)
            if len(submodules) < len(node.names):  # names defined in base itself
                targets.add(base)
    resolved = set()
    for target in targets:
        while target and target not in known:  # `import a.b.c` of a name inside a module: its module
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def graph(package_dir: str) -> dict[str, set[str]]:
    known = modules(package_dir)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def room(module: str) -> str:
    """minidp.engine.ddp -> engine; minidp.run -> run; minidp (its __init__) -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_arrows(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(room(a), room(b)) for a, targets in edges.items() for b in targets if room(a) != room(b)}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Module-level import cycles (each found once, as a path that closes on its first module)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def imports_torch(path: str) -> bool:
    for node in ast.walk(ast.parse(open(path).read())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


if __name__ == "__main__":
    package = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "minidp")
    edges = graph(package)
    rooms = {room(m) for m in edges}
    print(f"{len(rooms)} rooms, {len(room_arrows(edges))} arrows between rooms, "
          f"{sum(len(t) for t in edges.values())} module imports, {len(cycles(edges))} cycles")
    for a, b in sorted(room_arrows(edges)):
        print(f"  {a} -> {b}")
    for cycle in cycles(edges):
        print("  cycle:", " -> ".join(cycle))
