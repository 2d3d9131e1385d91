"""The codebase's layout keeps its promises (issue 21): small modules, one seam per device, no import
cycle, dependencies pointing one way (server -> scheduler -> runtime, bench apart), and nothing that
refers outside the repository. Each test walks the whole tree and names every offender."""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()
MAX_MODULE_LINES = 400

# Where asking which device this is belongs (DESIGN.md: one seam per device); tests may ask too.
DEVICE_SEAM = ("runtime/cpu/", "runtime/cuda/", "runtime/platform.py", "tests/")
# Text that points outside the repository: notes beside the checkout, the machine's own paths.
OUTSIDE_REFERENCES = ("FACTS.md", "../shared", "/work/")

# Import kinds (see ``_imports``). A cycle through an import inside a function, or one only for type
# checkers, is still a cycle between the two modules' jobs: every kind counts.
CYCLE_KINDS = frozenset({"module", "function", "type_checking"})
# Layering counts every import: a type a lower layer names still ties it to the upper one.
LAYER_KINDS = frozenset({"module", "function", "type_checking"})


def _package_dirs() -> dict[str, str]:
    """pyproject's package-dir: folder -> the package it installs as (``runtime`` -> ``servelm.runtime``)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {folder: package for package, folder in config["tool"]["setuptools"]["package-dir"].items()}


def _project_files() -> list[str]:
    """Every file git tracks or would track (not ignored), as repository-relative POSIX paths."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (REPO / p).is_file()})


def _package_modules() -> dict[str, str]:
    """Dotted module name (``servelm.runtime.sampler``) -> path, for every module of the package."""
    dirs = _package_dirs()
    modules: dict[str, str] = {}
    for path in _project_files():
        folder, _, rest = path.partition("/")
        if folder not in dirs or not path.endswith(".py"):
            continue
        parts = rest[: -len(".py")].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join([dirs[folder], *parts])] = path
    return modules


@dataclass(frozen=True)
class Import:
    """One import statement's target module, and where it runs."""

    target: str  # dotted name as written, resolved against relative levels
    names: tuple[str, ...]  # ``from target import names`` ('' for a plain ``import target``)
    kind: str  # "module", "function" (inside a def) or "type_checking" (under ``if TYPE_CHECKING:``)
    line: int


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: str) -> Iterator[Import]:
    """Every import of a module's source, each with the kind of place it sits in."""
    tree = ast.parse((REPO / path).read_text(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]

    def visit(node: ast.AST, kind: str) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(alias.name, ("",), kind, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                yield Import(base, tuple(a.name for a in child.names), kind, child.lineno)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "type_checking")
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, "type_checking" if kind == "type_checking" else "function")
            else:
                yield from visit(child, kind)

    yield from visit(tree, "module")


def _targets(imp: Import, modules: dict[str, str]) -> set[str]:
    """The package's modules an import names: ``from a import b`` is a.b where that is a module, else a."""
    out: set[str] = set()
    for name in imp.names:
        dotted = f"{imp.target}.{name}" if name else imp.target
        # ``import a.b.c`` and ``from a.b import c`` (c a function): the longest prefix that is a module.
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            candidate = ".".join(parts[:n])
            if candidate in modules:
                out.add(candidate)
                break
    return out


def _graph(kinds: frozenset[str]) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}, over ``kinds``."""
    modules = _package_modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for imp in _imports(module, path):
            if imp.kind in kinds:
                for target in _targets(imp, modules) - {module}:
                    graph[module].setdefault(target, imp.line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found, key=lambda c: (-len(c), c))


def _describe_cycle(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    modules = _package_modules()
    edges = [
        f"    {modules[a]}:{line} imports {b}"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in component
    ]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def test_no_module_is_over_400_lines() -> None:
    dirs = _package_dirs()
    offenders = []
    for path in _project_files():
        if path.split("/")[0] in dirs and path.endswith(".py"):
            n = len((REPO / path).read_text().splitlines())
            if n > MAX_MODULE_LINES:
                offenders.append(f"{path}: {n} lines")
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(offenders)


def test_only_the_device_seam_asks_which_device_this_is() -> None:
    offenders = []
    for path in _project_files():
        if not path.endswith(".py") or path.startswith(DEVICE_SEAM):
            continue
        for n, line in enumerate((REPO / path).read_text().splitlines(), 1):
            if "device.type" in line:
                offenders.append(f"{path}:{n}: {line.strip()}")
    assert not offenders, "device.type outside runtime/platform.py, runtime/cpu/, runtime/cuda/:\n" + "\n".join(
        offenders
    )


def test_no_import_cycle_between_modules() -> None:
    graph = _graph(CYCLE_KINDS)
    cycles = _cycles(graph)
    assert not cycles, "import cycles (module-level, function-level and type-checking imports):\n" + "\n".join(
        _describe_cycle(c, graph) for c in cycles
    )


# The devices' packages, and the one module outside them that may import them: the seam that says
# which platform runs (it imports each platform inside a function, when first asked).
DEVICE_PACKAGES = ("servelm.runtime.cpu", "servelm.runtime.cuda")
PLATFORM_SEAM = "servelm.runtime.platform"


def test_only_the_platform_seam_imports_the_device_packages() -> None:
    # Every kind of import counts (module, function and type-checking level): a device's code reaches
    # the rest only through its Platform (runtime/platform_interface.py), never by name.
    offenders = []
    for module, path in sorted(_package_modules().items()):
        if module == PLATFORM_SEAM or any(_within(module, d) for d in DEVICE_PACKAGES):
            continue
        for imp in _imports(module, path):
            if any(_within(imp.target, d) for d in DEVICE_PACKAGES):
                offenders.append(f"{path}:{imp.line} ({imp.kind}): {imp.target} {', '.join(n for n in imp.names if n)}")
    assert not offenders, "device packages imported outside them and runtime/platform.py:\n" + "\n".join(offenders)


# (importing package, imported package): DESIGN.md's server -> scheduler -> runtime, bench apart.
FORBIDDEN_DEPENDENCIES = [
    ("servelm.runtime", "servelm.scheduler"),
    ("servelm.runtime", "servelm.server"),
    ("servelm.scheduler", "servelm.server"),
    ("servelm.server", "servelm.bench"),
    ("servelm.scheduler", "servelm.bench"),
    ("servelm.runtime", "servelm.bench"),
]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_dependencies_point_one_way() -> None:
    modules = _package_modules()
    offenders = []
    for module, path in sorted(modules.items()):
        for imp in _imports(module, path):
            if imp.kind not in LAYER_KINDS:
                continue
            for lower, upper in FORBIDDEN_DEPENDENCIES:
                if _within(module, lower) and _within(imp.target, upper):
                    what = imp.target + (f" ({', '.join(imp.names)})" if imp.names != ("",) else "")
                    offenders.append(f"{path}:{imp.line} ({imp.kind}): {lower} imports {what}")
    assert not offenders, "imports against server -> scheduler -> runtime (bench apart):\n" + "\n".join(offenders)


def test_nothing_refers_outside_the_repository() -> None:
    offenders = []
    for path in _project_files():
        if path == THIS_FILE:
            continue
        try:
            text = (REPO / path).read_text()
        except UnicodeDecodeError:
            continue  # binary: no text to point anywhere
        for n, line in enumerate(text.splitlines(), 1):
            for needle in OUTSIDE_REFERENCES:
                if needle in line:
                    offenders.append(f"{path}:{n}: {needle!r} in {line.strip()[:120]}")
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)
