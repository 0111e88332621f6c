"""The package's layout, read from the source with ast: imports flow one way through the
layers, no import circles, renderers load no torch, every module has a docstring and stays
small enough to hold one job.

Every import statement counts, those inside functions too, and so does
`importlib.import_module("memdoctor....")` with a literal name. A name taken from a package
whose `__init__` re-exports it lazily (a `_LAZY = {name: submodule}` table read by its
`__getattr__`) counts as an import of the submodule that defines it; the `__init__`'s own
`import_module(f"...{_LAZY[name]}")` is not followed, since its target is a variable.
"""
from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = ROOT / "memdoctor"

# bottom to top: a module may import its own layer and those below it, never one above
LAYERS = [
    ("run, units", ("memdoctor.run", "memdoctor.units", "memdoctor.version", "memdoctor.limits",
                    "memdoctor.sanitize", "memdoctor.runcheck", "memdoctor.collector")),
    ("cuda", ("memdoctor.cuda",)),
    ("capture, attribution", ("memdoctor.capture", "memdoctor.attribution")),
    ("diagnosis, predict, remedies", ("memdoctor.diagnosis", "memdoctor.predict", "memdoctor.remedies")),
    ("report", ("memdoctor.report",)),
    ("tui, cli, watching, integrations, memdoctor", ("memdoctor.tui", "memdoctor.cli", "memdoctor.watching",
                                                      "memdoctor.integrations", "memdoctor.__main__", "memdoctor")),
]
MAX_LINES = 800
MAX_LINES_UNEXPLAINED = 600
ONE_MODULE = re.compile(r"^\s*one module\b", re.IGNORECASE | re.MULTILINE)   # "One module because ..."


@dataclass(frozen=True)
class Import:
    target: str         # a memdoctor module, or the top-level name of another package
    line: int
    eager: bool         # runs when the module is imported (not inside a function or TYPE_CHECKING)


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int
    imports: list[Import] = field(default_factory=list)


