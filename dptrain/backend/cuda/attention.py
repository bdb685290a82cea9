"""Launchers of kernels/attention.cu: layer norm over the last axis, the exact GELU, and the
masked softmax of scaled dot-product attention, each with its backward.

Conventions (the .cu file's header has the kernel side; the NumPy reference with the same
signatures is dptrain/backend/cpu/attention.py):
  * Float32 or float64, or float16 / bfloat16 computed in float32 (layer norm's weight,
    bias, mean and rstd then float32), contiguous inputs; outputs are new arrays written
    with `=`.
  * Row ops run one warp per row with fixed shuffle trees; layer norm's weight and bias
    gradients are column sums by reduce.cu (double accumulation, fixed order): every result
    is deterministic, no atomics.
  * attention_forward / attention_backward: scaled dot-product attention of short sequences
    as one kernel each, a block per (batch, head) in shared memory (attention_supported says
    which shapes fit); operands, `out=` and `grads=` are views read and written through their
    strides (the last axis contiguous), so a packed projection's heads need no copies.
  * masked_softmax takes the mask as flags: `causal` and `key_lengths` (a (B,) int32/int64
    device array; a host array is uploaded, which synchronises: pass device arrays inside a
    captured step). No mask tensor is built.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cpu.attention import check_attention_args, check_masked_softmax_args
from dptrain.backend.cuda import launch
from dptrain.backend.cuda.arrays import asarray
from dptrain.backend.cuda.reduce import sum as _sum
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.registry import op

AT = "attention.cu"


def _compute(x):
    """The dtype the kernels compute x's rows in: float32 for 16-bit x, else x's own."""
    return np.dtype(np.float32) if x.dtype in launch.HALVES else x.dtype


def _check_vector(op, name, v, d, x):
    launch.check_float(op, v)
    launch.check_contiguous(op, v)
    if v.dtype != _compute(x):
        raise TypeError(f"cuda.{op}: {name} is {v.dtype}, expected {_compute(x)} for "
                        f"{x.dtype} x")
    if tuple(v.shape) != (d,):
        raise ValueError(f"cuda.{op}: {name} has shape {tuple(v.shape)}, expected ({d},)")


# ----------------------------------------------------------------------------- layer norm


@op
def layer_norm_forward(x, weight, bias, eps=1e-5):
    """(y, mean, rstd): layer norm of x over its last axis; mean, rstd of shape x.shape[:-1].
    16-bit x: weight, bias, mean and rstd are float32 (the math is)."""
    r, d = launch.rows("layer_norm_forward", x, half=True)
    _check_vector("layer_norm_forward", "weight", weight, d, x)
    _check_vector("layer_norm_forward", "bias", bias, d, x)
    a = _compute(x)
    y = launch.new(x.shape, x.dtype)
    mean = launch.new(x.shape[:-1], a)
    rstd = launch.new(x.shape[:-1], a)
    if x.size:
        fn = launch.kernel(AT, "layer_norm_fwd_kernel", launch.ctype(x.dtype))
        launch.grid_stride(fn, r, (y, mean, rstd, x, weight, bias, np.int32(r), np.int32(d),
                                   a.type(eps)), launch.WARPS)
    return y, mean, rstd


@op
def layer_norm_backward(gy, x, weight, mean, rstd):
    """(gx, gweight, gbias) of layer_norm_forward, from its saved mean and rstd; the
    parameter gradients in the weight's dtype."""
    launch.check_float("layer_norm_backward", x, gy, half=True)
    r, d = launch.rows("layer_norm_backward", x, half=True)
    launch.check_contiguous("layer_norm_backward", gy, mean, rstd)
    launch.check_shape("layer_norm_backward", gy, x.shape, "gy")
    launch.check_shape("layer_norm_backward", mean, x.shape[:-1], "mean")
    launch.check_shape("layer_norm_backward", rstd, x.shape[:-1], "rstd")
    _check_vector("layer_norm_backward", "weight", weight, d, x)
    for name, v in (("mean", mean), ("rstd", rstd)):
        if v.dtype != _compute(x):
            raise TypeError(f"cuda.layer_norm_backward: {name} is {v.dtype}, expected "
                            f"{_compute(x)}")
    gx = launch.new(x.shape, x.dtype)
    # rows [gy * xhat | gy]: both parameter gradients from one column sum (one pass and one
    # fold instead of two of each: the ViT's nine layer norms launch these every step)
    sums = launch.new((r, 2 * d), _compute(x))
    if x.size:
        fn = launch.kernel(AT, "layer_norm_bwd_kernel", launch.ctype(x.dtype))
        launch.grid_stride(fn, r, (gx, sums, gy, x, weight, mean, rstd, np.int32(r),
                                   np.int32(d)), launch.WARPS)
    both = _sum(sums, axis=0)
    return gx, both[:d], both[d:]


