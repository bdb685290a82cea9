"""The NumPy reference of the transformer ops: layer norm, GELU and the masked softmax of
scaled dot-product attention. Conventions as in ``dptrain/backend/__init__.py``; the CUDA
launchers of the same names are in ``dptrain/backend/cuda/attention.py``.

* ``layer_norm_forward(x, weight, bias, eps)`` normalises over the last axis (D) and returns
  ``(y, mean, rstd)``, mean and rstd of shape x.shape[:-1]; ``layer_norm_backward(gy, x,
  weight, mean, rstd)`` returns ``(gx, gweight, gbias)``.
* ``gelu(x)`` is the exact form x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (PyTorch's default);
  ``gelu_backward(x, gy)`` takes the forward INPUT.
* ``masked_softmax(x, causal=False, key_lengths=None, scale=1.0)``: softmax over the last axis
  (keys) of scale * x, x of shape (B, ..., Tq, Tk); a masked key gets probability exactly 0.
  ``causal`` masks key j > query i (top-left aligned, as PyTorch's is_causal);
  ``key_lengths`` (B,) integers keep keys j < key_lengths[b] of batch element b. A row with
  no key left is all zeros (PyTorch gives NaN there). ``masked_softmax_backward(y, gy,
  scale=1.0)`` takes the forward OUTPUT; masked entries (y == 0) get gradient 0.
* ``attention_forward(q, k, v, scale, causal, key_lengths, dropout_p, shard)``: scaled
  dot-product attention of (B, H, T, E) operands in one op, ``(out, probs)``: the weights are
  the masked softmax above, dropped out over the global batch as the Dropout op draws it
  (``shard`` = (rank, size): rows rank::size of the (B * size, ...) draw). ``probs`` (B, H,
  Tq, Tk, compute dtype) is what ``attention_backward(gout, q, k, v, probs, scale,
  dropout_p)`` needs: the softmax, its sign bit set where dropout dropped the weight.
  ``attention_supported(q_shape, k_shape, v_shape, dtype)`` says whether a backend runs these
  operands as one op (the CUDA kernels hold a (batch, head) in shared memory). Operands may
  be views (the heads of a packed projection); ``out=`` and ``grads=`` (views too) receive
  the output and the three gradients in place, so packed layouts need no copies.
"""
from __future__ import annotations

import math

import numpy as np
from numpy.polynomial import chebyshev as _cheb

from dptrain.backend.cpu.ops import dropout_mask
from dptrain.backend.registry import op

# ----------------------------------------------------------------------------- erf
# NumPy has no erf. Chebyshev interpolants of math.erf / math.erfc, fitted once at import
# (Chebyshev nodes, a few hundred math.erf calls):
#   erf(x)         float64 inputs: erf(x) / x in u = x^2 on |x| <= 1, and erfcx(x) =
#                  exp(x^2) erfc(x) in s = 1/x on 1 <= |x| <= 6; beyond 6, erf = +-1 in
#                  float64. Relative error about 2e-15 over the whole line.
#   erf_float32(x) float32 inputs (7x faster, for training): erf(x) / x in u = x^2 on
#                  |x| <= 4 as one degree-16 polynomial evaluated by Horner in float64,
#                  clipped to [-1, 1]; absolute error 1e-8, under float32's resolution.
# Both are checked against math.erf in the tests.

_S_LO = 1.0 / 6.0


def _fit_small(t):
    x = np.sqrt((t + 1.0) / 2.0)
    return np.array([math.erf(v) / v if v > 0 else 2.0 / math.sqrt(math.pi) for v in x])


def _fit_large(t):
    x = 1.0 / ((t + 1.0) / 2.0 * (1.0 - _S_LO) + _S_LO)
    return np.array([math.exp(v * v) * math.erfc(v) for v in x])


_ERF_SMALL = _cheb.chebinterpolate(_fit_small, 12)
_ERF_LARGE = _cheb.chebinterpolate(_fit_large, 20)


_U32 = 16.0  # u = x^2 range of the float32 fit (|x| <= 4; erf(4) = 1 - 1.5e-8)


def _fit_float32(t):
    x = np.sqrt((t + 1.0) / 2.0 * _U32)
    return np.array([math.erf(v) / v if v > 0 else 2.0 / math.sqrt(math.pi) for v in x])


_ERF_F32 = _cheb.cheb2poly(_cheb.chebinterpolate(_fit_float32, 16))[::-1].tolist()


