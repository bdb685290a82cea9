"""The layering of dptrain's packages, checked from the source's import statements.

Each package may import only the packages listed for it (lower layers); the README's Layout
section draws the same picture. Lazy imports inside functions count too. Three more rules:
nothing outside dptrain/backend/ imports CuPy, no package of the product imports
dptrain.bench (the `bench` command is loaded by name, by the dispatcher), and the face's
helpers, which every layer imports, import only the standard library.
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACE = {"errors", "fileio", "switches"}  # the package face's helpers: any layer may use them

# package -> the packages it may import (besides itself and FACE), lowest layer first
ALLOWED = {
    "backend": set(),
    "engine": {"backend"},
    "nn": {"backend", "engine"},
    "distributed": {"backend", "engine"},
    "optim": {"backend", "engine", "distributed"},
    "data": {"backend", "distributed"},
    "checkpoints": {"backend", "engine", "nn", "distributed", "optim", "data"},
    "run": {"backend", "engine", "nn", "distributed", "optim", "data", "checkpoints"},
    "cli": {"backend", "engine", "nn", "distributed", "optim", "data", "checkpoints", "run"},
    "bench": {"backend", "engine", "nn", "distributed", "optim", "data", "checkpoints", "run", "cli"},
}
TOP_LEVEL = {"__init__", "__main__"} | FACE  # the only modules beside the packages


def imported_modules(path: Path):
    """(line, module) of every absolute import in a file, functions' bodies included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            if node.module == "dptrain":  # from dptrain import nn: the package nn
                for alias in node.names:
                    yield node.lineno, f"dptrain.{alias.name}"


def violations(root: Path) -> list[str]:
    found = []
    package_dir = root / "dptrain"
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir)
        owner = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        where = f"dptrain/{rel.as_posix()}"
        if owner not in ALLOWED and owner not in TOP_LEVEL:
            found.append(f"{where}: a module at the top of dptrain/ that is neither a package "
                         f"nor the face ({', '.join(sorted(TOP_LEVEL))})")
            continue
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "cupy" and owner != "backend":
                found.append(f"{where}:{line}: imports CuPy outside dptrain/backend/")
            if owner in FACE and parts[0] not in sys.stdlib_module_names:
                found.append(f"{where}:{line}: a face helper imports {module}, not the "
                             f"standard library")
                continue
            if parts[0] != "dptrain" or len(parts) < 2:
                continue
            target = parts[1]
            if target == owner or target in FACE or target == "__version__":
                continue
            if owner in TOP_LEVEL:  # the face re-exports the engine and the library API
                if target in {"engine", "cli", "run", "data"}:  # (run, data: lazily)
                    continue
            elif target in ALLOWED.get(owner, set()):
                continue
            found.append(f"{where}:{line}: {owner} may not import dptrain.{target}")
    return found


def test_packages_import_only_lower_layers():
    assert violations(ROOT) == []


def test_the_check_catches_a_forbidden_import(tmp_path):
    """The rules bite: an engine module that imports the loop, a layer importing CuPy, the
    loop importing a benchmark, a face helper importing NumPy and a loose module at the top
    are each reported."""
    pkg = tmp_path / "dptrain"
    for sub in ("engine", "nn", "run"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "engine" / "ops.py").write_text("def f():\n    from dptrain.run import train\n")
    (pkg / "nn" / "layers.py").write_text("import cupy\nfrom dptrain import engine\n")
    (pkg / "run" / "loop.py").write_text("import dptrain.bench.train\n")
    (pkg / "helpers.py").write_text("")
    (pkg / "switches.py").write_text("import os\nimport numpy\n")
    found = violations(tmp_path)
    assert found == [
        "dptrain/engine/ops.py:2: engine may not import dptrain.run",
        "dptrain/helpers.py: a module at the top of dptrain/ that is neither a package nor "
        "the face (__init__, __main__, errors, fileio, switches)",
        "dptrain/nn/layers.py:1: imports CuPy outside dptrain/backend/",
        "dptrain/run/loop.py:1: run may not import dptrain.bench",
        "dptrain/switches.py:2: a face helper imports numpy, not the standard library",
    ]


def test_tests_mirror_the_packages():
    """Test files live in folders named after what they test, helpers in one place; the
    whole-tree checks (layers, sizes) sit loose beside conftest.py."""
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name[0] != "_"
               and p.name != "__pycache__"}
    assert folders <= set(ALLOWED) | {"models", "studies", "helpers"}, folders
    loose = {p.name for p in (ROOT / "tests").glob("*.py")}
    assert loose == {"conftest.py", "test_architecture.py", "test_sizes.py"}, loose
