"""Each backend provides every op the contract lists: the ops the NumPy reference registers."""
import ast
import importlib.util
from pathlib import Path

import pytest

from dptrain import backend

BACKEND_DIR = Path(backend.__file__).parent


def registered_in_source(device: str) -> set:
    """Names of the functions marked @op in dptrain/backend/<device>/ and its packages, read
    from the source (no import: the CUDA backend's contract is checked without CuPy too)."""
    names = set()
    for path in (BACKEND_DIR / device).rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    (d.func if isinstance(d, ast.Call) else d).id == "op"
                    for d in node.decorator_list
                    if isinstance(d.func if isinstance(d, ast.Call) else d, ast.Name)):
                names.add(node.name)
    return names


def test_both_backends_register_the_same_ops():
    assert registered_in_source("cpu") == set(backend.OPS)
    cuda_only = registered_in_source("cuda") - set(backend.OPS)
    cpu_only = set(backend.OPS) - registered_in_source("cuda")
    assert not cuda_only and not cpu_only, (cuda_only, cpu_only)


def test_an_op_registered_twice_is_an_error():
    from dptrain.backend import registry

    backend.get("cpu")  # its relu registered first, whatever ran before this test

    def relu(x):
        return x

    relu.__module__ = "dptrain.backend.cpu.extra"
    with pytest.raises(RuntimeError, match="op relu registered twice"):
        registry.op(relu)


def test_cpu_backend_implements_every_op():
    cpu = backend.get("cpu")
    missing = [name for name in backend.OPS if not callable(getattr(cpu, name, None))]
    assert not missing


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="CuPy not installed")
def test_cuda_backend_implements_every_op():
    import dptrain.backend.cuda as cuda

    missing = [name for name in backend.OPS if not callable(getattr(cuda, name, None))]
    assert not missing


def _missing_runtime_names(rt):
    """RUNTIME names the runtime object lacks (properties are looked up on the class, so no
    device is touched)."""
    return [name for name in backend.RUNTIME
            if not (hasattr(type(rt), name) or name in vars(rt))]


def test_cpu_runtime_implements_the_contract():
    assert not _missing_runtime_names(backend.get("cpu").runtime)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="CuPy not installed")
def test_cuda_runtime_implements_the_contract():
    import dptrain.backend.cuda as cuda

    assert not _missing_runtime_names(cuda.runtime)
    assert cuda.runtime.PRECISIONS == ("tf32", "fp32")
    assert type(cuda.new_workspace()).__name__ == "Workspace"


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        backend.get("tpu")
    with pytest.raises(ValueError, match="unknown device"):
        backend.resolve_device("tpu")


def test_auto_device_follows_gpu_availability(monkeypatch):
    monkeypatch.setattr(backend, "cuda_available", lambda: False)
    assert backend.resolve_device("auto") == "cpu"
    with pytest.raises(RuntimeError, match="--device cuda: no usable GPU"):
        backend.resolve_device("cuda")
    monkeypatch.setattr(backend, "cuda_available", lambda: True)
    assert backend.resolve_device("auto") == "cuda"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="CuPy not installed")
def test_both_backends_take_the_same_arguments():
    """Callers pass the same arguments whatever the device: every op's parameter names agree
    (CUDA may add keyword-only extras such as out=)."""
    import inspect

    import dptrain.backend.cuda as cuda

    cpu = backend.get("cpu")
    for name in backend.OPS:
        ours = inspect.signature(getattr(cpu, name)).parameters
        theirs = inspect.signature(getattr(cuda, name)).parameters
        missing = [p for p in ours if p not in theirs]
        assert not missing, f"cuda.{name} lacks {missing}"
