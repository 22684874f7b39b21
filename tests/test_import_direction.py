"""Imports go one way: tools and train use the core; the core uses models and pallas_kernels; models and
pallas_kernels use neither jspec nor each other. No chain of imports among the project's modules comes back to
where it started, and no module takes a private name from another. Checked on the source (every import statement,
including those inside functions), so a lazy import cannot hide a wrong direction or a circle."""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_files(package: str) -> list[str]:
    root = os.path.join(REPO, package)
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py"))


def imported_modules(path: str) -> set[str]:
    """Absolute module names a file imports (``from x import y`` yields x and x.y)."""
    tree = ast.parse(open(path).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(path: str) -> str:
    rel = os.path.relpath(path, REPO).replace(os.sep, "/")
    for prefix, layer in (("jspec/tools/", "tools"), ("jspec/train/", "train"), ("jspec/", "core"),
                          ("models/", "models"), ("pallas_kernels/", "pallas_kernels")):
        if rel.startswith(prefix):
            return layer
    raise AssertionError(rel)


FORBIDDEN = {
    "core": ("jspec.tools", "jspec.train"),
    "models": ("jspec", "pallas_kernels"),
    "pallas_kernels": ("jspec", "models"),
}


def test_every_package_file_has_a_layer():
    files = python_files("jspec") + python_files("models") + python_files("pallas_kernels")
    assert len(files) > 30
    assert {layer_of(f) for f in files} == {"tools", "train", "core", "models", "pallas_kernels"}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_go_one_way(layer):
    files = [f for f in python_files("jspec") + python_files("models") + python_files("pallas_kernels")
             if layer_of(f) == layer]
    wrong = {os.path.relpath(f, REPO): sorted(m for m in imported_modules(f)
                                              if any(under(m, bad) for bad in FORBIDDEN[layer]))
             for f in files}
    assert not {f: m for f, m in wrong.items() if m}, f"{layer} imports what it must not"


def test_the_checker_sees_a_lazy_import(tmp_path):
    """The walk finds an import inside a function body (the kind of import that hid the old tangle)."""
    path = tmp_path / "lazy.py"
    path.write_text("def f():\n    from jspec.tools.bundled import spec_for\n    return spec_for\n")
    assert "jspec.tools.bundled" in imported_modules(str(path))


def reads_environment(path: str) -> list[int]:
    """Line numbers where a file touches ``os.environ`` or calls ``getenv``."""
    tree = ast.parse(open(path).read(), path)
    return sorted({node.lineno for node in ast.walk(tree)
                   if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"))
                   or (isinstance(node, ast.Name) and node.id in ("environ", "getenv"))})


def test_the_library_never_reads_the_environment():
    """Knobs are arguments: only the tools (CLI, bench) and training jobs may read environment variables."""
    files = [f for f in python_files("jspec") + python_files("models") + python_files("pallas_kernels")
             if layer_of(f) in ("core", "models", "pallas_kernels")]
    found = {os.path.relpath(f, REPO): reads_environment(f) for f in files}
    assert not {f: lines for f, lines in found.items() if lines}


# --- no import circle -------------------------------------------------------------------------------------------

PACKAGES = ("jspec", "models", "pallas_kernels")


def module_name(path: str, root: str = REPO) -> str:
    """jspec/drafters/base.py -> jspec.drafters.base; a package's __init__.py -> the package."""
    parts = os.path.relpath(path, root).replace(os.sep, "/")[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: str = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Module name -> file, for every module of the packages under ``root``."""
    files = [os.path.join(d, f) for package in packages for d, _, names in os.walk(os.path.join(root, package))
             for f in names if f.endswith(".py")]
    return {module_name(f, root): f for f in sorted(files)}


def resolved_imports(path: str, name: str, modules: dict[str, str]) -> list[tuple[ast.stmt, str, str | None]]:
    """Each import in a file (module level, inside functions, under ``if TYPE_CHECKING``) as (statement, module,
    name): ``import x.y`` -> (x.y, None); ``from x import y`` -> (x.y, None) when x.y is a module, else (x, y);
    relative imports resolved against the file's package. Only modules of ``modules`` are kept."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name, None) for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x (level 1: the package), from ..y import x (level 2: its parent), ...
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.append((node, f"{base}.{alias.name}", None))
                elif base in modules:
                    found.append((node, base, alias.name))
    return found


def import_graph(modules: dict[str, str]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: the first line that does}, without a module's imports of itself."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for node, module, _ in sorted(resolved_imports(path, name, modules), key=lambda x: x[0].lineno):
            if module != name:
                edges.setdefault(module, node.lineno)
    return graph


def shortest_path(graph: dict[str, dict[str, int]], start: str, goal: str) -> list[str] | None:
    """The shortest import chain start -> ... -> goal (breadth first), or None."""
    came_from = {start: start}
    frontier = [start]
    while frontier and goal not in came_from:
        next_frontier = []
        for module in frontier:
            for imported in sorted(graph.get(module, ())):
                if imported not in came_from:
                    came_from[imported] = module
                    next_frontier.append(imported)
        frontier = next_frontier
    if goal not in came_from:
        return None
    path = [goal]
    while path[-1] != start:
        path.append(came_from[path[-1]])
    return path[::-1]


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """For every import that lies on a circle, the shortest circle through it (module names, the first repeated at
    the end, rotated to start at the smallest name); each circle once, sorted."""
    cycles = set()
    for module, imports in graph.items():
        for imported in imports:
            back = shortest_path(graph, imported, module)
            if back is not None:
                ring = [module] + back[:-1]
                k = ring.index(min(ring))
                cycles.add(tuple(ring[k:] + ring[:k] + [ring[k]]))
    return sorted(list(cycle) for cycle in cycles)


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_circle():
    """No chain of imports among the project's modules leads back to where it started, lazy imports included: a
    circle that a function-level import hides still means two modules each need the other."""
    graph = import_graph(project_modules())
    assert len(graph) > 30
    cycles = [describe_cycle(cycle, graph) for cycle in import_cycles(graph)]
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def write_package(root, files: dict[str, str]) -> dict[str, str]:
    """Writes ``files`` (relative path -> source) under ``root`` -> project_modules of them."""
    for rel, source in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(source)
    return project_modules(str(root), ("pkg",))


def test_the_cycle_checker_sees_a_lazy_circle(tmp_path):
    """A circle closed by a function-level relative import is found; so is one through a package's __init__."""
    modules = write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "def f():\n    from . import b\n    return b.g()\n",
        "pkg/b.py": "from pkg import a\n\ndef g():\n    return 1\n",
        "pkg/sub/__init__.py": "from pkg.sub.c import h\n",
        "pkg/sub/c.py": "import pkg.sub\nh = 1\n",
        "pkg/d.py": "from pkg.sub import h\nfrom .b import g\n",
    })
    graph = import_graph(modules)
    assert graph == {"pkg": {"pkg.a": 1}, "pkg.a": {"pkg.b": 2}, "pkg.b": {"pkg.a": 1}, "pkg.d": {"pkg.sub": 1,
                     "pkg.b": 2}, "pkg.sub": {"pkg.sub.c": 1}, "pkg.sub.c": {"pkg.sub": 1}}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.sub", "pkg.sub.c", "pkg.sub"]]
    assert import_cycles({"x": {"y": 1}, "y": {"z": 1}, "z": {}}) == []


