"""The layers of docs/architecture.md, read from the code: every import between flashfsdp modules
(deferred ones inside functions and type-checking ones included) goes one way — no module imports
one that imports it back, directly or through others — and each layer imports only the ones below
it: ``kernels`` nothing of flashfsdp's but ``_torch_private``, ``runtime`` no ``bindings``,
``sim`` and ``estimate`` no ``bindings``, and nothing in the library the training job."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "flashfsdp"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The flashfsdp modules ``name`` imports anywhere in its file."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("flashfsdp"):
                found.add(target)
                break
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) - {"flashfsdp"} for name, path in modules.items()}


def test_no_import_cycle_among_flashfsdp_modules():
    graph = _graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _layer(name: str) -> str:
    return name.split(".")[1] if name.count(".") >= 1 else ""


FORBIDDEN = {
    "kernels": {"runtime", "bindings", "sim", "estimate", "optim", "checkpoint", "fsdp1", "train", "models"},
    "runtime": {"bindings", "sim", "estimate", "optim", "checkpoint", "fsdp1", "train"},
    "sim": {"bindings", "train"},
    "estimate": {"bindings", "train"},
}


def test_layers_import_downwards_only():
    offenders = []
    for name, deps in _graph().items():
        layer = _layer(name)
        for dep in deps:
            if _layer(dep) in FORBIDDEN.get(layer, set()):
                offenders.append(f"{name} -> {dep}")
            if _layer(dep) == "train" and layer != "train":
                offenders.append(f"{name} -> {dep} (the library never imports the training job)")
    assert not offenders, offenders
