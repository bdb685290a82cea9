"""The NumPy backend: the reference every other backend is tested against.

Plain, vectorised NumPy. No Python loops over pixels or batch elements; the
only loops run over kernel offsets (at most kH*kW iterations). Functions follow
the contract in ``dptrain/backend/__init__.py``.
"""
from __future__ import annotations

import weakref

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

name = "cpu"

# ----------------------------------------------------------------------------- arrays


def asarray(a, dtype=None):
    return np.asarray(a, dtype=dtype, order="C")  # (ascontiguousarray would make 0-d 1-d)


def to_numpy(a):
    return np.asarray(a)


def empty(shape, dtype=np.float32):
    return np.empty(shape, dtype=dtype)


def zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


def full(shape, value, dtype=np.float32):
    return np.full(shape, value, dtype=dtype)


def copy(a):
    return np.array(a, copy=True, order="C")


def copy_(dst, src):
    np.copyto(dst, src)
    return dst


def fill_(a, value):
    a.fill(value)
    return a


def set_scalar_(buf, values):
    """Write host floats into the first len(values) slots of a small device array."""
    buf[: len(values)] = values
    return buf


def astype(a, dtype):
    return np.ascontiguousarray(a, dtype=dtype)


def transpose(a, axes):
    return np.ascontiguousarray(np.transpose(a, axes))


def getitem(a, index):
    return np.asarray(a[index], order="C")


def getitem_backward(gy, shape, index):
    gx = np.zeros(shape, dtype=gy.dtype)
    np.add.at(gx, index, gy)
    return gx


def concatenate(arrays, axis):
    return np.concatenate(arrays, axis=axis)


def broadcast_to(a, shape):
    return np.ascontiguousarray(np.broadcast_to(a, shape))


def sum_to_shape(g, shape):
    """Sum a broadcast gradient back down to `shape` (the inverse of broadcasting)."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1
    )
    return np.asarray(g.sum(axis=axes).reshape(shape), order="C")


# ----------------------------------------------------------------------------- elementwise


def add(a, b):
    return np.add(a, b)


def sub(a, b):
    return np.subtract(a, b)


def mul(a, b):
    return np.multiply(a, b)


def div(a, b):
    return np.divide(a, b)


def neg(a):
    return np.negative(a)


def scale(a, s):
    return a * a.dtype.type(s)


def add_(dst, src):
    """dst += src, in place (gradient accumulation)."""
    np.add(dst, src, out=dst)
    return dst


def pow_scalar(a, p):
    return np.power(a, a.dtype.type(p))


def pow_scalar_backward(x, gy, p):
    return gy * x.dtype.type(p) * np.power(x, x.dtype.type(p - 1))


def exp(a):
    return np.exp(a)


def log(a):
    return np.log(a)


def sqrt(a):
    return np.sqrt(a)


def relu(a):
    return np.maximum(a, a.dtype.type(0))


def relu_backward(y, gy):
    return gy * (y > 0)


def sigmoid(a):
    # Split by sign so neither branch overflows.
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1 / (1 + e), e / (1 + e)).astype(a.dtype)


def sigmoid_backward(y, gy):
    return gy * y * (1 - y)


def tanh(a):
    return np.tanh(a)


def tanh_backward(y, gy):
    return gy * (1 - y * y)


# ----------------------------------------------------------------------------- reductions


def sum(a, axis=None, keepdims=False):  # noqa: A001 - the op's name
    return np.asarray(np.sum(a, axis=axis, keepdims=keepdims), dtype=a.dtype)


def max(a, axis=None, keepdims=False):  # noqa: A001
    return np.asarray(np.max(a, axis=axis, keepdims=keepdims))


def max_backward(x, y, gy, axis=None, keepdims=False):
    """Gradient of max: split evenly among the elements that tie for the maximum."""
    if not keepdims:
        axes = range(x.ndim) if axis is None else np.atleast_1d(axis)
        axes = [a % x.ndim for a in axes]
        shape = [1 if i in axes else n for i, n in enumerate(x.shape)]
        y, gy = y.reshape(shape), gy.reshape(shape)
    mask = (x == y).astype(x.dtype)
    return mask * (gy / mask.sum(axis=axis, keepdims=True))


# ----------------------------------------------------------------------------- matrix products


def matmul(a, b, trans_a=False, trans_b=False):
    """a @ b over the last two axes, either operand optionally transposed; batch axes broadcast."""
    if trans_a:
        a = np.swapaxes(a, -1, -2)
    if trans_b:
        b = np.swapaxes(b, -1, -2)
    return np.ascontiguousarray(np.matmul(a, b))


def _channel_shape(y):
    return (1, -1) + (1,) * (y.ndim - 2)


def bias_add(y, b):
    """y + b with b broadcast along axis 1 (channels of NCHW, features of (N, F))."""
    return y + b.reshape(_channel_shape(y))


def bias_grad(gy):
    """Sum of gy over every axis but 1: the bias gradient of bias_add."""
    return gy.sum(axis=(0,) + tuple(range(2, gy.ndim)))


# ----------------------------------------------------------------------------- convolution


def _out_size(n, k, s, p):
    return (n + 2 * p - k) // s + 1


def _windows(x, kh, kw, stride, padding, pad_value=0.0):
    """View of shape (N, C, Ho, Wo, kh, kw): the receptive field of each output pixel."""
    (sh, sw), (ph, pw) = stride, padding
    if ph or pw:
        x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=pad_value)
    ho = (x.shape[2] - kh) // sh + 1
    wo = (x.shape[3] - kw) // sw + 1
    win = sliding_window_view(x, (kh, kw), axis=(2, 3))
    return win[:, :, : (ho - 1) * sh + 1 : sh, : (wo - 1) * sw + 1 : sw]


def _im2col(x, kh, kw, stride, padding):
    """(C*kh*kw, N*Ho*Wo) matrix of receptive fields, one column per output pixel."""
    win = _windows(x, kh, kw, stride, padding)
    n, c, ho, wo = win.shape[:4]
    return win.transpose(1, 4, 5, 0, 2, 3).reshape(c * kh * kw, n * ho * wo), (ho, wo)


class _ColsCache:
    """The im2col matrix of the last few conv inputs, so backward-weight need not rebuild it.

    Keyed by the input array's identity (checked through a weak reference), so a
    new array at a recycled address never hits a stale entry.
    """

    def __init__(self, size=8):
        self.size, self.entries = size, {}

    def get(self, x, key):
        entry = self.entries.get((id(x), key))
        return entry[1] if entry is not None and entry[0]() is x else None

    def put(self, x, key, cols):
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[(id(x), key)] = (weakref.ref(x), cols)


_cols_cache = _ColsCache()


def _cached_im2col(x, kh, kw, stride, padding, reuse):
    """im2col of x; forward stores it (reuse=False), backward-weight reads it back (reuse=True).

    Like any saved activation, x must not be modified in place between the two.
    """
    key = (kh, kw, stride, padding)
    hit = _cols_cache.get(x, key) if reuse else None
    if hit is None:
        hit = _im2col(x, kh, kw, stride, padding)
        _cols_cache.put(x, key, hit)
    return hit


def conv2d_forward(x, w, b, stride, padding):
    n = x.shape[0]
    cout, _, kh, kw = w.shape
    cols, (ho, wo) = _cached_im2col(x, kh, kw, stride, padding, reuse=False)
    y = (w.reshape(cout, -1) @ cols).reshape(cout, n, ho, wo)
    if b is not None:
        y += b.reshape(cout, 1, 1, 1)
    return np.ascontiguousarray(y.transpose(1, 0, 2, 3))


def _channels_first(gy):
    """gy (N, C, Ho, Wo) as the (C, N*Ho*Wo) matrix that matches _im2col's columns."""
    return gy.transpose(1, 0, 2, 3).reshape(gy.shape[1], -1)


