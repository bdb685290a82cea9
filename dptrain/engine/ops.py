"""Differentiable primitives: one Function per op, forward and backward side by side.

Every op works on raw backend arrays through ``self.be`` and never looks at the
device. Inputs that broadcast get their gradient summed back to their own shape.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.spread import Spread
from dptrain.engine.autograd import Function, GradSum, is_grad_enabled, total
from dptrain.engine.rng import data_shard

# A strided 1x1 convolution's backward-data may come as a Spread, its zeros never written
# where a channels-last batch norm's joined sums read it (False: always the array, to compare)
SPREAD_LATER = True

# ----------------------------------------------------------------------------- elementwise


class Add(Function):
    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        return self.be.add(a, b)

    def backward(self, gy):
        sa, sb = self.shapes
        return self.be.sum_to_shape(gy, sa), self.be.sum_to_shape(gy, sb)


class Sub(Function):
    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        return self.be.sub(a, b)

    def backward(self, gy):
        sa, sb = self.shapes
        gb = self.be.sum_to_shape(self.be.neg(gy), sb) if self.needs_grad[1] else None
        return self.be.sum_to_shape(gy, sa), gb


class Mul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return self.be.mul(a, b)

    def backward(self, gy):
        be, a, b = self.be, self.a, self.b
        ga = be.sum_to_shape(be.mul(gy, b), a.shape) if self.needs_grad[0] else None
        gb = be.sum_to_shape(be.mul(gy, a), b.shape) if self.needs_grad[1] else None
        return ga, gb


class Div(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return self.be.div(a, b)

    def backward(self, gy):
        be, a, b = self.be, self.a, self.b
        ga = be.sum_to_shape(be.div(gy, b), a.shape) if self.needs_grad[0] else None
        gb = None
        if self.needs_grad[1]:  # d(a/b)/db = -a / b^2
            gb = be.sum_to_shape(be.neg(be.div(be.mul(gy, a), be.mul(b, b))), b.shape)
        return ga, gb


class Neg(Function):
    def forward(self, a):
        return self.be.neg(a)

    def backward(self, gy):
        return (self.be.neg(gy),)


class PowScalar(Function):
    def forward(self, a, p):
        self.a, self.p = a, p
        return self.be.pow_scalar(a, p)

    def backward(self, gy):
        return (self.be.pow_scalar_backward(self.a, gy, self.p),)


class Exp(Function):
    def forward(self, a):
        self.y = self.be.exp(a)
        return self.y

    def backward(self, gy):
        return (self.be.mul(gy, self.y),)


class Log(Function):
    def forward(self, a):
        self.a = a
        return self.be.log(a)

    def backward(self, gy):
        return (self.be.div(gy, self.a),)


class Sqrt(Function):
    def forward(self, a):
        self.y = self.be.sqrt(a)
        return self.y

    def backward(self, gy):  # d sqrt(a) = 1 / (2 sqrt(a))
        return (self.be.div(self.be.scale(gy, 0.5), self.y),)


class ReLU(Function):
    def forward(self, a, workspace=None):
        self.y, self.workspace = self.be.relu(a), workspace
        return self.y

    def backward(self, gy):
        return (self.be.relu_backward(self.y, gy, workspace=self.workspace),)


class Sigmoid(Function):
    def forward(self, a):
        self.y = self.be.sigmoid(a)
        return self.y

    def backward(self, gy):
        return (self.be.sigmoid_backward(self.y, gy),)


class Tanh(Function):
    def forward(self, a):
        self.y = self.be.tanh(a)
        return self.y

    def backward(self, gy):
        return (self.be.tanh_backward(self.y, gy),)


# ----------------------------------------------------------------------------- reductions


def _kept_shape(shape, axis):
    """The shape a reduction over `axis` has with keepdims=True."""
    if axis is None:
        return (1,) * len(shape)
    axes = {a % len(shape) for a in np.atleast_1d(axis).tolist()}
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


class Sum(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.shape, self.axis = a.shape, axis
        return self.be.sum(a, axis=axis, keepdims=keepdims)

    def backward(self, gy):
        gy = gy.reshape(_kept_shape(self.shape, self.axis))
        return (self.be.broadcast_to(gy, self.shape),)


class Mean(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.shape, self.axis = a.shape, axis
        self.count = int(np.prod(a.shape)) // int(np.prod(_kept_shape(a.shape, axis)))
        return self.be.scale(self.be.sum(a, axis=axis, keepdims=keepdims), 1.0 / self.count)

    def backward(self, gy):
        gy = self.be.scale(gy, 1.0 / self.count).reshape(_kept_shape(self.shape, self.axis))
        return (self.be.broadcast_to(gy, self.shape),)


class Max(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.a, self.axis, self.keepdims = a, axis, keepdims
        self.y = self.be.max(a, axis=axis, keepdims=keepdims)
        return self.y

    def backward(self, gy):
        return (self.be.max_backward(self.a, self.y, gy, self.axis, self.keepdims),)


# ----------------------------------------------------------------------------- shape


class Reshape(Function):
    takes_grad_sum = True  # a view: parts pass through it apart (to a channels-last batch norm)

    def forward(self, a, shape):
        self.shape = a.shape
        return a.reshape(shape)

    def backward(self, gy):
        if isinstance(gy, GradSum):
            return (GradSum(g.reshape(self.shape) for g in gy),)
        return (gy.reshape(self.shape),)


class Cast(Function):
    """A copy in another float dtype (mixed precision); the gradient goes back to the input's."""

    def forward(self, a, dtype):
        self.dtype = a.dtype
        return self.be.astype(a, dtype)

    def backward(self, gy):
        return (self.be.astype(gy, self.dtype),)


