"""Sizes a reader can hold in their head, checked from the source.

No module under dptrain/ over MODULE_LIMIT lines, no function or method over FUNCTION_LIMIT
lines (measured with `ast`: end_lineno - lineno + 1, decorators not counted); README.md's and
BENCHMARKS.md's lengths are checked with the docs (tests/cli/test_docs.py). Today's offenders are named below with their current length and why
they are still there. The test fails when one of them grows past its recorded length, when a new
offender appears, and when a listed one is gone or back within the limit (then strike it from
the list, so the list stays honest).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LIMIT = 600
FUNCTION_LIMIT = 80

# module path -> (recorded lines, why it is still over)
MODULE_ALLOW = {
    "dptrain/bench/ops.py": (614, "bench, one table per op"),
    "dptrain/distributed/rendezvous.py": (628, "rendezvous, to be split"),
}

# "module path: qualified name" -> (recorded lines, why it is still over)
FUNCTION_ALLOW = {
    "dptrain/backend/cuda/gemm.py: _plan_matmul": (108, "planner, to be split"),
    "dptrain/bench/comm.py: main": (93, "bench, to be split"),
    "dptrain/bench/train.py: main": (123, "bench, to be split"),
    "dptrain/run/torch_twin.py: train_twin": (106, "twin, mirrors train()"),
}


def modules(root: Path):
    for path in sorted((root / "dptrain").rglob("*.py")):
        yield path.relative_to(root).as_posix(), path


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def function_lengths(path: Path):
    """(qualified name, lines) of every function and method, nested ones included."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    yield name, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(ast.parse(path.read_text(), str(path)), "")


def check(measured: dict, allow: dict, limit: int, what: str) -> list[str]:
    """Problems of `measured` (name -> lines, every item over `limit`) against `allow`."""
    found = []
    for name, lines in sorted(measured.items()):
        if name not in allow:
            found.append(f"{name}: a {what} of {lines} lines (limit {limit}); split it")
        elif lines > allow[name][0]:
            found.append(f"{name}: {lines} lines, past its recorded {allow[name][0]} "
                         f"({allow[name][1]}); shrink it, do not raise the record")
    for name in sorted(set(allow) - set(measured)):
        found.append(f"{name}: gone or within {limit} lines now; strike it from the allow-list")
    return found


def oversized(root: Path):
    """(modules, functions): name -> lines of each over its limit."""
    mods, funcs = {}, {}
    for rel, path in modules(root):
        if (n := line_count(path)) > MODULE_LIMIT:
            mods[rel] = n
        for name, n in function_lengths(path):
            if n > FUNCTION_LIMIT:
                funcs[f"{rel}: {name}"] = n
    return mods, funcs


def test_modules_within_limit():
    mods, _ = oversized(ROOT)
    assert not (found := check(mods, MODULE_ALLOW, MODULE_LIMIT, "module")), "\n".join(found)


def test_functions_within_limit():
    _, funcs = oversized(ROOT)
    assert not (found := check(funcs, FUNCTION_ALLOW, FUNCTION_LIMIT, "function")), "\n".join(found)


def test_checker_catches_growth_newcomers_and_stale_entries():
    allow = {"a.py": (700, "x"), "b.py": (650, "y"), "gone.py": (900, "z")}
    found = check({"a.py": 701, "b.py": 650, "new.py": 601}, allow, 600, "module")
    assert len(found) == 3
    assert "a.py: 701 lines, past its recorded 700" in found[0]
    assert found[1].startswith("new.py: a module of 601 lines")
    assert found[2].startswith("gone.py: gone or within")


def test_function_lengths_name_methods_and_nested_functions():
    import tempfile
    src = "class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.py"
        path.write_text(src)
        assert dict(function_lengths(path)) == {"A.m": 4, "A.m.inner": 2}
