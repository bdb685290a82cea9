"""The NumPy backend's array ops, all but convolution and pooling (in ``conv.py``).

Plain, vectorised NumPy. No Python loops over pixels or batch elements; the
only loops run over kernel offsets (at most kH*kW iterations). Functions follow
the contract in ``dptrain/backend/__init__.py``; none keeps state between calls.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.bfloat16 import BFLOAT16, HALVES, from_bfloat16, to_bfloat16
from dptrain.backend.cpu.runtime import runtime
from dptrain.backend.cpu.workspace import checked, scratch
from dptrain.backend.registry import op

name = "cpu"


# ----------------------------------------------------------------------------- arrays


@op
def asarray(a, dtype=None):
    return np.asarray(a, dtype=dtype, order="C")  # (ascontiguousarray would make 0-d 1-d)


@op
def to_numpy(a):
    return np.asarray(a)


@op
def empty(shape, dtype=np.float32):
    return np.empty(shape, dtype=dtype)


@op
def zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


@op
def full(shape, value, dtype=np.float32):
    return np.full(shape, value, dtype=dtype)


@op
def copy(a):
    return np.array(a, copy=True, order="C")


@op
def copy_(dst, src):
    """dst[...] = src cast to dst's dtype; bfloat16 (uint16) converts to and from floats
    with round-to-nearest-even, the bits of the GPU's convert_kernel."""
    src = _bf16_cast(src, dst.dtype)
    with np.errstate(over="ignore"):  # to float16: too large becomes inf, as in astype
        np.copyto(dst, src)
    return dst


def _bf16_cast(a, dtype):
    """`a` as `dtype` where one side is bfloat16 and the other a float, else `a` unchanged."""
    a, dtype = np.asarray(a), np.dtype(dtype)
    if dtype == a.dtype or BFLOAT16 not in (dtype, a.dtype):
        return a
    if dtype == BFLOAT16:
        if a.dtype.kind != "f":
            raise TypeError(f"cpu: bfloat16 converts from floats only, not {a.dtype}")
        return to_bfloat16(a.astype(np.float32))  # (float64: via float32)
    if dtype.kind != "f":
        raise TypeError(f"cpu: bfloat16 converts to floats only, not {dtype}")
    return from_bfloat16(a).astype(dtype)


@op
def fill_(a, value):
    a.fill(value)
    return a


@op
def set_scalar_(buf, values):
    """Write host floats into the first len(values) slots of a small device array."""
    buf[: len(values)] = values
    return buf


@op
def astype(a, dtype):
    a = _bf16_cast(a, dtype)  # (the CPU stores bfloat16; only the GPU computes in it)
    with np.errstate(over="ignore"):  # to float16: too large becomes inf, as on the GPU
        return np.ascontiguousarray(a, dtype=dtype)


@op
def transpose(a, axes):
    return np.ascontiguousarray(np.transpose(a, axes))


@op
def getitem(a, index):
    return np.asarray(a[index], order="C")


@op
def getitem_backward(gy, shape, index):
    gx = np.zeros(shape, dtype=gy.dtype)
    np.add.at(gx, index, gy)
    return gx


@op
def concatenate(arrays, axis):
    return np.concatenate(arrays, axis=axis)


@op
def broadcast_to(a, shape):
    return np.ascontiguousarray(np.broadcast_to(a, shape))


@op
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


@op
def add(a, b):
    return np.add(a, b)


@op
def sub(a, b):
    return np.subtract(a, b)


@op
def mul(a, b):
    return np.multiply(a, b)


@op
def div(a, b):
    return np.divide(a, b)


@op
def neg(a):
    return np.negative(a)


@op
def scale(a, s):
    return a * a.dtype.type(s)


@op
def add_(dst, src):
    """dst += src, in place (gradient accumulation)."""
    np.add(dst, src, out=dst)
    return dst


@op
def pow_scalar(a, p):
    return np.power(a, a.dtype.type(p))