class CastParameter(Cast):
    """Cast of a parameter (a leaf) to a 16-bit dtype (mixed precision). Its gradient goes back
    in the 16-bit dtype: the leaf adds it into its fp32 ``.grad`` in one pass
    (``Tensor._accumulate``, a mixed-dtype ``add_``) rather than after a cast of its own.
    ``shadow``: the parameter's 16-bit copy that training keeps current (dptrain.distributed.flat),
    returned as it is: no kernel."""

    hands_grad_to_leaf = True  # its consumer may add into the leaf's .grad (grad_into_widened)

    def forward(self, a, dtype, shadow=None):
        if shadow is None:
            return super().forward(a, dtype)
        self.dtype = a.dtype
        return shadow

    def backward(self, gy):
        return (gy,)


class Transpose(Function):
    def forward(self, a, axes):
        self.axes = axes
        return self.be.transpose(a, axes)

    def backward(self, gy):
        return (self.be.transpose(gy, tuple(np.argsort(self.axes))),)


class ToChannelsLast(Function):
    """NCHW x laid out channels-last with zero columns and channels (backend
    to_channels_last); the gradient is the slice of x's slots, back in NCHW."""

    def forward(self, a, group, left, right, channels):
        self.shape, self.group, self.left = a.shape, group, left
        return self.be.to_channels_last(a, group, left, right, channels)

    def backward(self, gy):
        n, c, h, w = self.shape
        g = self.be.getitem(gy, (Ellipsis, slice(0, self.group * c))).reshape(n, h, -1, c)
        g = self.be.getitem(g, (slice(None), slice(None), slice(self.left, self.left + w)))
        return (self.be.transpose(g, (0, 3, 1, 2)),)


class GetItem(Function):
    def forward(self, a, index):
        self.shape, self.index = a.shape, index
        return self.be.getitem(a, index)

    def backward(self, gy):
        return (self.be.getitem_backward(gy, self.shape, self.index),)


class Concatenate(Function):
    def forward(self, *arrays, axis=0):
        self.axis = axis
        self.sizes = [a.shape[axis] for a in arrays]
        return self.be.concatenate(arrays, axis)

    def backward(self, gy):
        grads, start = [], 0
        axis = self.axis % gy.ndim
        for size, need in zip(self.sizes, self.needs_grad):
            index = (slice(None),) * axis + (slice(start, start + size),)
            grads.append(self.be.getitem(gy, index) if need else None)
            start += size
        return tuple(grads)


# ----------------------------------------------------------------------------- matrix products


class MatMul(Function):
    """op(a) @ op(b) over the last two axes, op transposing where trans_a / trans_b say; batch
    axes broadcast, and each gradient is summed back to its operand's shape."""

    def forward(self, a, b, trans_a=False, trans_b=False):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands of at least 2 dims, got {a.shape} @ {b.shape}")
        self.a, self.b, self.ta, self.tb = a, b, trans_a, trans_b
        if trans_a or trans_b:
            return self.be.matmul(a, b, trans_a=trans_a, trans_b=trans_b)
        return self.be.matmul(a, b)

    def backward(self, gy):
        be, a, b, ta, tb = self.be, self.a, self.b, self.ta, self.tb
        ga = gb = None
        if self.needs_grad[0]:  # d op(a) = gy @ op(b)^T
            ga = (be.matmul(b, gy, trans_a=tb, trans_b=True) if ta
                  else be.matmul(gy, b, trans_b=not tb))
            ga = be.sum_to_shape(ga, a.shape)
        if self.needs_grad[1]:  # d op(b) = op(a)^T @ gy
            gb = (be.matmul(gy, a, trans_a=True, trans_b=ta) if tb
                  else be.matmul(a, gy, trans_a=not ta))
            gb = be.sum_to_shape(gb, b.shape)
        return ga, gb