# --- no private name crosses a module boundary ------------------------------------------------------------------

def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: str, name: str, modules: dict[str, str]) -> list[str]:
    """What a file takes from other project modules that they keep private (a name with a single leading
    underscore): ``from x import _f``, ``x._f`` on a name bound to project module x, and a private module
    (``x/_m.py``) reached from outside its own package. Each as "line: module.name"."""
    tree = ast.parse(open(path).read(), path)
    found, bound = [], {}  # bound: local name -> the project module it stands for

    def crosses(module: str, attr: str) -> bool:
        return module != name and is_private(attr)

    def private_module(module: str) -> str | None:
        """The first private component of ``module`` whose package ``name`` is not inside, or None."""
        parts = module.split(".")
        for i, part in enumerate(parts):
            if is_private(part) and not under(name, ".".join(parts[:i])):
                return ".".join(parts[:i + 1])
        return None

    for node, module, imported in resolved_imports(path, name, modules):
        outside = private_module(module)
        if outside is not None:
            found.append(f"{node.lineno}: {outside}")
        if imported is not None and crosses(module, imported):
            found.append(f"{node.lineno}: {module}.{imported}")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        else:
            for alias in node.names:
                if imported is None and module.endswith("." + alias.name):
                    bound[alias.asname or alias.name] = module

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            module = dotted(node.value)
            if module in modules and crosses(module, node.attr):
                found.append(f"{node.lineno}: {module}.{node.attr}")
    return sorted(set(found), key=lambda entry: int(entry.split(":")[0]))


def test_no_module_imports_a_private_name():
    """A helper two modules share is public in the module that owns its idea; an underscore means "this file
    only" (a private module: "this package only")."""
    modules = project_modules()
    found = {}
    for name, path in modules.items():
        rel = os.path.relpath(path, REPO)
        wrong = private_imports(path, name, modules)
        if wrong:
            found[rel] = wrong
    assert not found, "private names imported across modules"


def test_the_private_name_checker(tmp_path):
    """from-imports, attribute access on an imported module (plain, aliased, dotted), relative imports and private
    modules from outside their package are found; a module's own private names and dunders are not."""
    modules = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "_x = 1\n__version__ = '1'\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/_hidden.py": "y = 1\n",
        "pkg/sub/b.py": ("from pkg.a import _x, __version__\nfrom pkg import a\nimport pkg.a\nimport pkg.a as alias\n"
                         "def f():\n    from ..a import _x as y\n    return a._x + pkg.a._x + alias._x + y\n"
                         "from pkg.sub._hidden import y\nfrom . import _hidden\nself_ok = _x\n"),
        "pkg/c.py": "from pkg.sub._hidden import y\nfrom pkg.sub import _hidden\n_own = 1\nprint(_own, _hidden.y)\n",
    })
    found = {name: names for name, path in modules.items() if (names := private_imports(path, name, modules))}
    assert found == {"pkg.sub.b": ["1: pkg.a._x", "6: pkg.a._x", "7: pkg.a._x"],
                     "pkg.c": ["1: pkg.sub._hidden", "2: pkg.sub._hidden"]}
