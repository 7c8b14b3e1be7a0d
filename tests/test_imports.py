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


ROOT = PKG.parent
VLLM = "proxima.integration.vllm"
FOLDERS = ("attention", "scheduler", "worker", "serve")
ALLOWED: dict[str, set[str]] = {
    # The flow (docs/vllm-integration.md): attention -> connector -> scheduler / worker -> plan.
    # Scheduler and worker run in different processes and never import each other. `VLLM` itself
    # is the root constants module.
    "attention": {"attention", "connector", "scheduler", "worker", "plan", VLLM},
    "connector": {"connector", "scheduler", "worker", "plan", VLLM},
    "scheduler": {"scheduler", "plan", VLLM},
    "worker": {"worker", "plan", VLLM},
    "plan": {"plan", VLLM},
    VLLM: {VLLM},
}
"""What each part of integration/vllm may import from integration/vllm. Unlisted parts (serve/,
plugin, _patches: the binding modules) may import anything."""


def _part(module: str) -> str | None:
    """The part of integration/vllm a module belongs to (a folder, a root module, or VLLM itself)."""
    if module == VLLM:
        return VLLM
    if not module.startswith(VLLM + "."):
        return None
    return module[len(VLLM) + 1:].split(".")[0]


def test_integration_vllm_imports_follow_the_flow() -> None:
    graph = _graph()
    assert {p.name for p in (PKG / "integration" / "vllm").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        FOLDERS
    )
    bad = []
    for m, deps in graph.items():
        allowed = ALLOWED.get(_part(m) or "")
        if allowed is None:
            continue
        bad += [f"{m} imports {d}" for d in sorted(deps) if _part(d) is not None and _part(d) not in allowed]
    assert not bad, "\n".join(bad)


def _strings_naming_modules(modules: set[str]) -> set[str]:
    """Modules named by a string in the package (`python -m` children, vLLM's class paths, the
    CLI's sub-apps): they are loaded by name, not by an import statement."""
    named: set[str] = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                # A module's name, or a class path `module.Class` (vLLM's backend registry).
                for name in (node.value, node.value.rpartition(".")[0]):
                    if name in modules:
                        named.add(name)
    return named


def _entry_points() -> set[str]:
    """The modules pyproject.toml's scripts and entry points load."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = list(project.get("scripts", {}).values())
    targets += [t for group in project.get("entry-points", {}).values() for t in group.values()]
    return {t.split(":")[0] for t in targets}


def test_every_module_serves_the_product() -> None:
    """No module under proxima/ is there only for bench/ or tests/: each is reachable from an
    entry point (the `proxima` command, the vLLM plugin) through imports or a module name the
    product loads (`python -m ...`, vLLM's class paths)."""
    graph = _graph()
    roots = _entry_points() | _strings_naming_modules(set(graph))
    assert roots and all(r in graph for r in roots), roots
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        # Importing a module runs its packages' __init__ first.
        parents = [m.rsplit(".", i)[0] for i in range(1, m.count(".") + 1)]
        todo += [d for d in (*graph[m], *parents) if d in graph]
    unused = sorted(set(graph) - seen)
    assert not unused, f"modules no entry point reaches (used only by bench/ or tests/?): {unused}"