def erf_float32(x):
    """erf to float32 accuracy (absolute error 1e-8), computed in float64."""
    x = np.asarray(x, dtype=np.float64)
    t = np.minimum(np.square(x), _U32)
    t *= 2.0 / _U32
    t -= 1.0
    acc = np.full_like(t, _ERF_F32[0])
    for a in _ERF_F32[1:]:
        acc *= t
        acc += a
    acc *= x
    return np.clip(acc, -1.0, 1.0, out=acc)


def erf(x):
    """erf of a float array, computed in float64 (returned in float64)."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    small = ax <= 1.0
    out = np.empty_like(x)
    xs = x[small]
    out[small] = xs * _cheb.chebval(2.0 * xs * xs - 1.0, _ERF_SMALL)
    big = ~small
    ab = np.minimum(ax[big], 6.0)
    t = (1.0 / ab - _S_LO) / (1.0 - _S_LO) * 2.0 - 1.0
    erfc = np.exp(-ab * ab) * _cheb.chebval(t, _ERF_LARGE)
    out[big] = np.copysign(np.where(ax[big] >= 6.0, 1.0, 1.0 - erfc), x[big])
    return out


# ----------------------------------------------------------------------------- layer norm


def _up(a):
    """float16 as float32 (the math of 16-bit activations), other arrays as they are."""
    return a.astype(np.float32) if a.dtype == np.float16 else a


@op
def layer_norm_forward(x, weight, bias, eps=1e-5):
    """y = (x - mean) * rstd * weight + bias over the last axis; also mean and rstd. float16
    x: computed in float32 (weight and bias float32), y rounded to float16, mean and rstd
    float32."""
    xf = _up(x)
    t = xf.dtype.type
    mean = xf.mean(axis=-1, keepdims=True)
    xc = xf - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    rstd = t(1) / np.sqrt(var + t(eps))
    y = xc * rstd * weight + bias
    return y.astype(x.dtype), mean[..., 0].copy(), rstd[..., 0].copy()


@op
def layer_norm_backward(gy, x, weight, mean, rstd):
    """(gx, gweight, gbias) of layer_norm_forward, from its saved mean and rstd; float16
    gy and x: computed in float32, gx rounded to float16, the parameter gradients float32."""
    gy16, gy, x = gy, _up(gy), _up(x)
    d = x.shape[-1]
    mean, rstd = mean[..., None], rstd[..., None]
    xhat = (x - mean) * rstd
    g = gy * weight
    gx = rstd * (g - g.mean(axis=-1, keepdims=True)
                 - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    rows = gy.reshape(-1, d)
    gw = (rows * xhat.reshape(-1, d)).sum(axis=0)
    gb = rows.sum(axis=0)
    return np.ascontiguousarray(gx.astype(gy16.dtype)), gw, gb


# ----------------------------------------------------------------------------- GELU

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _cdf(x):
    """Phi(x) = 0.5 (1 + erf(x / sqrt 2)) in float64 (the float32 erf for float32 x)."""
    z = x.astype(np.float64) * _INV_SQRT2
    phi = erf_float32(z) if x.dtype == np.float32 else erf(z)
    phi += 1.0
    phi *= 0.5
    return phi


@op
def gelu(x):
    """x * Phi(x), the exact (erf) GELU; computed in float64, returned in x's dtype."""
    return (x * _cdf(x)).astype(x.dtype)


@op
def gelu_backward(x, gy):
    """gy * (Phi(x) + x phi(x)), from the forward input x."""
    x64 = x.astype(np.float64)
    d = np.exp(-0.5 * x64 * x64)
    d *= x64 * _INV_SQRT_2PI
    d += _cdf(x)
    return (gy * d).astype(x.dtype)


# ----------------------------------------------------------------------------- masked softmax


def _keep_mask(shape, causal, key_lengths):
    """Boolean mask (broadcastable to `shape`) of the keys each row may attend to, or None."""
    keep = None
    tk = shape[-1]
    cols = np.arange(tk)
    if causal:
        tq = shape[-2]
        keep = cols[None, :] <= np.arange(tq)[:, None]  # (Tq, Tk)
    if key_lengths is not None:
        lengths = np.asarray(key_lengths).astype(np.int64).reshape((-1,) + (1,) * (len(shape) - 1))
        by_len = cols < lengths  # (B, 1, ..., 1, Tk)
        keep = by_len if keep is None else keep & by_len
    return keep


def check_masked_softmax_args(op, shape, causal, key_lengths):
    """The checks shared by both backends (raise ValueError naming the op)."""
    if len(shape) < 2 and (causal or key_lengths is not None):
        raise ValueError(f"{op}: a mask needs x of at least 2 dims (queries, keys), got {shape}")
    if key_lengths is not None and tuple(key_lengths.shape) != (shape[0],):
        raise ValueError(f"{op}: key_lengths has shape {tuple(key_lengths.shape)}, expected "
                         f"({shape[0]},) (one length per batch element)")


