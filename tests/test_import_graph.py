"""Imports point one way: no module of the kvforge package imports itself back through others.

Every import statement counts — module level, inside functions, under ``if TYPE_CHECKING:`` — read
from the source with ``ast`` (so the test needs no import of the package). A circle is reported as
its modules (Tarjan's strongly connected components). Also the layer rules of DESIGN.md: graphs/
imports none of compile/, runtime/, tools/; compile/ and runtime/ never import each other nor
tools/; the step machine (``runtime/engine.py``) imports nothing of the generation layer above it
(facade, batch loop, scheduler, sessions, chat)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {name: f"kvforge.{name}" for name in ("compile", "graphs", "runtime", "tools")}
GENERATION_LAYER = ("facade", "batching", "scheduler", "session", "chat")


def modules() -> dict[str, Path]:
    """``{"kvforge.runtime.engine": path}`` for every module of the package (packages as their __init__)."""
    found = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from x import y`: the submodule x.y where y is one, else a name defined in x itself
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `from kvforge.x import y`: y a submodule or a name in x
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def graph() -> dict[str, set[str]]:
    found = modules()
    return {module: imports(module, path, set(found)) for module, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    sys.setrecursionlimit(10_000)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles (each line: modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_layers_import_one_way():
    edges = graph()
    wrong = []
    for module, targets in sorted(edges.items()):
        layer = module.split(".")[1]
        for target in sorted(targets):
            other = target.split(".")[1]
            graphs_out = layer == "graphs" and other != "graphs"  # graphs/ is the bottom
            up_to_tools = layer in ("compile", "runtime") and other == "tools"
            if graphs_out or up_to_tools or {layer, other} == {"compile", "runtime"}:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layer rules:\n" + "\n".join(wrong)


def test_the_step_machine_imports_nothing_of_the_generation_layer():
    above = {f"kvforge.runtime.{name}" for name in GENERATION_LAYER}
    reached = sorted(graph()["kvforge.runtime.engine"] & above)
    assert not reached, f"runtime/engine.py (the step machine) imports the generation layer: {reached}"


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