# ----------------------------------------------------------------------------- GELU


def _flat(op, kernel, *arrays):
    launch.check_float(op, *arrays, half=True)
    launch.check_contiguous(op, *arrays)
    for a in arrays[1:]:
        launch.check_shape(op, a, arrays[0].shape)
    out = launch.new(arrays[0].shape, arrays[0].dtype)
    n = arrays[0].size
    if n:
        fn = launch.kernel(AT, kernel, launch.ctype(arrays[0].dtype))
        launch.grid_stride(fn, n, (out, *arrays, np.int64(n)))
    return out


@op
def gelu(x):
    """x * Phi(x), the exact (erf) GELU."""
    return _flat("gelu", "gelu_fwd_kernel", x)


@op
def gelu_backward(x, gy):
    """gy * (Phi(x) + x phi(x)), from the forward input x."""
    return _flat("gelu_backward", "gelu_bwd_kernel", x, gy)


# ----------------------------------------------------------------------------- masked softmax


def _key_lengths(op, key_lengths):
    """`key_lengths` on the device (None stays None), checked for `op`: int32 or int64,
    contiguous."""
    if key_lengths is None:
        return None
    if not launch.is_cupy(key_lengths):
        key_lengths = asarray(np.asarray(key_lengths))
    if key_lengths.dtype.kind != "i" or key_lengths.itemsize not in (4, 8):
        raise TypeError(f"cuda.{op}: key_lengths must be int32 or int64, "
                        f"got {key_lengths.dtype}")
    launch.check_contiguous(op, key_lengths)
    return key_lengths


@op
def masked_softmax(x, causal=False, key_lengths=None, scale=1.0):
    """softmax(scale * x) over the last axis, keys masked by `causal` (key j > query i) and
    `key_lengths` (keys j >= key_lengths[b] of batch element b) at probability exactly 0."""
    r, c = launch.rows("masked_softmax", x, half=True)
    key_lengths = _key_lengths("masked_softmax", key_lengths)
    check_masked_softmax_args("cuda.masked_softmax", x.shape, causal, key_lengths)
    y = launch.new(x.shape, x.dtype)
    if x.size:
        tq = x.shape[-2] if x.ndim >= 2 else 1
        per_batch = r // x.shape[0] if key_lengths is not None else 1
        lengths = key_lengths if key_lengths is not None else y
        ltype = launch.ctype(key_lengths.dtype) if key_lengths is not None else "int"
        fn = launch.kernel(AT, "masked_softmax_fwd_kernel", launch.ctype(x.dtype), ltype)
        launch.grid_stride(fn, r, (y, x, lengths, np.int32(r), np.int32(c), np.int32(tq),
                                   np.int32(per_batch), np.int32(bool(causal)),
                                   np.int32(key_lengths is not None), _compute(x).type(scale)),
                           launch.WARPS)
    return y


@op
def masked_softmax_backward(y, gy, scale=1.0):
    """scale * y * (gy - sum(gy * y)) over the last axis, from the forward output y."""
    launch.check_float("masked_softmax_backward", y, gy, half=True)
    r, c = launch.rows("masked_softmax_backward", y, half=True)
    launch.check_contiguous("masked_softmax_backward", gy)
    launch.check_shape("masked_softmax_backward", gy, y.shape, "gy")
    gx = launch.new(y.shape, y.dtype)
    if y.size:
        fn = launch.kernel(AT, "masked_softmax_bwd_kernel", launch.ctype(y.dtype))
        launch.grid_stride(fn, r, (gx, y, gy, np.int32(r), np.int32(c), _compute(y).type(scale)),
                           launch.WARPS)
    return gx


