"""The NumPy backend: the reference every other backend is tested against.

Plain, vectorised NumPy. No Python loops over pixels or batch elements; the
only loops run over kernel offsets (at most kH*kW iterations). Functions follow
the contract in ``dptrain/backend/__init__.py``.
"""
from __future__ import annotations

import weakref

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from dptrain.backend.cpu.runtime import runtime

name = "cpu"


class _Scratch:
    """One reusable array per (name, shape, dtype) for large temporaries that no result aliases.

    Allocating and freeing tens of MB of temporaries on every call made glibc hand heap
    memory back to the OS and page-fault it in again (about 9,600 faults per training step
    of the reference CNN, some 8% of its time); arrays that stay allocated avoid that.
    Like the rest of this backend, not for use from several threads at once.
    """

    def __init__(self, size=32):
        self.size, self.arrays = size, {}

    def get(self, name, shape, dtype):
        key = (name, tuple(shape), np.dtype(dtype))
        if key not in self.arrays:
            if len(self.arrays) >= self.size:
                self.arrays.pop(next(iter(self.arrays)))
            self.arrays[key] = np.empty(shape, dtype=dtype)
        return self.arrays[key]


_scratch = _Scratch()

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
    return gy * np.greater(y, 0, out=_scratch.get("relu_mask", y.shape, np.bool_))  # see _Scratch


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


def _gemm(a, b):
    """a @ b for 2-D operands, in whichever orientation OpenBLAS runs well.

    OpenBLAS (threaded) is up to 15x slower on a product whose K is its longest dimension
    and whose output has fewer rows than columns; the transposed product is fast.
    """
    m, k = a.shape
    n = b.shape[1]
    if m < n and k > n:
        return (b.T @ a.T).T
    return a @ b


def matmul(a, b, trans_a=False, trans_b=False):
    """a @ b over the last two axes, either operand optionally transposed; batch axes broadcast."""
    if trans_a:
        a = np.swapaxes(a, -1, -2)
    if trans_b:
        b = np.swapaxes(b, -1, -2)
    if a.ndim == 2 and b.ndim == 2:
        return np.ascontiguousarray(_gemm(a, b))
    return np.ascontiguousarray(np.matmul(a, b))


def _channel_shape(y):
    return (1, -1) + (1,) * (y.ndim - 2)


def bias_add(y, b):
    """y + b with b broadcast along axis 1 (channels of NCHW, features of (N, F))."""
    return y + b.reshape(_channel_shape(y))