def conv2d_backward_data(gy, w, x_shape, stride, padding):
    n, c, h, wd = x_shape
    cout, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, padding
    ho, wo = gy.shape[2:]
    dcols = (w.reshape(cout, -1).T @ _channels_first(gy)).reshape(c, kh, kw, n, ho, wo)
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=gy.dtype)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + (ho - 1) * sh + 1 : sh, j : j + (wo - 1) * sw + 1 : sw] += dcols[
                :, i, j
            ].transpose(1, 0, 2, 3)
    return np.ascontiguousarray(dxp[:, :, ph : ph + h, pw : pw + wd])


def conv2d_backward_weight(x, gy, w_shape, stride, padding):
    _, _, kh, kw = w_shape
    cols, _ = _cached_im2col(x, kh, kw, stride, padding, reuse=True)
    g = _channels_first(gy)
    # OpenBLAS is up to 15x slower on a long-K product whose output has fewer rows than
    # columns, so compute the transposed product in that case.
    dw = g @ cols.T if g.shape[0] >= cols.shape[0] else (cols @ g.T).T
    return np.ascontiguousarray(dw).reshape(w_shape)


# ----------------------------------------------------------------------------- pooling


def _offsets(kh, kw, sh, sw, ho, wo):
    """Slices that pick, for kernel offset (i, j), that element of every window."""
    for i in range(kh):
        for j in range(kw):
            yield i, j, (slice(i, i + (ho - 1) * sh + 1, sh), slice(j, j + (wo - 1) * sw + 1, sw))


