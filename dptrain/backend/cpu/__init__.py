"""The NumPy backend: the reference every other backend is tested against.

The array ops (each marked ``@op`` where it is defined) live in ``ops``, ``conv`` (convolution
and pooling), ``norm`` (batch normalisation) and ``attention`` (layer norm, GELU, masked
softmax, fused attention); ``workspace`` holds the memory and work that a caller lets ops
reuse between calls (``new_workspace()``); ``runtime`` is the trivial runtime of a device
that is the host itself. No op keeps state of its own between calls.

16-bit floats: NumPy computes float16 elementwise ops in float and rounds each result, which
is what a 16-bit kernel does. The products and reductions (marked ``@op(fp32_math=True)``)
would otherwise run without BLAS and accumulate in 16 bits, so they take float32 copies of
float16 operands and round their results back (``precision.fp32_math``): the reference of
16-bit kernels with fp32 accumulation.
"""
from dptrain.backend import registry as _registry
from dptrain.backend.cpu import (  # noqa: F401  (register)
    attention, augment, conv, norm, ops, workspace)
from dptrain.backend.cpu.ops import name  # noqa: F401
from dptrain.backend.cpu.precision import fp32_math as _fp32_math
from dptrain.backend.cpu.workspace import Workspace  # noqa: F401
from dptrain.backend.cpu.runtime import runtime  # noqa: F401


# The package's names are the registered ops, the products and reductions among them
# (``@op(fp32_math=True)``) wrapped by precision.fp32_math; calls inside the modules stay
# unwrapped.
for _name, _fn in _registry.table(name).items():
    globals()[_name] = _fp32_math(_fn) if _name in _registry.fp32_math(name) else _fn
OPS = tuple(_registry.table(name))  # the contract: what every backend offers