# ----------------------------------------------------------------------------- fused attention

# struct AttnGeom / AttnGrads (kernels/attention.cu): element strides over (batch, head, token)
# of q, k, v and the output (forward) or its gradient (backward); then the shape, the mask
# flags and the dropout shard; AttnGrads: the strides of gq, gk, gv.
_STRIDES = [(name, np.int64, (3,)) for name in ("q", "k", "v", "o")]
ATTN_GEOM = np.dtype(_STRIDES + [(name, np.int32) for name in
                                 ("H", "Tq", "Tk", "E", "Ev", "causal", "use_lengths", "rank",
                                  "size")], align=True)
ATTN_GRADS = np.dtype(_STRIDES[:3], align=True)
# Shared memory a block may use: two blocks per SM on an H100 (the kernels wait on loads).
ATTN_SMEM_MAX = 96 * 1024
ATTN_BLOCK = 128


def _attention_smem(tq, tk, e, ev, itemsize) -> int:
    """The backward's dynamic shared memory (the forward needs less): q, k, v, the output
    gradient with row pitch +1, and two (Tq, Tk + 1) tables."""
    return itemsize * (tq * (e + 1) + tk * (e + 1) + tk * (ev + 1) + tq * (ev + 1)
                       + 2 * tq * (tk + 1))


@op
def attention_supported(q_shape, k_shape, v_shape, dtype) -> bool:
    """Whether attention_forward runs these (B, H, T, E) operands: a (batch, head) fits one
    block's shared memory (ATTN_SMEM_MAX) and the blocks one grid."""
    if not len(q_shape) == len(k_shape) == len(v_shape) == 4:
        return False
    dt = np.dtype(dtype)
    if dt not in launch.FLOATS + launch.HALVES:
        return False
    b, h, tq, e = q_shape
    tk, ev = v_shape[2], v_shape[3]
    a = 4 if dt in launch.HALVES else dt.itemsize
    return (_attention_smem(tq, tk, e, ev, a) <= ATTN_SMEM_MAX and 0 < b * h <= launch.INT32_MAX)


def _heads_strides(op, name, a):
    """Element strides over (batch, head, token) of a (B, H, T, E) view whose last axis is
    contiguous."""
    st = launch.estrides(a)
    if a.shape[3] > 1 and st[3] != 1:
        raise ValueError(f"cuda.{op}: {name} must have a contiguous last axis (strides "
                         f"{a.strides})")
    return st[:3]


def _destination(op, name, dst, shape, dtype):
    if dst is None:
        return launch.new(shape, dtype)
    launch.check_arrays(op, dst)
    if tuple(dst.shape) != tuple(shape) or dst.dtype != dtype:
        raise ValueError(f"cuda.{op}: {name} is {dst.dtype} {tuple(dst.shape)}, expected "
                         f"{np.dtype(dtype)} {tuple(shape)}")
    return dst


def _geom(op, q, k, v, o, causal, use_lengths, shard=(0, 1)):
    b, h, tq, e = q.shape
    tk, ev = v.shape[2], v.shape[3]
    launch.check_int32(op, b * h, tq * tk, tq * max(e, ev), tk * max(e, ev))
    return launch.struct(ATTN_GEOM, q=_heads_strides(op, "q", q), k=_heads_strides(op, "k", k),
                         v=_heads_strides(op, "v", v), o=_heads_strides(op, "the output", o),
                         H=h, Tq=tq, Tk=tk, E=e, Ev=ev, causal=int(bool(causal)),
                         use_lengths=int(use_lengths), rank=shard[0], size=shard[1])


def _check_supported(op, q, k, v):
    if not attention_supported(q.shape, k.shape, v.shape, q.dtype):
        raise ValueError(f"cuda.{op}: q {q.shape}, k {k.shape}, v {v.shape} ({q.dtype}) do "
                         f"not fit one block's shared memory ({ATTN_SMEM_MAX} bytes); use the "
                         f"unfused composition (attention_supported is False)")


