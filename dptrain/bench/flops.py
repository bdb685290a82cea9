"""Arithmetic of a training step, counted from the shapes of a model's matrix ops.

``training_flops_per_image(name, image_shape, classes)`` runs one forward pass of a batch of
one image through a CPU copy of the model while counting the FLOPs of every convolution and
matrix product it issues (2 per multiply-add: conv2d_forward from its output and weight
shapes, matmul from its output shape and inner dimension), and returns three times that:
a training step runs the forward, the gradient of the input of every layer and the gradient
of every weight, each of the forward's size. (The first layer needs no input gradient, so
3x overcounts it by one forward of that layer; elementwise ops, pooling and the optimizer
are left out: they are memory traffic, not tensor-core work.) Models whose layers all issue
these two ops (conv, linear, attention products) are counted alike.

For the reference CNN at 48x48x1: forward 46.16 MFLOP (conv 1.33 + 21.23 + 21.23, FC 2.36
+ 0.004), training step 138.5 MFLOP per image.
"""
from __future__ import annotations

import contextlib

import numpy as np

TRAINING_FACTOR = 3  # forward + input gradient + weight gradient


@contextlib.contextmanager
def counting(be):
    """Within the block, the FLOPs of `be`'s conv2d_forward, matmul and linear calls add up in
    the returned dict's "flops" (and per op under "conv2d_forward" / "matmul", linear's
    products counted as matmul's)."""
    counts = {"flops": 0, "conv2d_forward": 0, "matmul": 0}
    conv, matmul, linear = be.conv2d_forward, be.matmul, be.linear

    def add(op, n):
        counts[op] += n
        counts["flops"] += n

    def conv_counted(x, w, *args, **kwargs):
        y = conv(x, w, *args, **kwargs)
        add("conv2d_forward", 2 * int(np.prod(y.shape)) * int(np.prod(w.shape[1:])))
        return y

    def matmul_counted(a, b, trans_a=False, trans_b=False, **kwargs):
        y = matmul(a, b, trans_a, trans_b, **kwargs)
        add("matmul", 2 * int(np.prod(y.shape)) * (a.shape[-2] if trans_a else a.shape[-1]))
        return y

    def linear_counted(x, w, *args, **kwargs):
        y = linear(x, w, *args, **kwargs)
        add("matmul", 2 * int(np.prod(y.shape)) * x.shape[-1])
        return y

    be.conv2d_forward, be.matmul, be.linear = conv_counted, matmul_counted, linear_counted
    try:
        yield counts
    finally:
        be.conv2d_forward, be.matmul, be.linear = conv, matmul, linear


def forward_flops_per_image(model_name: str, image_shape, num_classes: int) -> dict:
    """{"flops", "conv2d_forward", "matmul"} of one forward pass, per image."""
    from dptrain import backend
    from dptrain.engine.autograd import Tensor, no_grad
    from dptrain.nn import build_model

    be = backend.get("cpu")
    model = build_model(model_name, tuple(image_shape), num_classes)
    model.eval()
    x = Tensor(np.zeros((1, *image_shape), dtype=np.float32))
    with no_grad(), counting(be) as counts:
        model(x)
    return counts


def training_flops_per_image(model_name: str, image_shape, num_classes: int) -> int:
    """FLOPs of one training step per image: 3x the forward's conv and matmul FLOPs."""
    return TRAINING_FACTOR * forward_flops_per_image(model_name, image_shape, num_classes)["flops"]
