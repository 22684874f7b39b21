"""Imports go one way: tools and train use the core; the core uses models and pallas_kernels; models and
pallas_kernels use neither jspec nor each other. Checked on the source (every import statement, including
those inside functions), so a lazy import cannot hide a wrong direction."""

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