@op
def pow_scalar_backward(x, gy, p):
    return gy * x.dtype.type(p) * np.power(x, x.dtype.type(p - 1))


@op
def exp(a):
    return np.exp(a)


@op
def log(a):
    return np.log(a)


@op
def sqrt(a):
    return np.sqrt(a)


@op
def relu(a):
    return np.maximum(a, a.dtype.type(0))


@op
def relu_backward(y, gy, *, workspace=None):
    """gy where y > 0, else 0. The mask is a scratch array of the workspace when one is given
    (a fresh bool array each call can cost page faults; see NOTES.md)."""
    mask = scratch(checked(workspace), "relu_mask", y.shape, np.bool_)
    return gy * np.greater(y, 0, out=mask)


@op
def relu_backward_sum(y, ga, gb):
    """relu_backward(y, ga + gb): ReLU's backward of a gradient that arrived in two parts."""
    return relu_backward(y, add(ga, gb))


@op
def sigmoid(a):
    # Split by sign so neither branch overflows.
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1 / (1 + e), e / (1 + e)).astype(a.dtype)


@op
def sigmoid_backward(y, gy):
    return gy * y * (1 - y)


@op
def tanh(a):
    return np.tanh(a)


@op
def tanh_backward(y, gy):
    return gy * (1 - y * y)


# ----------------------------------------------------------------------------- reductions


@op(fp32_math=True)
def sum(a, axis=None, keepdims=False):  # noqa: A001 - the op's name
    return np.asarray(np.sum(a, axis=axis, keepdims=keepdims), dtype=a.dtype)


@op
def max(a, axis=None, keepdims=False):  # noqa: A001
    return np.asarray(np.max(a, axis=axis, keepdims=keepdims))


@op
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


@op(fp32_math=True)
def matmul(a, b, trans_a=False, trans_b=False):
    """a @ b over the last two axes, either operand optionally transposed; batch axes broadcast."""
    if trans_a:
        a = np.swapaxes(a, -1, -2)
    if trans_b:
        b = np.swapaxes(b, -1, -2)
    if a.ndim == 2 and b.ndim == 2:
        return np.ascontiguousarray(_gemm(a, b))
    return np.ascontiguousarray(np.matmul(a, b))


@op
def matmul_add_(c, a, b, trans_a=False, trans_b=False):
    """c += op(a) @ op(b), in place (a weight's gradient added into its .grad). Returns c."""
    return add_(c, matmul(a, b, trans_a, trans_b))


@op
def matmul_into_(c, a, b, trans_a=False, trans_b=False):
    """c = op(a) @ op(b), written into c (a weight's gradient into a .grad that holds zeros).
    Returns c."""
    product = matmul(a, b, trans_a, trans_b)
    if c.shape != product.shape or c.dtype != product.dtype:
        raise ValueError(f"cpu.matmul_into_: c {c.dtype} {c.shape} does not take the product "
                         f"{product.dtype} {product.shape}")
    return copy_(c, product)