class Linear(Function):
    """y = x W^T + b over the last axis of x; W is (out, in) as in PyTorch. With `relu`,
    y = relu(x W^T + b) (Linear then ReLU as one op: the bias and the ReLU ride in the GEMM's
    epilogue; the backward masks gy by y > 0 first, as relu's would)."""

    def forward(self, x, w, b=None, relu=False, workspace=None):
        self.x_shape = x.shape
        self.x2 = x.reshape(-1, x.shape[-1])
        self.w, self.workspace = w, workspace
        y = self.be.linear(self.x2, w, b, relu=relu)
        self.y = y if relu else None
        return y.reshape(x.shape[:-1] + (w.shape[0],))

    def backward(self, gy):
        be = self.be
        g2 = gy.reshape(-1, gy.shape[-1])
        if self.y is not None:
            g2 = be.relu_backward(self.y, g2, workspace=self.workspace)
        gx = be.matmul(g2, self.w).reshape(self.x_shape) if self.needs_grad[0] else None
        gw = gb = None
        if self.needs_grad[1]:
            into = self.grad_into(1, g2.dtype)
            gw = (be.matmul(g2, self.x2, trans_a=True) if into is None
                  else be.matmul_into_(into, g2, self.x2, trans_a=True) if self.grad_is_zero(1)
                  else be.matmul_add_(into, g2, self.x2, trans_a=True))
        if len(self.needs_grad) > 2 and self.needs_grad[2]:
            into = self.grad_into(2, g2.dtype)
            gb = be.bias_grad(g2) if into is None else be.bias_grad_add_(into, g2)
        return gx, gw, gb


# ----------------------------------------------------------------------------- convolution and pooling


class Conv2d(Function):
    """Convolution. `workspace` (from ``be.new_workspace()``, owned by the caller, e.g. a
    layer that keeps one across steps) is where the backend may reuse memory and work; without
    one, this call makes its own, so its backward can still reuse its forward's work."""

    def forward(self, x, w, b=None, stride=(1, 1), padding=(0, 0), workspace=None,
                channels_last=False, stats_out=None):
        """`stats_out`: a list to append the output's per-channel batch (mean, var) to (a
        bias-free convolution feeding a batch norm; the backend may sum them in its pass)."""
        self.x, self.w, self.stride, self.padding = x, w, stride, padding
        self.channels_last = channels_last
        self.workspace = self.be.new_workspace() if workspace is None else workspace
        if self.workspace is not None:  # what the forward keeps serves the weight gradient
            self.workspace.expect_backward(is_grad_enabled() and self.needs_grad[1])
        if stats_out is not None:
            y, mean, var = self.be.conv2d_forward_stats(x, w, stride, padding,
                                                        channels_last=channels_last,
                                                        workspace=self.workspace)
            stats_out.extend((mean, var))
            return y
        return self.be.conv2d_forward(x, w, b, stride, padding, channels_last=channels_last,
                                      workspace=self.workspace)

    def backward(self, gy):
        be, x, w, ws = self.be, self.x, self.w, self.workspace
        passes = dict(channels_last=self.channels_last, workspace=ws)  # both passes' options
        if ws is not None:  # backward-data's copy of gy serves the weight gradient
            ws.expect_backward(self.needs_grad[1])
        gx = gw = gb = None
        if self.needs_grad[0]:  # a strided 1x1's may come as a Spread (see SPREAD_LATER)
            gx = be.conv2d_backward_data(gy, w, x.shape, self.stride, self.padding,
                                         spread_later=SPREAD_LATER, **passes)
        if self.needs_grad[1]:  # into the weight's .grad where it may: no pass to add it
            into = self.grad_into(1, w.dtype)
            into = self.grad_into_widened(1) if into is None else into
            gw = be.conv2d_backward_weight(x, gy, w.shape, self.stride, self.padding,
                                           add_to=into, **passes)
        if len(self.needs_grad) > 2 and self.needs_grad[2]:  # a sum over all axes but C's
            gb = be.bias_grad(gy.reshape(-1, gy.shape[-1]) if self.channels_last else gy)
        self.workspace = None  # not needed any more (a second backward works without it)
        return gx, gw, gb