def max_pool2d_forward(x, kernel, stride, padding):
    """Returns (y, idx): idx is the flat h*W+w position in x of each window's maximum (int32)."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    n, c, h, w = x.shape
    ho, wo = _out_size(h, kh, sh, ph), _out_size(w, kw, sw, pw)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf) if ph or pw else x
    # The max over the kH*kW window offsets, then the first offset that attains it
    # (walking the offsets backwards so the earliest match is written last, as argmax picks).
    views = [(i * kw + j, xp[:, :, rows, cols]) for i, j, (rows, cols) in _offsets(kh, kw, sh, sw, ho, wo)]
    y = views[0][1].copy()
    for _, v in views[1:]:
        np.maximum(y, v, out=y)
    arg = np.zeros((n, c, ho, wo), dtype=np.int32)
    for offset, v in reversed(views[1:]):
        arg[v == y] = offset
    arg[views[0][1] == y] = 0
    r = np.arange(ho, dtype=np.int32).reshape(ho, 1) * sh + arg // kw - ph
    q = np.arange(wo, dtype=np.int32).reshape(1, wo) * sw + arg % kw - pw
    return y, r * w + q


def max_pool2d_backward(gy, idx, x_shape):
    n, c, h, w = x_shape
    planes = np.arange(n * c, dtype=np.int64).reshape(n, c, 1, 1) * (h * w)
    dx = np.bincount((planes + idx).ravel(), weights=gy.ravel(), minlength=n * c * h * w)
    return dx.astype(gy.dtype).reshape(x_shape)


def avg_pool2d_forward(x, kernel, stride, padding):
    """Average over each window, padding counted in the divisor (PyTorch's default)."""
    kh, kw = kernel
    win = _windows(x, kh, kw, stride, padding)
    return np.ascontiguousarray(win.mean(axis=(4, 5), dtype=x.dtype))


def avg_pool2d_backward(gy, x_shape, kernel, stride, padding):
    n, c, h, w = x_shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho, wo = gy.shape[2:]
    g = gy / gy.dtype.type(kh * kw)
    dxp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=gy.dtype)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + (ho - 1) * sh + 1 : sh, j : j + (wo - 1) * sw + 1 : sw] += g
    return np.ascontiguousarray(dxp[:, :, ph : ph + h, pw : pw + w])


# ----------------------------------------------------------------------------- softmax family
# All along the last axis; ops move the axis there first.


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward(y, gy):
    return y * (gy - (gy * y).sum(axis=-1, keepdims=True))


def log_softmax(x):
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def log_softmax_backward(y, gy):
    return gy - np.exp(y) * gy.sum(axis=-1, keepdims=True)


def cross_entropy_forward(logits, labels):
    """Mean cross-entropy of (N, C) logits against int labels: (loss as a 0-d array, softmax)."""
    logp = log_softmax(logits)
    n = logits.shape[0]
    loss = -logp[np.arange(n), labels].sum(dtype=logits.dtype) / logits.dtype.type(n)
    return np.asarray(loss, dtype=logits.dtype), np.exp(logp)


def cross_entropy_backward(probs, labels, gloss):
    n = probs.shape[0]
    g = probs.copy()
    g[np.arange(n), labels] -= 1
    return g * (gloss / probs.dtype.type(n))


def count_correct(logits, labels):
    """Number of rows whose arg-max equals the label, as a 0-d float32 array (no host sync)."""
    return np.asarray((logits.argmax(axis=-1) == labels).sum(), dtype=np.float32)


# ----------------------------------------------------------------------------- randomness

_rng = np.random.default_rng(0)


def manual_seed(seed):
    global _rng
    _rng = np.random.default_rng(seed)


def dropout_mask(shape, p, dtype=np.float32):
    """Keep each element with probability 1-p, scaled by 1/(1-p) (inverted dropout)."""
    keep = _rng.random(shape, dtype=np.float32) >= p
    return keep.astype(dtype) * np.dtype(dtype).type(1.0 / (1.0 - p))


# ----------------------------------------------------------------------------- optimizers
# Flat buffers, updated in place. `hyper` is a small device array whose slots the
# optimizer rewrites each step (lr, bias corrections), so a captured graph sees them.


def sgd_step_(param, grad, buf, hyper, momentum, weight_decay, nesterov):
    """PyTorch SGD: d = g + wd*p; buf = m*buf + d; d = d + m*buf (nesterov) or buf; p -= lr*d."""
    lr = hyper[0]
    d = grad + param.dtype.type(weight_decay) * param if weight_decay else grad
    if momentum:
        buf *= param.dtype.type(momentum)
        buf += d
        d = d + param.dtype.type(momentum) * buf if nesterov else buf
    param -= lr * d
    return param


def adamw_step_(param, grad, m, v, hyper, beta1, beta2, eps, weight_decay):
    """AdamW with decoupled weight decay; hyper = [lr, 1 - beta1**t, 1 - beta2**t]."""
    t = param.dtype.type
    lr, bc1, bc2 = hyper[0], hyper[1], hyper[2]
    param *= 1 - lr * t(weight_decay)
    m *= t(beta1)
    m += t(1 - beta1) * grad
    v *= t(beta2)
    v += t(1 - beta2) * grad * grad
    param -= lr * (m / bc1) / (np.sqrt(v / bc2) + t(eps))
    return param


# ----------------------------------------------------------------------------- data


def gather_normalize(images, idx, mean, std):
    """Rows idx of a uint8 (M, C, H, W) image array as float32, scaled to [0,1] then (x-mean)/std."""
    x = images[idx].astype(np.float32)
    x *= np.float32(1.0 / (255.0 * std))
    x -= np.float32(mean / std)
    return x