@op
def attention_forward(q, k, v, scale, causal=False, key_lengths=None, dropout_p=0.0,
                      shard=(0, 1), out=None):
    """(out, probs): softmax(scale q k^T, masked) with dropout, times v, one block per
    (batch, head); out (B, H, Tq, Ev) in q's dtype (a new array, or written into `out`),
    probs (B, H, Tq, Tk) in the compute dtype with dropped weights' sign bit set."""
    launch.check_float("attention_forward", q, k, v, half=True)
    key_lengths = _key_lengths("attention_forward", key_lengths)
    check_attention_args("cuda.attention_forward", q, k, v, causal, key_lengths)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"cuda.attention_forward: dropout_p must be in [0, 1), got {dropout_p}")
    _check_supported("attention_forward", q, k, v)
    b, h, tq, e = q.shape
    tk, ev = v.shape[2], v.shape[3]
    a = _compute(q)
    out = _destination("attention_forward", "out", out, (b, h, tq, ev), q.dtype)
    probs = launch.new((b, h, tq, tk), a)
    if not (out.size or probs.size):
        return out, probs
    rank, size = shard
    geom = _geom("attention_forward", q, k, v, out, causal, key_lengths is not None,
                 (rank, size))
    ltype = launch.ctype(key_lengths.dtype) if key_lengths is not None else "int"
    smem = a.itemsize * ((tq + tk) * (e + 1) + tk * (ev + 1) + tq * (tk + 1))
    fn = launch.kernel(AT, "attention_fwd_kernel", launch.ctype(q.dtype), ltype, smem=smem)
    state = runtime.rng_state if dropout_p else launch.NULL
    lengths = key_lengths if key_lengths is not None else launch.NULL
    fn((b * h,), (ATTN_BLOCK,), (out, probs, q, k, v, lengths, geom, a.type(scale), state,
                                 np.float32(dropout_p), a.type(1.0 / (1.0 - dropout_p))),
       shared_mem=smem)
    if dropout_p:  # the draw covered the global batch: (B * size, H, Tq, Tk) elements
        groups = -(-(b * size * h * tq * tk) // 4)
        launch.kernel("data.cu", "rng_advance_kernel")((1,), (1,), (state, np.uint64(groups)))
    return out, probs


@op
def attention_backward(gout, q, k, v, probs, scale, dropout_p=0.0, grads=None):
    """(gq, gk, gv) of attention_forward from its probs, in q's dtype (new arrays, or
    written into the three views `grads`)."""
    launch.check_float("attention_backward", q, k, v, gout, half=True)
    check_attention_args("cuda.attention_backward", q, k, v, False, None)
    _check_supported("attention_backward", q, k, v)
    b, h, tq, e = q.shape
    tk, ev = v.shape[2], v.shape[3]
    a = _compute(q)
    launch.check_shape("attention_backward", gout, (b, h, tq, ev), "gout")
    launch.check_shape("attention_backward", probs, (b, h, tq, tk), "probs")
    launch.check_contiguous("attention_backward", probs)
    if probs.dtype != a:
        raise TypeError(f"cuda.attention_backward: probs is {probs.dtype}, expected {a}")
    grads = grads or (None,) * 3
    gq, gk, gv = (_destination("attention_backward", name, dst, x.shape, q.dtype)
                  for name, dst, x in zip(("gq", "gk", "gv"), grads, (q, k, v)))
    if not (gq.size or gk.size or gv.size):
        return gq, gk, gv
    geom = _geom("attention_backward", q, k, v, gout, False, False)
    where = launch.struct(ATTN_GRADS, q=_heads_strides("attention_backward", "gq", gq),
                          k=_heads_strides("attention_backward", "gk", gk),
                          v=_heads_strides("attention_backward", "gv", gv))
    smem = _attention_smem(tq, tk, e, ev, a.itemsize)
    fn = launch.kernel(AT, "attention_bwd_kernel", launch.ctype(q.dtype), smem=smem)
    fn((b * h,), (ATTN_BLOCK,), (gq, gk, gv, q, k, v, gout, probs, geom, where, a.type(scale),
                                 a.type(1.0 / (1.0 - dropout_p))), shared_mem=smem)
    return gq, gk, gv