def bias_grad(gy):
    """Sum of gy over every axis but 1: the bias gradient of bias_add."""
    if gy.ndim <= 2 or gy.size == 0:
        return gy.sum(axis=(0,) + tuple(range(2, gy.ndim)))
    # Per-(n, c) sums as a matrix-vector product (OpenBLAS, threaded), which beats a
    # reduction over the non-adjacent axes (0, 2, 3); then the small sum over n.
    n, c = gy.shape[:2]
    planes = gy.reshape(n * c, -1) @ np.ones(gy.size // (n * c), dtype=gy.dtype)
    return planes.reshape(n, c).sum(axis=0)


# ----------------------------------------------------------------------------- convolution


def _out_size(n, k, s, p):
    return (n + 2 * p - k) // s + 1


def _windows(x, kh, kw, stride, padding, pad_value=0.0):
    """View of shape (N, C, Ho, Wo, kh, kw): the receptive field of each output pixel."""
    (sh, sw), (ph, pw) = stride, padding
    if ph or pw:
        n, c, h, w = x.shape
        xp = np.full((n, c, h + 2 * ph, w + 2 * pw), pad_value, dtype=x.dtype)  # np.pad is slower
        xp[:, :, ph : ph + h, pw : pw + w] = x
        x = xp
    ho = (x.shape[2] - kh) // sh + 1
    wo = (x.shape[3] - kw) // sw + 1
    win = sliding_window_view(x, (kh, kw), axis=(2, 3))
    return win[:, :, : (ho - 1) * sh + 1 : sh, : (wo - 1) * sw + 1 : sw]


def _offsets(kh, kw, sh, sw, ho, wo):
    """Slices that pick, for kernel offset (i, j), that element of every window."""
    for i in range(kh):
        for j in range(kw):
            yield i, j, (slice(i, i + (ho - 1) * sh + 1, sh), slice(j, j + (wo - 1) * sw + 1, sw))


def _im2col(x, kh, kw, stride, padding, out):
    """Fill out, a (C*kh*kw, N*Ho*Wo) array, with receptive fields: one column per output pixel."""
    win = _windows(x, kh, kw, stride, padding)
    n, c, ho, wo = win.shape[:4]
    np.copyto(out.reshape(c, kh, kw, n, ho, wo), win.transpose(1, 4, 5, 0, 2, 3))
    return out, (ho, wo)


class _ColsCache:
    """The im2col matrix of the last few conv inputs, so backward-weight need not rebuild it.

    Keyed by the input array's identity (checked through a weak reference), so a
    new array at a recycled address never hits a stale entry. Matrices of entries that can
    no longer hit (input gone, replaced, evicted) are kept as spares for the next im2col of
    that shape, for the reason _Scratch gives (a fresh 42 MB im2col matrix costs as much in
    page faults as it takes to fill).
    """

    def __init__(self, size=8):
        self.size, self.entries, self.spares = size, {}, []

    def get(self, x, key):
        entry = self.entries.get((id(x), key))
        return entry[1] if entry is not None and entry[0]() is x else None

    def buffer(self, x, key, shape, dtype):
        """An array to hold x's im2col matrix (contents undefined), recycled where possible."""
        for k in [k for k, (ref, _) in self.entries.items() if ref() is None or k == (id(x), key)]:
            self.spares.append(self.entries.pop(k)[1][0])
        while len(self.entries) >= self.size:
            self.spares.append(self.entries.pop(next(iter(self.entries)))[1][0])
        del self.spares[: -self.size]
        for i, spare in enumerate(self.spares):
            if spare.shape == shape and spare.dtype == dtype:
                return self.spares.pop(i)
        return np.empty(shape, dtype=dtype)

    def put(self, x, key, hit):
        self.entries[(id(x), key)] = (weakref.ref(x), hit)


_cols_cache = _ColsCache()


def _cached_im2col(x, kh, kw, stride, padding, reuse):
    """im2col of x; forward stores it (reuse=False), backward-weight reads it back (reuse=True).

    Like any saved activation, x must not be modified in place between the two.
    """
    key = (kh, kw, stride, padding)
    hit = _cols_cache.get(x, key) if reuse else None
    if hit is None:
        (sh, sw), (ph, pw) = stride, padding
        n, c, h, w = x.shape
        shape = (c * kh * kw, n * _out_size(h, kh, sh, ph) * _out_size(w, kw, sw, pw))
        hit = _im2col(x, kh, kw, stride, padding, _cols_cache.buffer(x, key, shape, x.dtype))
        _cols_cache.put(x, key, hit)
    return hit



# Below this many im2col rows (C_in*kh*kw) a conv GEMM is bound by writing its output, so it
# runs as one GEMM per image, whose output is NCHW already. Above it one large GEMM is faster
# (and hands work to OpenBLAS's threads once, not N times), even with the transposing copy
# its (C_out, N*Ho*Wo) output needs.
_PER_IMAGE_K = 64


def _per_image(cols, n):
    """(N, K, Ho*Wo) strided view of the (K, N*Ho*Wo) im2col matrix: one matrix per image."""
    return cols.reshape(cols.shape[0], n, -1).transpose(1, 0, 2)


def conv2d_forward(x, w, b, stride, padding):
    n = x.shape[0]
    cout, _, kh, kw = w.shape
    cols, (ho, wo) = _cached_im2col(x, kh, kw, stride, padding, reuse=False)
    w2 = w.reshape(cout, -1)
    if cols.shape[0] < _PER_IMAGE_K:
        y = np.matmul(w2, _per_image(cols, n))
        if b is not None:
            y += b.reshape(cout, 1)
        return y.reshape(n, cout, ho, wo)
    y_cf = np.matmul(w2, cols, out=_scratch.get("y", (cout, cols.shape[1]), x.dtype))
    # (C_out, N, Ho, Wo) to NCHW in one pass, adding the bias on the way.
    y_cf = y_cf.reshape(cout, n, ho, wo).transpose(1, 0, 2, 3)
    y = np.empty((n, cout, ho, wo), dtype=x.dtype)
    if b is None:
        np.copyto(y, y_cf)
    else:
        np.add(y_cf, b.reshape(cout, 1, 1), out=y)
    return y


class _ChannelsFirst:
    """gy (N, C, Ho, Wo) as the (C, N*Ho*Wo) matrix that matches _im2col's columns.

    Backward-data builds it and keeps it for the backward-weight call that follows on the same
    gy (checked through a weak reference); that call takes it and drops it.
    """

    def __init__(self):
        self.kept = None

    def __call__(self, gy, keep):
        kept, self.kept = self.kept, None
        if kept is not None and kept[0]() is gy:
            return kept[1]
        n, c = gy.shape[:2]
        g = _scratch.get("gy_channels_first", (c, gy.size // c), gy.dtype)
        np.copyto(g.reshape(c, n, -1), gy.reshape(n, c, -1).transpose(1, 0, 2))
        if keep:
            self.kept = (weakref.ref(gy), g)
        return g


_channels_first = _ChannelsFirst()


def conv2d_backward_data(gy, w, x_shape, stride, padding):
    n, c, h, wd = x_shape
    cout, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, padding
    ho, wo = gy.shape[2:]
    g = _channels_first(gy, keep=True)
    dcols = _scratch.get("dcols", (c * kh * kw, g.shape[1]), gy.dtype)
    np.matmul(w.reshape(cout, -1).T, g, out=dcols)
    dcols = dcols.reshape(c, kh, kw, n, ho, wo)
    # col2im, channels first like dcols so each slab adds without a transpose.
    dxp = np.zeros((c, n, h + 2 * ph, wd + 2 * pw), dtype=gy.dtype)
    for i, j, (rows, cols) in _offsets(kh, kw, sh, sw, ho, wo):
        dxp[:, :, rows, cols] += dcols[:, i, j]
    return np.ascontiguousarray(dxp[:, :, ph : ph + h, pw : pw + wd].transpose(1, 0, 2, 3))


def conv2d_backward_weight(x, gy, w_shape, stride, padding):
    _, _, kh, kw = w_shape
    cols, _ = _cached_im2col(x, kh, kw, stride, padding, reuse=True)
    if cols.shape[0] < _PER_IMAGE_K:  # per image, straight from NCHW gy, summed over the batch
        n, cout = gy.shape[:2]
        per_image = _per_image(cols, n).transpose(0, 2, 1)
        return np.matmul(gy.reshape(n, cout, -1), per_image).sum(axis=0).reshape(w_shape)
    dw = _gemm(_channels_first(gy, keep=False), cols.T)
    return np.ascontiguousarray(dw).reshape(w_shape)


# ----------------------------------------------------------------------------- pooling


def max_pool2d_forward(x, kernel, stride, padding):
    """Returns (y, idx): idx is the flat h*W+w position in x of each window's maximum (int32).

    Ties go to the first maximum in window order (rows, then columns), as np.argmax picks.
    """
    if tuple(kernel) == (2, 2) and tuple(stride) == (2, 2) and tuple(padding) == (0, 0):
        return _max_pool_2x2(x)
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    n, c, h, w = x.shape
    ho, wo = _out_size(h, kh, sh, ph), _out_size(w, kw, sw, pw)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf) if ph or pw else x
    # Running max over the kH*kW window offsets; an offset becomes the argmax only when it is
    # strictly greater than everything before it, so ties keep the earliest. Offsets grow, so
    # the argmax is the largest offset that raised the max (np.maximum, not a masked write:
    # NumPy's boolean-mask assignment is several times slower).
    offsets = _offsets(kh, kw, sh, sw, ho, wo)
    _, _, (rows, cols) = next(offsets)
    y = xp[:, :, rows, cols].copy()
    arg = np.zeros((n, c, ho, wo), dtype=np.int32)
    for i, j, (rows, cols) in offsets:
        v = xp[:, :, rows, cols]
        np.maximum(arg, (v > y) * np.int32(i * kw + j), out=arg)
        np.maximum(y, v, out=y)
    r = np.arange(ho, dtype=np.int32).reshape(ho, 1) * sh + arg // kw - ph
    q = np.arange(wo, dtype=np.int32).reshape(1, wo) * sw + arg % kw - pw
    return y, r * w + q


def _max_pool_2x2(x):
    """max_pool2d_forward for the common 2x2 window, stride 2, no padding."""
    n, c, h, w = x.shape
    ho, wo = h // 2, w // 2
    x = x[:, :, : 2 * ho, : 2 * wo]  # an odd last row/column belongs to no window
    # Max of each row's pair first, then of the window's two rows: the pair views merge
    # into long strided loops, and a strict '>' at both steps keeps ties on the first
    # element in row-major window order.
    left, right = x[..., 0::2], x[..., 1::2]
    row_max = np.maximum(left, right, out=_scratch.get("pool_row_max", left.shape, x.dtype))
    row_right = np.greater(right, left, out=_scratch.get("pool_row_right", left.shape, np.bool_))
    top, bottom = row_max[:, :, 0::2], row_max[:, :, 1::2]
    y = np.maximum(top, bottom)
    lower = np.greater(bottom, top, out=_scratch.get("pool_lower", y.shape, np.bool_))
    # The winning row's column bit, lower ? b : a, as a ^ (lower & (a ^ b)): np.where is
    # several times slower on bools.
    a, b = row_right[:, :, 0::2], row_right[:, :, 1::2]
    col = np.bitwise_xor(a, b, out=_scratch.get("pool_col", y.shape, np.bool_))
    col &= lower
    col ^= a
    idx = np.multiply(lower, np.int32(w), out=np.empty(y.shape, dtype=np.int32))
    idx += col
    idx += 2 * w * np.arange(ho, dtype=np.int32).reshape(ho, 1)  # the window's top-left...
    idx += np.arange(0, 2 * wo, 2, dtype=np.int32)  # ...element
    return y, idx


def max_pool2d_backward(gy, idx, x_shape):
    n, c, h, w = x_shape
    planes = np.arange(0, n * c * h * w, h * w, dtype=np.int64).reshape(n, c, 1, 1)
    dx = np.zeros(n * c * h * w, dtype=gy.dtype)
    flat = np.add(planes, idx, out=_scratch.get("pool_flat_idx", idx.shape, np.int64))
    # add.at accumulates where overlapping windows pick the same element; it stays in
    # gy's dtype (bincount would go through float64).
    np.add.at(dx, flat.ravel(), gy.ravel())
    return dx.reshape(x_shape)


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



def dropout_mask(shape, p, dtype=np.float32):
    """Keep each element with probability 1-p, scaled by 1/(1-p) (inverted dropout); the
    numbers come from the runtime's generator."""
    keep = runtime.rng.random(shape, dtype=np.float32) >= p
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


def new_workspace():
    """Nothing is reused yet: ops allocate what they need."""
    return None