class MaxPool2d(Function):
    """`channels_last`: x and y are (N, H, W, C)."""
    forward_op = "max_pool2d_forward"

    def forward(self, x, kernel, stride, padding, workspace=None, channels_last=False):
        self.x_shape, self.workspace, self.channels_last = x.shape, workspace, channels_last
        self.window = (kernel, stride, padding)
        y, self.idx = getattr(self.be, self.forward_op)(x, *self.window, workspace=workspace,
                                                        channels_last=channels_last)
        return y

    def backward(self, gy):
        return (self.be.max_pool2d_backward(gy, self.idx, self.x_shape, window=self.window,
                                            workspace=self.workspace,
                                            channels_last=self.channels_last),)


class ReLUMaxPool2d(MaxPool2d):
    """max_pool2d(relu(x)) as one op: one pass forward, and the pool's backward alone (the
    windows whose maximum is not > 0 carry idx -1 and get no gradient), so neither relu's
    output nor its backward pass exists. Same values and gradients as the two ops."""
    forward_op = "relu_max_pool2d_forward"


class AvgPool2d(Function):
    def forward(self, x, kernel, stride, padding):
        self.x_shape, self.args = x.shape, (kernel, stride, padding)
        return self.be.avg_pool2d_forward(x, kernel, stride, padding)

    def backward(self, gy):
        return (self.be.avg_pool2d_backward(gy, self.x_shape, *self.args),)


# ----------------------------------------------------------------------------- softmax family (last axis)


class Softmax(Function):
    def forward(self, x):
        self.y = self.be.softmax(x)
        return self.y

    def backward(self, gy):
        return (self.be.softmax_backward(self.y, gy),)


class LogSoftmax(Function):
    def forward(self, x):
        self.y = self.be.log_softmax(x)
        return self.y

    def backward(self, gy):
        return (self.be.log_softmax_backward(self.y, gy),)


class CrossEntropy(Function):
    """Mean cross-entropy of (N, C) logits against integer labels (N,). 16-bit logits (mixed
    precision) give a float32 loss, computed from their exact float values, and a gradient in
    their own dtype: the bits of a cast to float32 first, without the casts' passes."""

    def forward(self, logits, labels):
        self.labels, self.dtype = labels, logits.dtype
        loss, self.probs = self.be.cross_entropy_forward(logits, labels)
        return loss

    def backward(self, gloss):
        return self.be.cross_entropy_backward(self.probs, self.labels, gloss, self.dtype), None


class Dropout(Function):
    """x * mask. Axis 0 is the batch: with a data shard of N ranks (dptrain.engine.rng), the mask
    of the N-times-larger global batch is drawn and this rank's rows (rank::N) kept, so every
    sample gets the mask it would get in one process."""

    def forward(self, x, p):
        rank, size = data_shard()
        if size == 1 or x.ndim == 0:
            self.mask = self.be.dropout_mask(x.shape, p, x.dtype)
        else:
            full = self.be.dropout_mask((x.shape[0] * size,) + tuple(x.shape[1:]), p, x.dtype)
            self.mask = self.be.getitem(full, slice(rank, None, size))
        return self.be.mul(x, self.mask)

    def backward(self, gy):
        return (self.be.mul(gy, self.mask),)


# ----------------------------------------------------------------------------- normalisation


