"""Launchers of kernels/optim.cu: SGD and AdamW steps over flat buffers, in place.

Conventions (the .cu file's header has the kernel side):
  * param, grad and state buffers are contiguous and of one length; they are updated in place
    (the `_` ops), so a shard of a flat buffer is updated by passing its slice.
  * Values that change from step to step live in the device array `hyper` (sgd: [lr];
    adamw: [lr, 1 - beta1**t, 1 - beta2**t]), so a captured CUDA graph reads the current
    ones. Slot 3 of `hyper` is the skip flag (set on the device by the non-finite check):
    non-zero leaves param and state untouched. Constant coefficients are cast to the element
    type on the host, rounded as the CPU backend rounds them (1 - beta1 computed in double,
    then cast).
  * `shadow=` (mixed precision): the 16-bit copy of the float32 param that the layers read,
    rewritten in the update's own pass (one launch and one read of the params fewer than a
    cast after it), with the cast's bits.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.registry import op

OPT = "optim.cu"


def _check_flat(op, param, *others):
    launch.check_float(op, param, *others)
    launch.check_contiguous(op, param, *others)
    for a in others:
        if a.size != param.size:
            raise ValueError(f"cuda.{op}: buffer of {a.size} elements, param has {param.size}")


def _shadow(op, param, shadow):
    """(kernel template arguments, pointer) of an optimizer kernel's `shadow`: none (null),
    or a 16-bit copy of a float32 param, of its length and contiguous."""
    if shadow is None:
        return (launch.ctype(param.dtype),), launch.NULL
    launch.check_contiguous(op, shadow)
    if shadow.dtype not in launch.HALVES or param.dtype != np.float32:
        raise TypeError(f"cuda.{op}: shadow must be float16 or bfloat16 of a float32 param, "
                        f"got {shadow.dtype} of {param.dtype}")
    if shadow.size != param.size:
        raise ValueError(f"cuda.{op}: shadow of {shadow.size} elements, param has {param.size}")
    return ("float", launch.ctype(shadow.dtype)), shadow


@op
def sgd_step_(param, grad, buf, hyper, momentum, weight_decay, nesterov, shadow=None):
    """PyTorch SGD: d = g + wd*p; buf = m*buf + d; d = d + m*buf (nesterov) or buf; p -= lr*d.
    `shadow`: a 16-bit copy of param, rewritten from the updated values in the same pass."""
    _check_flat("sgd_step_", param, grad, *([buf] if momentum else []))
    launch.check_float("sgd_step_", param, hyper)
    if hyper.size < 4:
        raise ValueError(f"cuda.sgd_step_: hyper needs 4 slots (lr, -, -, skip), has {hyper.size}")
    targs, out16 = _shadow("sgd_step_", param, shadow)
    if param.size:
        t = param.dtype.type
        launch.grid_stride(launch.kernel(OPT, "sgd_kernel", *targs), param.size,
                           (param, grad, buf if momentum else None, hyper, np.int64(param.size),
                            t(momentum), t(weight_decay), np.int32(bool(nesterov)), out16))
    return param


@op
def adamw_step_(param, grad, m, v, hyper, beta1, beta2, eps, weight_decay, shadow=None):
    """AdamW with decoupled weight decay; hyper = [lr, 1 - beta1**t, 1 - beta2**t].
    `shadow` as sgd_step_'s."""
    _check_flat("adamw_step_", param, grad, m, v)
    launch.check_float("adamw_step_", param, hyper)
    if hyper.size < 4:
        raise ValueError(f"cuda.adamw_step_: hyper needs 4 slots (lr, bc1, bc2, skip), has "
                         f"{hyper.size}")
    targs, out16 = _shadow("adamw_step_", param, shadow)
    if param.size:
        t = param.dtype.type
        launch.grid_stride(launch.kernel(OPT, "adamw_kernel", *targs), param.size,
                           (param, grad, m, v, hyper, np.int64(param.size), t(beta1),
                            t(1 - beta1), t(beta2), t(1 - beta2), t(eps), t(weight_decay),
                            out16))
    return param
