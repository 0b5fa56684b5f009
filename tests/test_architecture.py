"""The layers of docs/architecture.md, read from the code: every import between flashfsdp modules
and the training job's torch-free front ``flashfsdp_cli`` (deferred ones inside functions and
type-checking ones included, and the packages an import enters first) goes one way — no module imports
one that imports it back, directly or through others — and each layer imports only the ones below
it: ``kernels`` nothing of flashfsdp's but ``_torch_private``, ``runtime`` no ``bindings``,
``bindings`` none of the packages built on it, ``sim`` and ``estimate`` no ``bindings``, and
nothing in the library the training job. Outside the bindings, code reaches them only through
their public names: ``from flashfsdp.bindings import <name>`` or ``from
flashfsdp.bindings.state_dict import <name>``, ``<name>`` in that package's ``__all__`` (the
bindings' ``__all__`` being part of ``flashfsdp.__all__``); the state-dict package's modules
import one way, in the order sharded, full, optimizer, hf_save."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "flashfsdp"
CLI = PACKAGE.parent / "flashfsdp_cli"  # the training job's torch-free front, in the graph too


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in [*PACKAGE.rglob("*.py"), *CLI.rglob("*.py")]:
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
                found.update(_entered_packages(name, target, modules))
                break
    return found


def _entered_packages(name: str, target: str, modules: dict) -> set[str]:
    """The packages an import of ``target`` from ``name`` runs first (their ``__init__``): those
    above ``target`` that do not hold ``name`` itself (a module is imported from inside its own
    package freely), the top-level ``flashfsdp`` aside (the graph leaves it out)."""
    parts = target.split(".")
    above = {".".join(parts[:k]) for k in range(2, len(parts))}
    return {p for p in above if p in modules and not (name == p or name.startswith(p + "."))}


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
    "bindings": {"sim", "estimate", "optim", "checkpoint", "fsdp1", "train"},
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


def _all_of(module: str) -> list[str]:
    """The literal ``__all__`` of a flashfsdp package or module, read from its source."""
    path = _modules()[module]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module} has no literal __all__")


PUBLIC_BINDINGS = ("flashfsdp.bindings", "flashfsdp.bindings.state_dict")


def _absolute_imports(name: str, path: pathlib.Path):
    """(imported module, [names]) of every import statement in ``name``'s file, made absolute;
    ``import a.b`` gives (``a.b``, [])."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            yield base, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_the_rest_of_the_library_uses_the_bindings_public_names_only():
    public = {module: set(_all_of(module)) for module in PUBLIC_BINDINGS}
    offenders = []
    for name, path in _modules().items():
        if name.startswith("flashfsdp.bindings"):
            continue
        for module, names in _absolute_imports(name, path):
            if module != "flashfsdp.bindings" and not module.startswith("flashfsdp.bindings."):
                continue
            if module not in public:
                offenders.append(f"{name} imports {module} (a module of the bindings, not {PUBLIC_BINDINGS})")
            else:
                offenders += [f"{name} imports {module}.{n} (not in its __all__)" for n in names if n not in public[module]]
    assert not offenders, offenders


def test_the_bindings_public_names_are_flashfsdps():
    assert set(_all_of("flashfsdp.bindings")) <= set(_all_of("flashfsdp"))
    hf_files = {"SINGLE_FILE", "INDEX_FILE", "remove_stale_weights"}  # save_pretrained's files, for the training job
    assert set(_all_of("flashfsdp.bindings.state_dict")) - hf_files <= set(_all_of("flashfsdp.bindings"))


STATE_DICT_ORDER = ["sharded", "full", "optimizer", "hf_save"]


def test_the_state_dict_package_imports_one_way():
    graph, package = _graph(), "flashfsdp.bindings.state_dict"
    assert {m for m in graph if m.startswith(package + ".")} == {f"{package}.{m}" for m in STATE_DICT_ORDER}
    offenders = []
    for i, module in enumerate(STATE_DICT_ORDER):
        for dep in graph[f"{package}.{module}"]:
            if dep == package or (dep.startswith(package + ".") and dep.rpartition(".")[2] not in STATE_DICT_ORDER[:i]):
                offenders.append(f"{module} -> {dep}")
    assert not offenders, offenders


MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def test_no_file_over_500_lines_and_no_function_over_60():
    """In flashfsdp/ and benchmarks/: a file past 500 lines holds more than one concern, a
    function past 60 (its docstring included) more than one step; split them by job."""
    too_long = []
    for root in (PACKAGE, PACKAGE.parent / "benchmarks"):
        for path in sorted(root.rglob("*.py")):
            source = path.read_text()
            if source.count("\n") > MAX_FILE_LINES:
                too_long.append(f"{path.name}: {source.count(chr(10))} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.name}: {node.name}() {length} lines")
    assert not too_long, too_long
