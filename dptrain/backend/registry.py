"""The array ops of each backend, registered where they are defined.

A backend module marks each op with ``@op``; the backend's package exports its table
(``table(device)``). Adding an op is then: its kernel, its launcher (``@op`` in
backend/cuda/), its NumPy reference (``@op`` in backend/cpu/), its Function in
dptrain.engine.ops; no list to extend. The CPU table is the contract (``dptrain.backend.OPS``):
the CUDA backend offers the same names with the same parameters
(tests/backend/test_backend_api.py).

``@op(fp32_math=True)`` marks a product or reduction whose NumPy reference must compute
float16 operands in float32 and round the result (the CPU backend applies it; our kernels
accumulate in fp32 anyway).
"""
from __future__ import annotations

_TABLES: dict[str, dict] = {}
_FP32_MATH: dict[str, set] = {}


def op(fn=None, *, fp32_math: bool = False):
    """Register `fn` under its name in the table of the backend whose package defines it."""
    def register(fn):
        parts = fn.__module__.split(".")  # dptrain.backend.<device>.<module>
        # (a module loaded under another name, as a test may, gets a table of its own)
        device = parts[2] if parts[:2] == ["dptrain", "backend"] and len(parts) > 2 else (
            fn.__module__)
        table = _TABLES.setdefault(device, {})
        known = table.get(fn.__name__)
        if known is not None and known.__module__ != fn.__module__:  # (a reload replaces)
            raise RuntimeError(f"backend {device}: op {fn.__name__} registered twice "
                               f"({table[fn.__name__].__module__} and {fn.__module__})")
        table[fn.__name__] = fn
        if fp32_math:
            _FP32_MATH.setdefault(device, set()).add(fn.__name__)
        return fn

    return register(fn) if fn is not None else register


def table(device: str) -> dict:
    """name -> function of every op the `device` backend registered (its modules imported)."""
    return dict(_TABLES.get(device, {}))


def fp32_math(device: str) -> set:
    """Names registered with ``fp32_math=True`` on `device`."""
    return set(_FP32_MATH.get(device, ()))
