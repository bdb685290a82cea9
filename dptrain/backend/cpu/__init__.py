"""The NumPy backend: the reference every other backend is tested against.

The array ops (each marked ``@op`` where it is defined) live in ``ops``, ``conv`` (convolution
and pooling), ``norm`` (batch normalisation) and ``attention`` (layer norm, GELU, masked
softmax, fused attention); ``workspace`` holds the memory and work that a caller lets ops
reuse between calls (``new_workspace()``); ``runtime`` is the trivial runtime of a device
that is the host itself. No op keeps state of its own between calls.

16-bit floats: NumPy computes float16 elementwise ops in float and rounds each result, which
is what a 16-bit kernel does. The products and reductions (marked ``@op(fp32_math=True)``)
would otherwise run without BLAS and accumulate in 16 bits, so they take float32 copies of
float16 operands and round their results back: the reference of 16-bit kernels with fp32
accumulation.
"""
import functools as _functools

import numpy as _np

from dptrain.backend import registry as _registry
from dptrain.backend.cpu import (  # noqa: F401  (register)
    attention, augment, conv, norm, ops, workspace)
from dptrain.backend.cpu.ops import name  # noqa: F401
from dptrain.backend.cpu.workspace import Workspace  # noqa: F401
from dptrain.backend.cpu.runtime import runtime  # noqa: F401


def _fp32_math(fn):
    """`fn` computing in float32 when any operand is float16, its float results in float16."""
    def is_half(a):
        return getattr(a, "dtype", None) == _np.float16

    def down(out):
        if isinstance(out, tuple):
            return tuple(down(o) for o in out)
        return out.astype(_np.float16) if getattr(out, "dtype", None) == _np.float32 else out

    @_functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not any(map(is_half, args)):
            return fn(*args, **kwargs)
        with _np.errstate(over="ignore", invalid="ignore"):  # fp16 overflow steps are expected
            return down(fn(*(a.astype(_np.float32) if is_half(a) else a for a in args),
                           **kwargs))
    return wrapper


# The package's names are the registered ops, the products and reductions among them
# (``@op(fp32_math=True)``) wrapped as above; calls inside the modules stay unwrapped.
for _name, _fn in _registry.table(name).items():
    globals()[_name] = _fp32_math(_fn) if _name in _registry.fp32_math(name) else _fn
OPS = tuple(_registry.table(name))  # the contract: what every backend offers
