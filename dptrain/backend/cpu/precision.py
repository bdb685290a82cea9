"""float16 operands of the NumPy reference's products and reductions (``@op(fp32_math=True)``,
and ops that call ``fp32_math`` on a helper of theirs): computed in float32 and rounded back
once, the reference of 16-bit kernels with fp32 accumulation (the package docstring)."""
import functools

import numpy as np


def fp32_math(fn):
    """`fn` computing in float32 when any operand is float16, its float results in float16."""
    def is_half(a):
        return getattr(a, "dtype", None) == np.float16

    def down(out):
        if isinstance(out, tuple):
            return tuple(down(o) for o in out)
        return out.astype(np.float16) if getattr(out, "dtype", None) == np.float32 else out

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not any(map(is_half, args)):
            return fn(*args, **kwargs)
        with np.errstate(over="ignore", invalid="ignore"):  # fp16 overflow steps are expected
            return down(fn(*(a.astype(np.float32) if is_half(a) else a for a in args),
                           **kwargs))
    return wrapper