class BatchNorm(Function):
    """Batch normalisation over axis 1 of x (NCHW or (N, C)) with weight and bias (C,),
    optionally followed in the same pass by a residual addition (a fourth input of x's shape)
    and ReLU: relu(bn(x) + residual).

    Training: normalise with the batch's statistics; with ``comm`` (a communicator of more
    than one rank, sync-BN) they are the statistics of all ranks' batches, all-reduced in the
    forward (the mean, then the variance about it) and again in the backward (the sums the
    input gradient needs), on the current stream, so the step stays capturable. ``running``
    (mean, var, num_batches_tracked arrays) is then updated in place on the device. Eval:
    normalise with ``running``'s estimates. The weight and bias gradients are this rank's own
    sums (the reducer averages them like every gradient); the input gradient is that of the
    sum of all ranks' losses, which the reducer's mean turns into the global batch's.

    ``pool`` ((N, H, W, C), kernel, stride, padding; channels-last x as rows, relu, no
    residual): the output is the max-pool of relu(bn(x)) instead (ImageNet's stem), the
    batch norm's output never stored; its backward first spreads gy back through the pool."""

    takes_grad_sum = True  # a block's output often feeds two paths: their add joins the ReLU's

    def forward(self, x, weight, bias, *residual, running=None, training=True, momentum=0.1,
                eps=1e-5, comm=None, relu=False, stats=None, pool=None):
        be = self.be
        self.comm = comm if comm is not None and comm.size > 1 else None
        self.count = (x.size // x.shape[1]) * (self.comm.size if self.comm else 1)
        self.training, self.eps, self.relu = training, eps, relu
        if training and not self.comm and stats is not None:
            mean, var = stats  # the producing convolution's (F.conv2d's batch_stats)
        elif training and not self.comm:
            mean, var = be.batch_norm_stats(x)  # one read of x
        elif training:
            mean = be.batch_norm_mean(x)
            self.comm.all_reduce(mean, "mean")  # equal counts: the mean of the means
            var = be.batch_norm_var(x, mean)
            self.comm.all_reduce(var, "mean")
        else:
            mean, var = running[0], running[1]
        # the running estimates are updated by the forward's launch
        update = (*running, momentum, self.count) if training and running is not None else None
        self.x, self.weight, self.bias, self.mean, self.var = x, weight, bias, mean, var
        self.residual, self.pool = bool(residual), pool
        if pool is not None:
            if update is not None:
                be.batch_norm_update_(*update[:3], mean, var, *update[3:])
            y, self.idx = be.batch_norm_relu_max_pool2d(x.reshape(pool[0]), mean, var, weight,
                                                        bias, eps, *pool[1:])
            return y
        y = be.batch_norm_forward(x, mean, var, weight, bias, eps,
                                  residual=residual[0] if residual else None, relu=relu,
                                  update=update)
        self.y = y if relu and residual else None  # without a residual, its mask is recomputed
        return y

    def backward(self, gy):
        be = self.be
        if self.pool is not None:  # to the batch norm's output first (the mask comes below)
            gb = None  # two parts (a stage's first block reads the pool twice): added there
            if isinstance(gy, GradSum) and len(gy) == 2 and not any(
                    isinstance(g, Spread) for g in gy):  # parts are never GradSums
                gy, gb = gy
            gy = be.max_pool2d_backward(total(gy, be), self.idx, self.pool[0],
                                        window=self.pool[1:], channels_last=True,
                                        gb=gb).reshape(self.x.shape)
        relu = relu_out = None
        if self.relu and self.residual:  # through the ReLU once: the residual's gradient too
            relu_out = self.y
        elif self.relu:  # the kernels recompute the ReLU's mask from x: no pass of its own
            relu = (self.weight, self.bias)
        # the sums' last kernel adds them into both parameters' .grad where it may (the bits
        # of add_ afterwards); else they are returned: this rank's own sums either way
        into_b, into_w = self.grad_into(2, self.mean.dtype), self.grad_into(1, self.mean.dtype)
        add_to = (into_b, into_w) if into_b is not None and into_w is not None else None
        if relu_out is not None or isinstance(gy, GradSum):
            # the parts' last add and the mask join the sums' pass, which stores the gradient
            # (the residual's too): ((g0 + g1) + ...) + g_last, as adding them in order
            parts = tuple(gy) if isinstance(gy, GradSum) else (gy,)
            if len(parts) == 2 and isinstance(parts[0], Spread):  # the kernel reads the last
                parts = parts[::-1]  # a + b and b + a: the same bits
            first = GradSum(parts[:-1]).total(be) if len(parts) > 1 else parts[0]
            last = parts[-1] if len(parts) > 1 else None
            gy, sums = be.batch_norm_backward_reduce_joined(
                first, last, self.x, self.mean, self.var, self.eps, relu=relu,
                relu_out=relu_out, add_to=add_to)
        else:
            sums = be.batch_norm_backward_reduce(gy, self.x, self.mean, self.var, self.eps,
                                                 relu=relu, add_to=add_to)
        if add_to is not None:
            gb, gw = add_to
        else:
            gw = be.getitem(sums, 1) if self.needs_grad[1] else None
            gb = be.getitem(sums, 0) if self.needs_grad[2] else None
        gx = None
        if self.needs_grad[0]:
            if not self.training:  # the statistics are constants: dx = gy * weight * invstd
                sums = be.zeros(sums.shape, sums.dtype)
            elif self.comm:  # all ranks' sums, in a copy (gw and gb may be views of sums)
                sums = be.copy(sums)
                self.comm.all_reduce(sums.reshape(-1), "sum")
            gx = be.batch_norm_backward_data(gy, self.x, self.mean, self.var, self.weight, sums,
                                             self.eps, self.count, relu=relu)
        if len(self.needs_grad) == 3:
            return gx, gw, gb
        return gx, gw, gb, gy if self.needs_grad[3] else None
