"""The NumPy backend: the reference every other backend is tested against.

The array ops (one function per name in ``dptrain.backend.OPS``) live in ``ops``, ``conv``
(convolution and pooling) and ``norm`` (batch normalisation); ``workspace`` holds the memory
and work that a caller lets ops reuse between calls (``new_workspace()``); ``runtime`` is
the trivial runtime of a device that is the host itself. No op keeps state of its own
between calls.

16-bit floats: NumPy computes float16 elementwise ops in float and rounds each result, which
is what a 16-bit kernel does. The products and reductions below (``_FP32_MATH``) would
otherwise run without BLAS and accumulate in 16 bits, so they take float32 copies of float16
operands and round their results back: the reference of 16-bit kernels with fp32
accumulation.
"""
import functools as _functools

import numpy as _np

from dptrain.backend.cpu.ops import *  # noqa: F401,F403 - the array ops, by name
from dptrain.backend.cpu.ops import name  # noqa: F401
from dptrain.backend.cpu.conv import (  # noqa: F401
    avg_pool2d_backward,
    avg_pool2d_forward,
    conv2d_backward_data,
    conv2d_backward_weight,
    conv2d_forward,
    max_pool2d_backward,
    max_pool2d_forward,
    relu_max_pool2d_forward,
)
from dptrain.backend.cpu.attention import (  # noqa: F401
    gelu,
    gelu_backward,
    layer_norm_backward,
    layer_norm_forward,
    masked_softmax,
    masked_softmax_backward,
)
from dptrain.backend.cpu.norm import (  # noqa: F401
    batch_norm_backward_data,
    batch_norm_backward_reduce,
    batch_norm_forward,
    batch_norm_mean,
    batch_norm_update_,
    batch_norm_var,
)
from dptrain.backend.cpu.workspace import Workspace, new_workspace  # noqa: F401
from dptrain.backend.cpu.runtime import runtime  # noqa: F401


_FP32_MATH = ("matmul", "bias_grad", "sum", "conv2d_forward", "conv2d_backward_data",
              "conv2d_backward_weight", "avg_pool2d_forward", "avg_pool2d_backward", "softmax",
              "softmax_backward", "log_softmax", "log_softmax_backward",
              "cross_entropy_forward", "cross_entropy_backward")


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


for _name in _FP32_MATH:
    globals()[_name] = _fp32_math(globals()[_name])
