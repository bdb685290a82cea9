"""Launchers of kernels/optim.cu: SGD and AdamW steps over flat buffers, in place.

Conventions (the .cu file's header has the kernel side):
  * param, grad and state buffers are contiguous and of one length; they are updated in place
    (the `_` ops), so a shard of a flat buffer is updated by passing its slice.
  * Values that change from step to step live in the device array `hyper` (sgd: [lr];
    adamw: [lr, 1 - beta1**t, 1 - beta2**t]), so a captured CUDA graph reads the current
    ones. Slot 3 of `hyper` is the skip flag (set on the device by the non-finite check):
    non-zero leaves param and state untouched. Constant coefficients are cast to the element type on the host, rounded as the
    CPU backend rounds them (1 - beta1 computed in double, then cast).
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


@op
def sgd_step_(param, grad, buf, hyper, momentum, weight_decay, nesterov):
    """PyTorch SGD: d = g + wd*p; buf = m*buf + d; d = d + m*buf (nesterov) or buf; p -= lr*d."""
    _check_flat("sgd_step_", param, grad, *([buf] if momentum else []))
    launch.check_float("sgd_step_", param, hyper)
    if hyper.size < 4:
        raise ValueError(f"cuda.sgd_step_: hyper needs 4 slots (lr, -, -, skip), has {hyper.size}")
    if param.size:
        t = param.dtype.type
        launch.grid_stride(launch.kernel(OPT, "sgd_kernel", launch.ctype(param.dtype)),
                           param.size,
                           (param, grad, buf if momentum else None, hyper, np.int64(param.size),
                            t(momentum), t(weight_decay), np.int32(bool(nesterov))))
    return param


@op
def adamw_step_(param, grad, m, v, hyper, beta1, beta2, eps, weight_decay):
    """AdamW with decoupled weight decay; hyper = [lr, 1 - beta1**t, 1 - beta2**t]."""
    _check_flat("adamw_step_", param, grad, m, v)
    launch.check_float("adamw_step_", param, hyper)
    if hyper.size < 4:
        raise ValueError(f"cuda.adamw_step_: hyper needs 4 slots (lr, bc1, bc2, skip), has "
                         f"{hyper.size}")
    if param.size:
        t = param.dtype.type
        launch.grid_stride(launch.kernel(OPT, "adamw_kernel", launch.ctype(param.dtype)),
                           param.size,
                           (param, grad, m, v, hyper, np.int64(param.size), t(beta1),
                            t(1 - beta1), t(beta2), t(1 - beta2), t(eps), t(weight_decay)))
    return param