@op(fp32_math=True)
def masked_softmax(x, causal=False, key_lengths=None, scale=1.0):
    """softmax(scale * x) over the last axis with masked keys at probability 0 (see above)."""
    if key_lengths is not None:
        key_lengths = np.asarray(key_lengths)
    check_masked_softmax_args("masked_softmax", x.shape, causal, key_lengths)
    z = x * x.dtype.type(scale)
    keep = _keep_mask(x.shape, causal, key_lengths)
    if keep is None:
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    keep = np.broadcast_to(keep, x.shape)
    masked = np.where(keep, z, -np.inf)
    m = masked.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(x.dtype)
    e = np.where(keep, np.exp(np.where(keep, z - m, 0)), 0).astype(x.dtype)
    s = e.sum(axis=-1, keepdims=True)
    return e / np.where(s > 0, s, 1).astype(x.dtype)


@op(fp32_math=True)
def masked_softmax_backward(y, gy, scale=1.0):
    """scale * y * (gy - sum(gy * y)) over the last axis: 0 wherever y is 0 (masked)."""
    t = y.dtype.type
    return t(scale) * (y * (gy - (gy * y).sum(axis=-1, keepdims=True)))


# ----------------------------------------------------------------------------- fused attention


def check_attention_args(op, q, k, v, causal, key_lengths):
    """The checks shared by both backends (raise naming the op)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{op}: q, k and v must be (batch, heads, tokens, features), got "
                         f"{q.shape}, {k.shape} and {v.shape}")
    if (q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2] or q.shape[3] != k.shape[3]
            or k.shape[2] != v.shape[2]):
        raise ValueError(f"{op}: q {q.shape}, k {k.shape} and v {v.shape} do not fit")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{op}: q, k and v differ in dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    check_masked_softmax_args(op, q.shape[:3] + k.shape[2:3], causal, key_lengths)


@op
def attention_supported(q_shape, k_shape, v_shape, dtype) -> bool:
    """Whether attention_forward takes operands of these shapes and dtype: (B, H, T, E) ones."""
    return len(q_shape) == len(k_shape) == len(v_shape) == 4


@op
def attention_forward(q, k, v, scale, causal=False, key_lengths=None, dropout_p=0.0,
                      shard=(0, 1), out=None):
    """(out, probs): masked_softmax(q k^T, causal, key_lengths, scale), dropped out, times v
    (see the module docstring); out in q's dtype (written into `out` when given), probs in
    the compute dtype."""
    if key_lengths is not None:
        key_lengths = np.asarray(key_lengths)
    check_attention_args("attention_forward", q, k, v, causal, key_lengths)
    qf, kf, vf = _up(q), _up(k), _up(v)
    w = masked_softmax(qf @ np.swapaxes(kf, -1, -2), causal, key_lengths, scale)
    probs = w
    if dropout_p:
        rank, size = shard
        mask = dropout_mask((q.shape[0] * size,) + w.shape[1:], dropout_p, w.dtype)[rank::size]
        probs = np.where(mask != 0, w, -w)  # -0.0 marks a dropped 0
        w = w * mask
    return _into(out, w @ vf, q), probs


@op
def attention_backward(gout, q, k, v, probs, scale, dropout_p=0.0, grads=None):
    """(gq, gk, gv) of attention_forward from its probs, in q's dtype (written into the three
    arrays `grads` when given)."""
    g, qf, kf, vf = _up(gout), _up(q), _up(k), _up(v)
    t = probs.dtype.type
    keep, w = ~np.signbit(probs), np.abs(probs)
    keep_scale = t(1.0 / (1.0 - dropout_p))
    gv = np.swapaxes(np.where(keep, w * keep_scale, t(0)), -1, -2) @ g
    dw = np.where(keep, (g @ np.swapaxes(vf, -1, -2)) * keep_scale, t(0))
    ds = w * (dw - (w * dw).sum(axis=-1, keepdims=True)) * t(scale)
    gq, gk = ds @ kf, np.swapaxes(ds, -1, -2) @ qf
    return tuple(_into(dst, r, q) for dst, r in zip(grads or (None,) * 3, (gq, gk, gv)))


def _into(dst, result, like):
    """`result` in `like`'s dtype: a new array, or written into `dst`."""
    if dst is None:
        return result.astype(like.dtype)
    if dst.shape != result.shape or dst.dtype != like.dtype:
        raise ValueError(f"attention: the destination is {dst.dtype} {dst.shape}, expected "
                         f"{like.dtype} {result.shape}")
    dst[...] = result
    return dst
