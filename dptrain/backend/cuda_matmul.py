"""Launchers for the matrix kernels: kernels/gemm.cu (matmul) and kernels/conv2d.cu (conv2d).

Each function has the semantics of its namesake in ``dptrain.backend.cpu`` and:
  * asserts shapes, dtype (float32) and C-contiguity, with messages that name the argument;
  * allocates its result with ``cupy.empty`` (the memory pool), or writes into ``out=``;
  * launches on the current CuPy stream and never synchronises with the host, so a training
    step built from these can be captured in a CUDA graph;
  * passes every scalar as np.int32 / np.int64 / np.float32 (CuPy would pass Python ints as
    64-bit, which the kernels do not expect).

The checks and the launch configuration are worked out once per distinct call signature
(shapes, dtypes, contiguity, 16-byte alignment, strides, precision) and kept as a plan, so a
repeated call costs the allocations and the launches only: eager steps are launch-bound.

Precision: "tf32" (tensor cores, fp32 accumulate; operands rounded to tf32) or "fp32" (FFMA).
The default is "tf32" on compute capability >= 8.0, else "fp32"; ``set_precision`` changes it
for every later call in the process.

Hopper fast path (kernels/gemm_wgmma.cu, wgmma.mma_async, sm_90a): a "tf32" matmul runs there
when the device is compute capability 9.0, the environment does not set DPTRAIN_WGMMA=0 (read
when a plan is built), and the call has its shape: a @ b^T (trans_a False, trans_b True: the
only layout wgmma takes for tf32, both operands K-major), M % 128 == 0, N % 256 == 0,
K % 32 == 0, a, b 16-byte aligned, and at least as many 128 x 256 output tiles as SMs
(smaller problems keep the split-K kernel). `matmul_kernel` names the kernel a call uses.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os

import cupy
import numpy as np

from dptrain.backend import kernels

PRECISIONS = ("tf32", "fp32")
_precision: str | None = None
_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535
WGMMA_ENV = "DPTRAIN_WGMMA"  # "0" turns the Hopper wgmma path off
_WGMMA_DEFAULT = True  # on where it applies, unless the environment says "0"
_WGMMA_BM, _WGMMA_BN, _WGMMA_BK, _WGMMA_SMEM = 128, 256, 32, 4 * 48 * 1024 + 1024


def get_precision() -> str:
    """The precision matmul and conv2d use now: "tf32" or "fp32"."""
    global _precision
    if _precision is None:
        _precision = "tf32" if int(cupy.cuda.Device().compute_capability) >= 80 else "fp32"
    return _precision


def set_precision(p: str) -> None:
    """Use precision `p` ("tf32" or "fp32") for every later matmul and conv2d."""
    global _precision
    if p not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {p!r}")
    if p == "tf32" and int(cupy.cuda.Device().compute_capability) < 80:
        raise ValueError("tf32 needs a GPU of compute capability >= 8.0")
    _precision = p


@contextlib.contextmanager
def precision(p: str):
    """Temporarily switch precision: ``with precision("fp32"): ...``."""
    old = get_precision()
    set_precision(p)
    try:
        yield
    finally:
        set_precision(old)


# ----------------------------------------------------------------------------- plumbing


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _sms() -> int:
    return _sm_count(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _kernel(filename: str, name: str, smem_bytes: int):
    """Kernel `name` of kernels/`filename`, allowed `smem_bytes` of dynamic shared memory."""
    fn = kernels.function(filename, name)
    if smem_bytes > 48 * 1024:  # above 48 KB a kernel must opt in
        fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn


def _tile_floats(bmn: int, bk: int, kmajor: bool, pad: int) -> int:
    """Floats in one shared-memory operand tile: TileLayout::kSize in gemm_tiles.cuh."""
    return bmn * (bk + pad) if kmajor else bk * (bmn + pad)


def _i32(v) -> np.int32:
    if not -(2**31) <= v <= _INT32_MAX:
        raise ValueError(f"value {v} does not fit the kernels' 32-bit indices")
    return np.int32(v)


def _check(fn: str, name: str, a, ndim=None) -> None:
    if not isinstance(a, cupy.ndarray):
        raise TypeError(f"{fn}: {name} must be a cupy.ndarray, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{fn}: {name} must be float32, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous (use cupy.ascontiguousarray)")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {a.shape}")
    if a.size > _INT32_MAX:
        raise ValueError(f"{fn}: {name} has {a.size} elements; the kernels index with int32")


def _sig(fn: str, name: str, a):
    """What a launch plan depends on: shape, dtype, contiguity and 16-byte alignment of `a`."""
    if a is None:
        return None
    if type(a) is not cupy.ndarray:
        _check(fn, name, a)  # raises for anything but a CuPy array (or subclass)
    return a.shape, a.dtype, a.flags.c_contiguous, a.data.ptr % 16 == 0


_PLANS: dict = {}


def _plan(key, build):
    """The cached plan for `key`; build() validates the arguments and makes it on a miss."""
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        plan = _PLANS[key] = build()
    return plan


def _output(fn: str, out, shape) -> cupy.ndarray:
    if out is None:
        return cupy.empty(shape, dtype=np.float32)
    _check(fn, "out", out)
    if out.shape != shape:
        raise ValueError(f"{fn}: out has shape {out.shape}, expected {shape}")
    return out


def _aligned(a: cupy.ndarray, ld: int, stride: int) -> bool:
    """True when rows of `a` may be moved in 16-byte chunks."""
    return ld % 4 == 0 and stride % 4 == 0 and a.data.ptr % 16 == 0


def _chunks(k: int, splits: int) -> tuple[int, int]:
    """(splits, chunk): chunk a multiple of 32 (every tile's BK), no split left empty."""
    chunk = -(-(-(-k // splits)) // 32) * 32
    return -(-k // chunk), chunk


def _split_k(tiles: int, k: int, min_chunk: int, max_splits: int) -> tuple[int, int]:
    """(splits, chunk): split K when the tiles alone leave SMs idle, aiming at two blocks per
    SM, each on >= min_chunk of K. Split s covers K range [s*chunk, (s+1)*chunk)."""
    if tiles >= _sms():
        return 1, k
    splits = min(-(-2 * _sms() // max(tiles, 1)), k // min_chunk, max_splits)
    return _chunks(k, splits) if splits > 1 else (1, k)


def _reducer(file, splits, batch, m, n, ldc, sc, bias_mode):
    """Launch of splitk_reduce_kernel: c = sum of the partials in ws, in split order (+ bias)."""
    fn = _kernel(file, "splitk_reduce_kernel<float>", 0)
    grid = (max(1, min(-(-batch * m * n // 256), _sms() * 8)),)
    tail = (_i32(splits), _i32(batch), _i32(m), _i32(n), _i32(ldc), np.int64(sc),
            np.float32(1.0), np.float32(0.0), _i32(bias_mode))
    return lambda ws, c, bias: fn(grid, (256,), (ws, c, bias) + tail)


# ----------------------------------------------------------------------------- matmul


def _batch_shape(fn: str, ba: tuple, bb: tuple) -> tuple:
    """Result batch shape for the cases we support: equal, or one side all ones / absent."""
    if ba == bb:
        return ba
    if math.prod(bb) == 1 and len(bb) <= len(ba):
        return ba
    if math.prod(ba) == 1 and len(ba) <= len(bb):
        return bb
    raise NotImplementedError(
        f"{fn}: batch shapes {ba} and {bb} need general broadcasting; supported are equal "
        "batch shapes and a 2-D (or all-ones batch) operand against a batched one"
    )


def _wgmma_enabled() -> bool:
    v = os.environ.get(WGMMA_ENV)
    return _WGMMA_DEFAULT if v is None else v.strip() != "0"


@functools.lru_cache(maxsize=None)
def _is_sm90(device_id: int) -> bool:
    return int(cupy.cuda.Device(device_id).compute_capability) == 90


def _wgmma_fits(a, b, ta, tb, m, n, k, nb, s_a) -> bool:
    """True when gemm_wgmma.cu may compute this product (see the module docstring)."""
    return (get_precision() == "tf32" and not ta and tb and _wgmma_enabled()
            and _is_sm90(cupy.cuda.Device().id)
            and m % _WGMMA_BM == 0 and n % _WGMMA_BN == 0 and k % _WGMMA_BK == 0 and k > 0
            and a.data.ptr % 16 == 0 and b.data.ptr % 16 == 0
            and nb * (m // _WGMMA_BM) * (n // _WGMMA_BN) >= _sms()
            and (m // _WGMMA_BM) * (n // _WGMMA_BN) <= _INT32_MAX and nb <= _GRID_YZ_MAX)


def matmul_kernel(a, b, trans_a=False, trans_b=False, *, bias=None) -> str:
    """The name of the kernel that matmul(a, b, trans_a, trans_b, bias=bias) launches."""
    ta, tb = bool(trans_a), bool(trans_b)
    key = ("matmul", _sig("matmul", "a", a), _sig("matmul", "b", b), ta, tb,
           _sig("matmul", "bias", bias), get_precision())
    return _plan(key, lambda: _plan_matmul(a, b, ta, tb, bias)).kernel


def matmul(a, b, trans_a=False, trans_b=False, *, bias=None, out=None):
    """a @ b over the last two axes (either operand transposed first); batch axes broadcast.

    `bias` (N,) is added to every row of the result (y = x W^T + b in one pass).
    """
    ta, tb = bool(trans_a), bool(trans_b)
    key = ("matmul", _sig("matmul", "a", a), _sig("matmul", "b", b), ta, tb,
           _sig("matmul", "bias", bias), get_precision())
    return _plan(key, lambda: _plan_matmul(a, b, ta, tb, bias))(a, b, bias, out)


def _plan_matmul(a, b, ta, tb, bias):
    _check("matmul", "a", a)
    _check("matmul", "b", b)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul: operands must be at least 2-D, got {a.shape} and {b.shape}")
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if tb else (b.shape[-2], b.shape[-1])
    if k != kb:
        raise ValueError(
            f"matmul: inner sizes differ: a{' (transposed)' if ta else ''} {a.shape} "
            f"and b{' (transposed)' if tb else ''} {b.shape}"
        )
    batch_shape = _batch_shape("matmul", a.shape[:-2], b.shape[:-2])
    out_shape = tuple(int(s) for s in batch_shape + (m, n))
    nb = math.prod(batch_shape)
    bias_mode = 0
    if bias is not None:
        _check("matmul", "bias", bias, ndim=1)
        if bias.shape[0] != n:
            raise ValueError(f"matmul: bias has shape {bias.shape}, expected ({n},)")
        bias_mode = 1
    if nb == 0 or m == 0 or n == 0:
        empty = lambda a, b, bias, out: _output("matmul", out, out_shape)  # noqa: E731
        empty.kernel = "none"
        return empty

    s_a = m * k if a.ndim > 2 and math.prod(a.shape[:-2]) == nb and nb > 1 else 0
    s_b = k * n if b.ndim > 2 and math.prod(b.shape[:-2]) == nb and nb > 1 else 0
    if s_b == 0 and not ta and nb > 1 and s_a:
        m, nb, s_a = m * nb, 1, 0  # (batch, M, K) @ (K, N) is one (batch*M, K) @ (K, N)
    lda, ldb, ldc, s_c = a.shape[-1], b.shape[-1], n, m * n
    if _wgmma_fits(a, b, ta, tb, m, n, k, nb, s_a):
        return _plan_wgmma(m, n, k, nb, s_a, s_b, bias_mode, out_shape)
    if m > 128 * _GRID_YZ_MAX:
        raise ValueError(f"matmul: M = {m} exceeds the grid's limit of {128 * _GRID_YZ_MAX}")

    splits, chunk = _split_k(-(-m // 128) * -(-n // 128) * nb, k, 256, 64)
    if nb * splits > _GRID_YZ_MAX:
        if nb > _GRID_YZ_MAX:
            raise ValueError(f"matmul: batch {nb} exceeds the grid's limit of {_GRID_YZ_MAX}")
        splits, chunk = 1, k
    ws_shape = (splits, nb, m, n)

    flags = f"{str(ta).lower()}, {str(tb).lower()}"
    if get_precision() == "tf32":
        smem = 3 * 4 * (_tile_floats(128, 32, not ta, 8 if ta else 4)
                        + _tile_floats(128, 32, tb, 4 if tb else 8))
        fn, block = _kernel("gemm.cu", f"gemm_tf32_kernel<float, {flags}>", smem), (128,)
    else:
        smem = 3 * 4 * 2 * _tile_floats(128, 16, False, 4)
        fn, block = _kernel("gemm.cu", f"gemm_fp32_kernel<float, {flags}>", smem), (256,)
    grid = (-(-n // 128), -(-m // 128), nb * splits)
    tail = (_i32(m), _i32(n), _i32(k), _i32(lda), _i32(ldb), _i32(ldc),
            np.int64(s_a), np.int64(s_b), np.int64(s_c), _i32(nb), _i32(splits), _i32(chunk),
            np.float32(1.0), np.float32(0.0), _i32(bias_mode),
            _i32(_aligned(a, lda, s_a)), _i32(_aligned(b, ldb, s_b)))
    reduce = _reducer("gemm.cu", splits, nb, m, n, ldc, s_c, bias_mode) if splits > 1 else None

    def run(a, b, bias, out):
        c = _output("matmul", out, out_shape)
        ws = cupy.empty(ws_shape, dtype=np.float32) if reduce else c
        bias = c if bias is None else bias
        fn(grid, block, (a, b, c, bias, ws) + tail, shared_mem=smem)
        if reduce:
            reduce(ws, c, bias)
        return c

    run.kernel = "gemm_tf32_kernel" if get_precision() == "tf32" else "gemm_fp32_kernel"
    return run


def _plan_wgmma(m, n, k, nb, s_a, s_b, bias_mode, out_shape):
    """C = A @ B^T by gemm_wgmma.cu: one block per 128 x 256 tile, batch in grid z."""
    fn = _kernel("gemm_wgmma.cu", "gemm_wgmma_tf32_kernel<float>", _WGMMA_SMEM)
    grid = ((m // _WGMMA_BM) * (n // _WGMMA_BN), 1, nb)
    tail = (_i32(m), _i32(n), _i32(k), np.int64(s_a), np.int64(s_b), np.int64(m * n),
            _i32(bias_mode))

    def run(a, b, bias, out):
        c = _output("matmul", out, out_shape)
        # The kernel stores float2 pairs: an `out=` view at an odd float offset gets a copy.
        dst = c if c.data.ptr % 8 == 0 else cupy.empty(out_shape, dtype=np.float32)
        fn(grid, (256,), (a, b, dst, dst if bias is None else bias) + tail,
           shared_mem=_WGMMA_SMEM)
        if dst is not c:
            c[...] = dst
        return c

    run.kernel = "gemm_wgmma_tf32_kernel"
    return run


# ----------------------------------------------------------------------------- conv2d


def _pair(fn: str, name: str, v) -> tuple[int, int]:
    if (not isinstance(v, (tuple, list)) or len(v) != 2
            or not all(isinstance(i, (int, np.integer)) for i in v)):
        raise ValueError(f"{fn}: {name} must be an (h, w) pair of ints, got {v!r}")
    return int(v[0]), int(v[1])


def _key(v):
    """A hashable stand-in for a stride / padding / shape argument (validated later)."""
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _out_size(fn, n, k, s, p, axis):
    o = (n + 2 * p - k) // s + 1 if s >= 1 else 0
    if s < 1 or p < 0 or o < 1:
        raise ValueError(f"{fn}: size {n}, kernel {k}, stride {s}, padding {p} along {axis} "
                         "give no output")
    return o


def _rows_tile(m: int) -> int:
    """Block tile along the output channels: the smallest of 32/64/128 that covers m."""
    return 32 if m <= 32 else 64 if m <= 64 else 128


def _plan_implicit(fn_name, mode, out_shape, m, c, hs, ws, ho, wo, kh, kw, stride, padding,
                   w_sm, w_sc):
    """Forward (mode 0) or backward-data (mode 1): out[n, m, p] = sum wgt * src (conv2d.cu).

    The plan runs two kernels: the weight, reordered to the GEMM's (kh, kw, c) K order, then
    the implicit GEMM. run(w, src, bias, out) -> out.
    """
    nb = out_shape[0]
    npix, k = nb * ho * wo, kh * kw * c
    if npix == 0 or m == 0:
        return lambda w, src, bias, out: _output(fn_name, out, out_shape)
    reorder = _kernel("conv2d.cu", "conv2d_weight_reorder_kernel<float>", 0)
    r_grid = (max(1, min(-(-m * k // 256), _sms() * 4)),)
    r_tail = (_i32(m), _i32(c), _i32(kh * kw), _i32(w_sm), _i32(w_sc))
    bm = _rows_tile(m)
    if get_precision() == "tf32":
        smem = 3 * 4 * (_tile_floats(bm, 32, True, 4) + _tile_floats(128, 32, False, 8))
        fn, block = _kernel("conv2d.cu", f"conv2d_tf32_kernel<float, {bm}>", smem), (128,)
    else:
        smem = 4 * 4 * (_tile_floats(bm, 8, False, 4) + _tile_floats(128, 8, False, 4))
        fn, block = _kernel("conv2d.cu", f"conv2d_fp32_kernel<float, {bm}>", smem), (256,)
    grid = (-(-npix // 128), -(-m // bm))
    (sh, sw), (ph, pw) = stride, padding
    tail = (_i32(nb), _i32(m), _i32(c), _i32(hs), _i32(ws), _i32(ho), _i32(wo), _i32(kh),
            _i32(kw), _i32(sh), _i32(sw), _i32(ph), _i32(pw), _i32(k % 4 == 0), _i32(mode))

    def run(w, src, bias, out):
        y = _output(fn_name, out, out_shape)
        wr = cupy.empty((m, k), dtype=np.float32)
        if k:
            reorder(r_grid, (256,), (w, wr) + r_tail)
        has_bias = bias is not None
        fn(grid, block, (wr, src, bias if has_bias else y, y, np.int32(has_bias)) + tail,
           shared_mem=smem)
        return y

    return run


def conv2d_forward(x, w, b, stride, padding, *, out=None):
    """y[n, co] = sum over (ci, kh, kw) of w[co, ci, kh, kw] * x[n, ci, shifted] (+ b[co])."""
    f = "conv2d_forward"
    key = (f, _sig(f, "x", x), _sig(f, "w", w), _sig(f, "b", b), _key(stride), _key(padding),
           get_precision())
    return _plan(key, lambda: _plan_forward(x, w, b, stride, padding))(w, x, b, out)


def _plan_forward(x, w, b, stride, padding):
    f = "conv2d_forward"
    _check(f, "x", x, 4)
    _check(f, "w", w, 4)
    (sh, sw), (ph, pw) = _pair(f, "stride", stride), _pair(f, "padding", padding)
    n, c, h, wd = x.shape
    cout, cin, kh, kw = w.shape
    if cin != c:
        raise ValueError(f"{f}: x has {c} channels but w {w.shape} expects {cin}")
    if b is not None:
        _check(f, "b", b, 1)
        if b.shape[0] != cout:
            raise ValueError(f"{f}: b has shape {b.shape}, expected ({cout},)")
    ho, wo = _out_size(f, h, kh, sh, ph, "H"), _out_size(f, wd, kw, sw, pw, "W")
    return _plan_implicit(f, 0, (n, cout, ho, wo), cout, c, h, wd, ho, wo, kh, kw, (sh, sw),
                          (ph, pw), cin * kh * kw, kh * kw)


def conv2d_backward_data(gy, w, x_shape, stride, padding, *, out=None):
    """Gradient of conv2d_forward with respect to x, of shape x_shape."""
    f = "conv2d_backward_data"
    key = (f, _sig(f, "gy", gy), _sig(f, "w", w), _key(x_shape), _key(stride), _key(padding),
           get_precision())
    return _plan(key, lambda: _plan_backward_data(gy, w, x_shape, stride, padding))(
        w, gy, None, out)


def _plan_backward_data(gy, w, x_shape, stride, padding):
    f = "conv2d_backward_data"
    _check(f, "gy", gy, 4)
    _check(f, "w", w, 4)
    (sh, sw), (ph, pw) = _pair(f, "stride", stride), _pair(f, "padding", padding)
    n, c, h, wd = (int(s) for s in x_shape)
    cout, cin, kh, kw = w.shape
    if cin != c:
        raise ValueError(f"{f}: x_shape {tuple(x_shape)} has {c} channels, w {w.shape} {cin}")
    ho, wo = _out_size(f, h, kh, sh, ph, "H"), _out_size(f, wd, kw, sw, pw, "W")
    if gy.shape != (n, cout, ho, wo):
        raise ValueError(f"{f}: gy has shape {gy.shape}, expected {(n, cout, ho, wo)}")
    return _plan_implicit(f, 1, (n, c, h, wd), c, cout, ho, wo, h, wd, kh, kw, (sh, sw),
                          (ph, pw), kh * kw, cin * kh * kw)


def conv2d_backward_weight(x, gy, w_shape, stride, padding, *, out=None):
    """Gradient of conv2d_forward with respect to w, of shape w_shape; bitwise repeatable."""
    f = "conv2d_backward_weight"
    key = (f, _sig(f, "x", x), _sig(f, "gy", gy), _key(w_shape), _key(stride), _key(padding),
           get_precision())
    return _plan(key, lambda: _plan_backward_weight(x, gy, w_shape, stride, padding))(
        x, gy, out)


def _plan_backward_weight(x, gy, w_shape, stride, padding):
    f = "conv2d_backward_weight"
    _check(f, "x", x, 4)
    _check(f, "gy", gy, 4)
    (sh, sw), (ph, pw) = _pair(f, "stride", stride), _pair(f, "padding", padding)
    n, c, h, wd = x.shape
    cout, cin, kh, kw = (int(s) for s in w_shape)
    if cin != c:
        raise ValueError(f"{f}: x has {c} channels but w_shape {tuple(w_shape)} expects {cin}")
    ho, wo = _out_size(f, h, kh, sh, ph, "H"), _out_size(f, wd, kw, sw, pw, "W")
    if gy.shape != (n, cout, ho, wo):
        raise ValueError(f"{f}: gy has shape {gy.shape}, expected {(n, cout, ho, wo)}")
    out_shape = (cout, cin, kh, kw)
    m, ncol, k = cout, cin * kh * kw, n * ho * wo
    if m == 0 or ncol == 0:
        return lambda x, gy, out: _output(f, out, out_shape)
    bm, bn = _rows_tile(m), 32 if ncol <= 32 else 128
    if -(-m // bm) > _GRID_YZ_MAX:
        raise ValueError(f"{f}: {m} output channels exceed the grid's limit")
    splits, chunk = _split_k(-(-m // bm) * -(-ncol // bn), k, 512, 1024)
    if get_precision() == "tf32":
        smem = 3 * 4 * (_tile_floats(bm, 32, True, 4) + _tile_floats(bn, 32, True, 4))
        name = f"conv2d_bwdw_tf32_kernel<float, {bm}, {bn}>"
    else:
        smem = 4 * 4 * (_tile_floats(bm, 8, False, 4) + _tile_floats(bn, 8, False, 4))
        name = f"conv2d_bwdw_fp32_kernel<float, {bm}, {bn}>"
    fn = _kernel("conv2d.cu", name, smem)
    grid = (-(-ncol // bn), -(-m // bm), splits)
    tail = (_i32(n), _i32(cout), _i32(cin), _i32(h), _i32(wd), _i32(ho), _i32(wo), _i32(kh),
            _i32(kw), _i32(sh), _i32(sw), _i32(ph), _i32(pw), _i32(splits), _i32(chunk))
    reduce = _reducer("conv2d.cu", splits, 1, m, ncol, ncol, 0, 0) if splits > 1 else None

    def run(x, gy, out):
        gw = _output(f, out, out_shape)
        ws = cupy.empty((splits, m, ncol), dtype=np.float32) if reduce else gw
        fn(grid, (256,), (x, gy, gw, ws) + tail, shared_mem=smem)
        if reduce:
            reduce(ws, gw, gw)
        return gw

    return run
