"""The package's import graph: no circles, and the layering of DESIGN.md.

Read from the source (every `import` statement, also those inside functions), so a circle hidden
in a lazy import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "proxima"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                # `from pkg import mod` depends on `mod`; `from mod import name` on `mod`.
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_imports_one_that_imports_it_back() -> None:
    # (A package's __init__ runs before its modules, which Python handles; a module taking names
    # from its package's __init__ that imports that module back is a circle, and is found here.)
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_layering() -> None:
    graph = _graph()
    for m, deps in graph.items():
        for d in deps:
            if m.startswith(("proxima.policy", "proxima.compression", "proxima.placement")):
                assert not d.startswith(("proxima.integration", "proxima.api")), f"{m} imports {d}"
            if m.startswith("proxima.placement"):
                assert not d.startswith(("proxima.compression", "proxima.simulator")), f"{m} imports {d}"