def _name_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    """A package `__init__`'s `_LAZY = {"name": "submodule", ...}`, or {}."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


class _ImportVisitor(ast.NodeVisitor):
    """Every import of one module: (dotted name, imported names, level, line, eager)."""

    def __init__(self) -> None:
        self.found: list[tuple[str, list[str], int, int, bool]] = []
        self._deferred = 0

    def _defer(self, node) -> None:
        self._deferred += 1
        self.generic_visit(node)
        self._deferred -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _defer

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self._deferred += 1
            for stmt in node.body:
                self.visit(stmt)
            self._deferred -= 1
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, [], 0, node.lineno, not self._deferred))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node.module or "", [a.name for a in node.names], node.level, node.lineno,
                           not self._deferred))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if (called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            self.found.append((node.args[0].value, [], 0, node.lineno, not self._deferred))
        self.generic_visit(node)


@functools.cache
def modules() -> dict[str, Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found[_name_of(path)] = Module(_name_of(path), path, ast.parse(text, str(path)), len(text.splitlines()))
    lazy = {name: _lazy_table(m.tree) for name, m in found.items() if m.path.name == "__init__.py"}
    for m in found.values():
        visitor = _ImportVisitor()
        visitor.visit(m.tree)
        for dotted, names, level, line, eager in visitor.found:
            for target in _resolve(m, dotted, names, level, found, lazy):
                m.imports.append(Import(target, line, eager))
    return found


def _resolve(m: Module, dotted: str, names: list[str], level: int, found: dict, lazy: dict) -> list[str]:
    """The modules an import statement loads: a memdoctor module's full name, else the
    top-level name of the other package."""
    if level:
        package = m.name.split(".") if m.path.name == "__init__.py" else m.name.split(".")[:-1]
        base = ".".join(package[:len(package) - (level - 1)] + ([dotted] if dotted else []))
    else:
        base = dotted
    if base.split(".")[0] != "memdoctor":
        return [base.split(".")[0]]
    if not names:
        return [base]
    targets = []
    for name in names:
        if f"{base}.{name}" in found:
            targets.append(f"{base}.{name}")
        elif name in lazy.get(base, {}):
            targets.append(f"{base}.{lazy[base][name]}")
        else:
            targets.append(base)
    return targets


def layer_of(name: str) -> int | None:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix or (prefix != "memdoctor" and name.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def _rel(m: Module) -> str:
    return str(m.path.relative_to(ROOT))


def _edges() -> dict[str, set[str]]:
    mods = modules()
    return {name: {i.target for i in m.imports if i.target in mods and i.target != name}
            for name, m in mods.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one
    circle through all of them where there is one, else its members."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_circle(c, edges) for c in components]


def _circle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


# ----------------------------------------------------------------------------- the tests
def test_the_walk_finds_the_package_and_its_imports():
    mods = modules()
    assert "memdoctor.run" in mods and "memdoctor.remedies.step" in mods
    # a lazy re-export resolves to the defining module; a function-level import counts, deferred
    assert any(i.target == "memdoctor.remedies.plan" for i in mods["memdoctor.remedies"].imports)
    watch = [i for i in mods["memdoctor"].imports if i.target == "memdoctor.watching"]
    assert watch and not any(i.eager for i in watch)


def test_the_guards_resolve_relative_imports_and_see_a_circle():
    mods = modules()
    hooks = Module("memdoctor.capture.hooks", PACKAGE / "capture" / "hooks.py", ast.Module([], []), 0)
    package = Module("memdoctor.capture", PACKAGE / "capture" / "__init__.py", ast.Module([], []), 0)
    assert _resolve(hooks, "recorder", ["Recorder"], 1, mods, {}) == ["memdoctor.capture.recorder"]
    assert _resolve(hooks, "", ["run"], 2, mods, {}) == ["memdoctor.run"]
    assert _resolve(package, "", ["session"], 1, mods, {}) == ["memdoctor.capture.session"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_every_module_has_a_layer():
    missing = [_rel(m) for name, m in modules().items() if layer_of(name) is None]
    assert not missing, f"modules outside LAYERS (give each a layer in tests/test_layout.py): {missing}"


def test_no_upward_import():
    """cuda/, run.py, units.py and capture/ never import diagnosis, predict, remedies,
    report, tui, cli, watching or memdoctor's __init__, and cuda/ nothing of capture/; in
    general no module imports a layer above its own."""
    mods = modules()
    bad = []
    for name, m in mods.items():
        mine = layer_of(name)
        if mine is None:
            continue
        for i in m.imports:
            theirs = layer_of(i.target) if i.target in mods else None
            if theirs is not None and theirs > mine:
                bad.append(f"{_rel(m)}:{i.line} ({LAYERS[mine][0]}) imports {i.target} ({LAYERS[theirs][0]})")
    assert not bad, "imports up the layers:\n  " + "\n  ".join(bad)


def test_no_import_circle():
    circles = _cycles(_edges())
    assert not circles, "import circles:\n  " + "\n  ".join(" -> ".join(c) for c in circles)


def _eager_closure(start: str) -> dict[str, list[str]]:
    """Every module importing `start` runs (its eager imports, their parent packages, and so
    on), each with the chain that leads to it; other packages by their top-level name."""
    mods = modules()
    chains = {start: [start]}
    queue = [start]
    while queue:
        name = queue.pop(0)
        parts = name.split(".")
        nexts = [".".join(parts[:k]) for k in range(1, len(parts))]          # parent packages run first
        nexts += [i.target for i in mods[name].imports if i.eager] if name in mods else []
        for target in nexts:
            if target not in chains:
                chains[target] = chains[name] + [target]
                if target in mods:
                    queue.append(target)
    return chains


def test_renderers_do_not_import_torch_at_module_level():
    bad = []
    for name in sorted(n for n in modules() if n == "memdoctor.report" or n.startswith("memdoctor.report.")):
        chain = _eager_closure(name).get("torch")
        if chain:
            bad.append(" -> ".join(chain))
    assert not bad, "report/ loads torch on import:\n  " + "\n  ".join(bad)


def test_every_module_has_a_docstring():
    missing = [_rel(m) for m in modules().values() if not (ast.get_docstring(m.tree) or "").strip()]
    assert not missing, f"modules without a docstring saying their one job: {missing}"


def test_modules_stay_small():
    bad = []
    for m in modules().values():
        doc = ast.get_docstring(m.tree) or ""
        if m.lines > MAX_LINES:
            bad.append(f"{_rel(m)}: {m.lines} lines (at most {MAX_LINES})")
        elif m.lines > MAX_LINES_UNEXPLAINED and not ONE_MODULE.search(doc):
            bad.append(f"{_rel(m)}: {m.lines} lines, over {MAX_LINES_UNEXPLAINED} without a docstring line "
                       "'One module because ...' saying why it cannot be split")
    assert not bad, "modules too long:\n  " + "\n  ".join(sorted(bad))