@op(fp32_math=True)
def linear(x, w, b=None, relu=False):
    """x @ w^T (+ b), then ReLU if `relu`: Linear's forward as one op (a 16-bit result is
    rounded once, after the bias and the ReLU)."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"linear: x and w must be 2-D, got {x.shape} and {w.shape}")
    y = matmul(x, w, trans_b=True)
    if b is not None:
        y += b.astype(y.dtype, copy=False)
    return np.maximum(y, y.dtype.type(0), out=y) if relu else y


def _channel_shape(y):
    return (1, -1) + (1,) * (y.ndim - 2)


@op
def bias_add(y, b):
    """y + b with b broadcast along axis 1 (channels of NCHW, features of (N, F))."""
    return y + b.reshape(_channel_shape(y))


@op(fp32_math=True)
def bias_grad(gy):
    """Sum of gy over every axis but 1: the bias gradient of bias_add."""
    if gy.ndim <= 2 or gy.size == 0:
        return gy.sum(axis=(0,) + tuple(range(2, gy.ndim)))
    # Per-(n, c) sums as a matrix-vector product (OpenBLAS, threaded), which beats a
    # reduction over the non-adjacent axes (0, 2, 3); then the small sum over n.
    n, c = gy.shape[:2]
    planes = gy.reshape(n * c, -1) @ np.ones(gy.size // (n * c), dtype=gy.dtype)
    return planes.reshape(n, c).sum(axis=0)


@op
def bias_grad_add_(dst, gy):
    """dst += bias_grad(gy), in place (a bias gradient added into its .grad). Returns dst."""
    return add_(dst, bias_grad(gy))


# ----------------------------------------------------------------------------- softmax family
# All along the last axis; ops move the axis there first.


@op(fp32_math=True)
def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@op(fp32_math=True)
def softmax_backward(y, gy):
    return y * (gy - (gy * y).sum(axis=-1, keepdims=True))


@op(fp32_math=True)
def log_softmax(x):
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@op(fp32_math=True)
def log_softmax_backward(y, gy):
    return gy - np.exp(y) * gy.sum(axis=-1, keepdims=True)


def _float_logits(logits):
    """16-bit logits (float16, bfloat16) as their exact float32 values; others as they are."""
    logits = np.asarray(logits)
    return copy_(np.empty(logits.shape, np.float32), logits) if logits.dtype in HALVES else logits


@op
def cross_entropy_forward(logits, labels):
    """Mean cross-entropy of (N, C) logits against int labels: (loss as a 0-d array, softmax).
    16-bit logits are read as their exact float values: loss and softmax in float32."""
    logits = _float_logits(logits)
    logp = log_softmax(logits)
    n = logits.shape[0]
    loss = -logp[np.arange(n), labels].sum(dtype=logits.dtype) / logits.dtype.type(n)
    return np.asarray(loss, dtype=logits.dtype), np.exp(logp)


@op(fp32_math=True)
def cross_entropy_backward(probs, labels, gloss, dtype=None):
    """(probs - onehot(labels)) * gloss / N; `dtype`: the logits' 16-bit type for float32
    probs (the gradient rounded once into it, copy_'s bits), else probs' own."""
    n = probs.shape[0]
    g = probs.copy()
    g[np.arange(n), labels] -= 1
    g = g * (gloss / probs.dtype.type(n))
    if dtype is None or np.dtype(dtype) == g.dtype:
        return g
    return copy_(np.empty(g.shape, dtype), g)


@op
def count_correct(logits, labels):
    """Number of rows whose arg-max equals the label, as a 0-d float32 array (no host sync)."""
    hits = (_float_logits(logits).argmax(axis=-1) == labels).sum()
    return np.asarray(hits, dtype=np.float32)


# ----------------------------------------------------------------------------- randomness


@op
def dropout_mask(shape, p, dtype=np.float32):
    """Keep each element with probability 1-p, scaled by 1/(1-p) (inverted dropout); the
    numbers come from the runtime's generator."""
    keep = runtime.rng.random(shape, dtype=np.float32) >= p
    return keep.astype(dtype) * np.dtype(dtype).type(1.0 / (1.0 - p))


# ----------------------------------------------------------------------------- optimizers
# Flat buffers, updated in place. `hyper` is a small device array whose slots the
# optimizer rewrites each step (lr, bias corrections), so a captured graph sees them.
# Slot 3 is the skip flag, written on the device by the non-finite check: when it is
# non-zero the update leaves param and state untouched.
SKIP_SLOT = 3


@op
def sgd_step_(param, grad, buf, hyper, momentum, weight_decay, nesterov, shadow=None):
    """PyTorch SGD: d = g + wd*p; buf = m*buf + d; d = d + m*buf (nesterov) or buf; p -= lr*d.
    `shadow`: a 16-bit copy of param, rewritten from the updated values (copy_'s bits)."""
    if hyper[SKIP_SLOT] != 0:
        return param
    lr = hyper[0]
    d = grad + param.dtype.type(weight_decay) * param if weight_decay else grad
    if momentum:
        buf *= param.dtype.type(momentum)
        buf += d
        d = d + param.dtype.type(momentum) * buf if nesterov else buf
    param -= lr * d
    if shadow is not None:
        copy_(shadow, param)
    return param


@op
def adamw_step_(param, grad, m, v, hyper, beta1, beta2, eps, weight_decay, shadow=None):
    """AdamW with decoupled weight decay; hyper = [lr, 1 - beta1**t, 1 - beta2**t, skip].
    `shadow` as sgd_step_'s."""
    if hyper[SKIP_SLOT] != 0:
        return param
    t = param.dtype.type
    lr, bc1, bc2 = hyper[0], hyper[1], hyper[2]
    param *= 1 - lr * t(weight_decay)
    m *= t(beta1)
    m += t(1 - beta1) * grad
    v *= t(beta2)
    v += t(1 - beta2) * grad * grad
    param -= lr * (m / bc1) / (np.sqrt(v / bc2) + t(eps))
    if shadow is not None:
        copy_(shadow, param)
    return param


@op
def nonfinite_flag_(flag, x):
    """flag (one element) = 1 if it is non-zero or x holds a NaN or an infinity, else 0;
    an empty x only normalises the flag. In place."""
    bad = flag.reshape(-1)[0] != 0 or not np.isfinite(x).all()
    flag.reshape(-1)[0] = 1 if bad else 0
    return flag


@op
def unscale_check_(x, scale, flag):
    """flag as nonfinite_flag_(flag, x) on x as it is (scaled), then x /= scale[0], in place
    (scale: one float32 element; fp16 loss scaling)."""
    nonfinite_flag_(flag, x)
    np.divide(x, x.dtype.type(scale.reshape(-1)[0]), out=x)
    return x


@op
def nonfinite_decide_(flags, decision, count, sticky, state=None, skip=None, interval=1):
    """The non-finite guard's decision after its flags' all-reduce (dptrain.run.nonfinite), in
    place on one-element arrays: d = flags[0] (+ decision[0] if `sticky`) as 0 or 1 (NaN: 1)
    into decision; count += d. With a loss scale ``state`` = [scale, good steps, overflow
    steps] (float32): o = flags[1] as 0 or 1; an overflow halves the scale, restarts the
    good-step count and counts itself, `interval` good steps in a row double the scale; and
    skip = d + o. Returns decision."""
    flat = flags.reshape(-1)
    t = decision.dtype.type
    total = decision.reshape(-1)[0] + flat[0] if sticky else flat[0]
    d = t(0) if total == 0 else t(1)
    decision.reshape(-1)[0] = d
    count.reshape(-1)[0] += d
    if state is not None:
        o = t(0) if flat[1] == 0 else t(1)
        if o:
            state[0] *= np.float32(0.5)
            state[1] = 0
            state[2] += 1
        elif state[1] + 1 >= interval:
            state[0] *= np.float32(2)
            state[1] = 0
        else:
            state[1] += 1
        skip.reshape(-1)[0] = d + o
    return decision


# ----------------------------------------------------------------------------- data


def _channel_affine(images, mean, std):
    """float32 (scale, shift) of x * scale - shift = (x / 255 - mean) / std: scalars, or per
    channel (length C of images (M, C, ...)) shaped to broadcast over a batch."""
    mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    if mean.ndim == 0 and std.ndim == 0:
        return np.float32(1.0 / (255.0 * std)), np.float32(mean / std)
    c = images.shape[1] if images.ndim >= 2 else -1
    if mean.shape not in ((), (c,)) or std.shape not in ((), (c,)):
        raise ValueError(f"gather_normalize: mean and std must be scalars or of length "
                         f"C={c}, got shapes {mean.shape} and {std.shape}")
    mean, std = np.broadcast_to(mean, (c,)), np.broadcast_to(std, (c,))
    where = (c,) + (1,) * (images.ndim - 2)
    return ((1.0 / (255.0 * std)).astype(np.float32).reshape(where),
            (mean / std).astype(np.float32).reshape(where))


# splitmix64 (Steele, Lea, Flood, OOPSLA'14): the augmentation's counter-based hash.
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(z):
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2**64, as intended
        z = np.asarray(z, np.uint64) + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        return z ^ (z >> np.uint64(31))


def augment_draws(seed, counter, index, pad):
    """(dy, dx, flip) for images ``index`` (uint64 array) at step ``counter``: the
    definition kernels/data.cu computes bit for bit. h = splitmix64(splitmix64(splitmix64(
    seed) + counter) + index); dy = (h & 0xFFFFFF) % (2*pad+1), dx = ((h >> 24) & 0xFFFFFF)
    % (2*pad+1), flip = (h >> 48) & 1."""
    with np.errstate(over="ignore"):
        base = _splitmix64(_splitmix64(np.uint64(seed)) + np.uint64(counter))
        h = _splitmix64(np.asarray(index, np.uint64) + base)
    span, low = np.uint64(2 * pad + 1), np.uint64(0xFFFFFF)
    return ((h & low) % span).astype(np.int64), (((h >> np.uint64(24)) & low) % span).astype(
        np.int64), ((h >> np.uint64(48)) & np.uint64(1)).astype(bool)


@op
def augment_crop_flip(x, state, pad, first=0, stride=1):
    """Random crop with zero padding and horizontal flip of a float batch x (B, C, H, W),
    out of place; ``state`` is a uint64 array [seed, counter] that this call advances by
    one (counter += 1), so each call draws anew.

    Image b is cropped at offset (dy, dx) in [0, 2*pad] of x[b] padded by ``pad`` zeros on
    every side, then flipped left-right when ``flip``: out[b, c, i, j] = x[b, c, i + dy - pad,
    j' + dx - pad] with j' = W-1-j when flipped (else j), 0 outside the image. The draws for
    image b are ``augment_draws(seed, counter, first + b * stride, pad)``: a rank passing its
    position in the global batch draws what one process would for that image."""
    if x.ndim != 4:
        raise ValueError(f"augment_crop_flip: x must be (B, C, H, W), got shape {x.shape}")
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or pad < 0:
        raise ValueError(f"augment_crop_flip: pad must be an integer >= 0, got {pad!r}")
    if state.dtype != np.uint64 or state.shape != (2,):
        raise ValueError(f"augment_crop_flip: state must be uint64 (2,), got {state.dtype} "
                         f"{state.shape}")
    B, C, H, W = x.shape
    seed, counter = int(state[0]), int(state[1])
    with np.errstate(over="ignore"):
        index = np.uint64(first) + np.arange(B, dtype=np.uint64) * np.uint64(stride)
    dy, dx, flip = augment_draws(seed, counter, index, pad)
    i = np.arange(H)[None, :] + (dy - pad)[:, None]  # (B, H) source rows
    j = np.arange(W)[None, :]
    j = np.where(flip[:, None], W - 1 - j, j) + (dx - pad)[:, None]  # (B, W) source columns
    inside = ((i >= 0) & (i < H))[:, :, None] & ((j >= 0) & (j < W))[:, None, :]
    b = np.arange(B)[:, None, None]
    out = x[b, :, np.clip(i, 0, H - 1)[:, :, None], np.clip(j, 0, W - 1)[:, None, :]]
    out = np.where(inside[..., None], out, x.dtype.type(0))  # (B, H, W, C)
    state[1] = np.uint64(counter + 1 & 0xFFFFFFFFFFFFFFFF)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))

