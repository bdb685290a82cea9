"""Launchers of kernels/gemm.cu and kernels/gemm_wgmma.cu: matmul, and the plan machinery the
convolutions (conv/) share.

Conventions (the .cu files' headers have the kernel side):
  * float32, or float16 / bfloat16 (every operand: the b16 tensor-core kernel, fp32
    accumulation, the result rounded once); operands C-contiguous (checked with
    launch.check_f32); the result is a new array or `out=`, written with `=`. Batch axes
    broadcast as NumPy's: equal batch shapes and one side 2-D (or all ones) run the kernels
    directly; any other pair (e.g. (2,1,4,3) @ (5,3,6)) first materialises each operand over the
    broadcast batch shape (broadcast_to) and then runs the equal-batch kernel, so every batch
    element is the same product.
  * Precision of float32 operands: runtime.precision, "tf32" (tensor cores, fp32 accumulate;
    operands rounded to tf32) or "fp32" (FFMA). It is part of every plan key.
  * Plans: the checks and the launch configuration (grid, block, split-K, shared memory) are
    worked out once per distinct call signature (shapes, dtypes, contiguity, 16-byte
    alignment, strides, precision) and kept, so a repeated call costs its allocations and
    launches only: eager steps are launch-bound.
  * Split-K: when the output tiles alone leave SMs idle, K is split over grid z; each split
    writes a partial product to a workspace and splitk_reduce_kernel sums them in split
    order. No atomics anywhere: results are bitwise repeatable.
  * Nothing here synchronises with the host, so a step built from these can be captured.

Hopper fast path (gemm_wgmma.cu, wgmma.mma_async, sm_90a): a "tf32" float32 matmul, or a
bfloat16 / float16 one, runs there (route "gemm_wgmma") when the device is compute capability 9.0 and the call
has its shape: M % 128 == 0, N % 256 == 0, K a multiple of one 128-byte row (32 floats, 64 16-bit
values), and as many 128 x 256 output tiles as SMs, or a quarter of that where it measured
faster than split-K (``_wgmma_faster``: long K, or little to transpose). Fewer tiles keep
gemm.cu's split-K kernels, but for TF32 products with K >= 1024 and A K-major, which split K
on wgmma itself (``_wgmma_split_k``, route "gemm_wgmma_splitk"; float partials summed by gemm.cu's reduce). The kernel
reads both operands K-major (a @ b^T, a and b 16-byte aligned); the other layouts first copy
the operand that is MN-major to a K-major scratch with the tiled transpose (2 x its bytes of
traffic, 10-25% of the product's time at the sizes that qualify, against 2.5-3x from wgmma). `matmul_kernel` names the kernel a call uses.

Thin products (gemm_thin.cu): one matrix with N or K at most THIN (16) and few multiply-adds,
as a classifier's few classes make them (``_thin_kernel``), run on CUDA cores in float, each
operand read once and C written once, no split of K and no second pass
(route "gemm_thin").

DPTRAIN_TEST_ROUTES_OFF (switches.py; conv/routes.py) turns routes off for the tests:
gemm_wgmma, gemm_wgmma_splitk and gemm_thin send their products to gemm.cu's kernels.
"""
from __future__ import annotations

import functools
import math

import cupy
import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.launch import i32
from dptrain.backend.cuda.elementwise import add_
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.cuda.transpose import broadcast_to, transposer
from dptrain.backend.registry import op

_WGMMA_BM, _WGMMA_BN, _WGMMA_ROW = 128, 256, 128
EPI_RELU = 4  # bias_mode's ReLU bit (gemm_tiles.cuh)


def wgmma_smem(bm: int, bn: int) -> int:
    """Dynamic shared memory of a wgmma.cuh kernel with bm x bn block tiles: its
    smem_bytes<bm, bn>() (4 stages of both 128-byte-row tiles, + slack to align)."""
    return 4 * (bm + bn) * _WGMMA_ROW + 1024


_WGMMA_SMEM = wgmma_smem(_WGMMA_BM, _WGMMA_BN)


# ----------------------------------------------------------------------------- plans


def tile_floats(bmn: int, bk: int, kmajor: bool, pad: int) -> int:
    """Elements in one shared-memory operand tile: TileLayout::kSize in gemm_tiles.cuh."""
    return bmn * (bk + pad) if kmajor else bk * (bmn + pad)


def operand_dtype(fn: str, a) -> np.dtype:
    """float32, float16 or bfloat16, the dtypes the GEMM family computes in; else raises."""
    dt = np.dtype(getattr(a, "dtype", np.float32))  # not an array: check_f32 says so
    if dt not in (np.dtype(np.float32), *launch.HALVES):
        raise TypeError(f"cuda.{fn}: operands must be float32, float16 or bfloat16, got {dt}")
    return dt


def sig(fn: str, name: str, a):
    """What a launch plan depends on: shape, dtype, contiguity and 16-byte alignment of `a`."""
    if a is None:
        return None
    if type(a) is not cupy.ndarray:
        launch.check_f32(fn, name, a)  # raises for anything but a CuPy array (or subclass)
    return a.shape, a.dtype, a.flags.c_contiguous, a.data.ptr % 16 == 0


_PLANS: dict = {}


def plan(key, build):
    """The cached plan for `key`; build() validates the arguments and makes it on a miss."""
    if launch.is_recording():  # a plan made then holds kernels that launch nothing
        return build()
    p = _PLANS.get(key)
    if p is None:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        p = _PLANS[key] = build()
    return p


def clear_plans() -> None:
    """Forget every plan (they are rebuilt on the next call, reading
    DPTRAIN_TEST_ROUTES_OFF afresh)."""
    _PLANS.clear()


def output(fn: str, out, shape, dtype=np.float32):
    if out is None:
        return launch.new(shape, dtype)
    launch.check_f32(fn, "out", out, dtype=dtype)
    if out.shape != shape:
        raise ValueError(f"cuda.{fn}: out has shape {out.shape}, expected {shape}")
    return out


def _aligned(a, ld: int, stride: int) -> bool:
    """True when rows of `a` may be moved in 16-byte chunks."""
    v = 16 // a.itemsize
    return ld % v == 0 and stride % v == 0 and a.data.ptr % 16 == 0


def _chunks(k: int, splits: int, unit: int = 32) -> tuple[int, int]:
    """(splits, chunk): chunk a multiple of `unit` (every tile's BK), no split left empty."""
    chunk = -(-(-(-k // splits)) // unit) * unit
    return -(-k // chunk), chunk


def split_k(tiles: int, k: int, min_chunk: int, max_splits: int) -> tuple[int, int]:
    """(splits, chunk): split K when the tiles alone leave SMs idle, aiming at two blocks per
    SM, each on >= min_chunk of K. Split s covers K range [s*chunk, (s+1)*chunk)."""
    sms = launch.sm_count()
    if tiles >= sms:
        return 1, k
    splits = min(-(-2 * sms // max(tiles, 1)), k // min_chunk, max_splits)
    return _chunks(k, splits) if splits > 1 else (1, k)


def reducer(file, splits, batch, m, n, ldc, sc, bias_mode, dtype=np.float32, beta=0.0):
    """Launch of splitk_reduce_kernel: c = sum of the float partials in ws, in split order
    (+ bias) (+ beta * c), rounded to c's `dtype`. Few outputs over many splits (under one
    thread per output for 256 per SM, >= 16 splits: the backward-weight of a convolution)
    take splitk_reduce_warp_kernel, a warp per output, rather than one thread waiting on
    each split in turn."""
    half = np.dtype(dtype) in launch.HALVES
    outputs = batch * m * n
    warp = splits >= 16 and outputs < 256 * launch.sm_count()
    fn = launch.kernel(file, "splitk_reduce_warp_kernel" if warp else "splitk_reduce_kernel",
                       *((launch.ctype(dtype), "float") if half else ("float",)))
    grid = (max(1, min(-(-outputs * (32 if warp else 1) // 256), launch.sm_count() * 8)),)
    tail = (i32(splits), i32(batch), i32(m), i32(n), i32(ldc), np.int64(sc),
            np.float32(1.0), np.float32(beta), i32(bias_mode))
    return lambda ws, c, bias: fn(grid, (256,), (ws, c, bias) + tail)


# ----------------------------------------------------------------------------- matmul


def _direct_batch_shape(ba: tuple, bb: tuple):
    """Result batch shape where the kernels take the operands as they are (equal batch
    shapes, or one side all ones / absent); None where general broadcasting is needed."""
    if ba == bb:
        return ba
    if math.prod(bb) == 1 and len(bb) <= len(ba):
        return ba
    if math.prod(ba) == 1 and len(ba) <= len(bb):
        return bb
    return None


def _batch_shape(ba: tuple, bb: tuple) -> tuple:
    shape = _direct_batch_shape(ba, bb)
    if shape is None:  # matmul() broadcasts first: only a direct call of a plan gets here
        raise NotImplementedError(f"cuda.matmul: batch shapes {ba} and {bb} need broadcasting")
    return shape


def _broadcast_batches(a, b):
    """(a, b) ready for the kernels: unchanged where their batch shapes are supported
    directly, else each materialised over the broadcast batch shape (NumPy's rules)."""
    if a.ndim < 2 or b.ndim < 2:
        return a, b  # the plan reports it
    ba, bb = tuple(a.shape[:-2]), tuple(b.shape[:-2])
    if _direct_batch_shape(ba, bb) is not None:
        return a, b
    batch = launch.broadcast_shape("matmul", ba, bb)
    if ba != batch:
        a = broadcast_to(a, batch + tuple(a.shape[-2:]))
    if bb != batch:
        b = broadcast_to(b, batch + tuple(b.shape[-2:]))
    return a, b


def _route_off(name: str) -> bool:
    """Whether the tests turned route `name` off (DPTRAIN_TEST_ROUTES_OFF; conv/routes.py,
    loaded by the time a plan is made)."""
    from dptrain.backend.cuda.conv import routes
    return routes.refused(name)


@functools.lru_cache(maxsize=None)
def _is_sm90(device_id: int) -> bool:
    return int(cupy.cuda.Device(device_id).compute_capability) == 90


def wgmma_available() -> bool:
    """Whether the wgmma kernels may run: a compute capability 9.0 device."""
    return _is_sm90(cupy.cuda.Device().id)


def _wgmma_splits(a, b, ta, tb, m, n, k, nb) -> int:
    """How gemm_wgmma.cu takes this product (see the module docstring): 0 not at all, 1 with
    K whole, s > 1 with K split s ways. An operand that is transposed into a scratch copy
    first needs no alignment of its own."""
    bk = _WGMMA_ROW // a.itemsize  # K elements in one 128-byte row
    fits = ((a.dtype in launch.HALVES or runtime.precision == "tf32")
            and wgmma_available() and not _route_off("gemm_wgmma")
            and m % _WGMMA_BM == 0 and n % _WGMMA_BN == 0 and k % bk == 0 and k > 0
            and (ta or a.data.ptr % 16 == 0) and (not tb or b.data.ptr % 16 == 0)
            and (m // _WGMMA_BM) * (n // _WGMMA_BN) <= launch.INT32_MAX
            and nb <= launch.GRID_YZ_MAX)
    if not fits:
        return 0
    tiles = nb * (m // _WGMMA_BM) * (n // _WGMMA_BN)
    if _wgmma_faster(a.dtype, ta, tb, m, n, k, tiles):
        return 1
    splits = _wgmma_split_k(a.dtype, ta, k, bk, tiles)
    return splits if nb * splits <= launch.GRID_YZ_MAX else 0


def _wgmma_faster(dtype, ta, tb, m, n, k, tiles) -> bool:
    """Whether gemm_wgmma.cu (no split of K; an MN-major operand transposed to scratch first)
    beats gemm.cu's kernels (which split K to fill the SMs) on an m x n x k product of `tiles`
    128 x 256 tiles: where they fill the SMs; where they fill a quarter of them or more, for
    K >= 1024, and in TF32 also with no operand to transpose, or for K >= 256 with fewer
    elements to transpose than C holds. Measured on an H200 (BENCHMARKS.md, 2026-11-27) at
    33-128 tiles: TF32 at K >= 256 1.18-3.4x faster, but 0.90x where a 16384 x 256 A^T (as
    large as C) was transposed first, and 0.83-1.51x at K 64 with a transpose; 16 bits
    1.19-2.8x from K 1024 on, while below it the 16-bit mma.sync kernel was up to 2.2x faster."""
    sms = launch.sm_count()
    if tiles >= sms:
        return True
    if 4 * tiles < sms:
        return False
    if k >= 1024:
        return True
    if dtype in launch.HALVES:
        return False
    transposed = (m * k if ta else 0) + (0 if tb else n * k)
    return transposed == 0 or (k >= 256 and transposed < m * n)


_WGMMA_MIN_SLABS = 4  # slabs of K per split at the least


def _wgmma_split_k(dtype, ta, k: int, bk: int, tiles: int) -> int:
    """Splits of K for a TF32 product of too few 128 x 256 tiles for _wgmma_faster (under a
    quarter of the SMs): as many as fill the SMs once, each at least _WGMMA_MIN_SLABS slabs
    of bk, where K >= 1024 and A needs no transpose; else 0 (gemm.cu's split-K kernels), as
    for 16-bit products or with the route gemm_wgmma_splitk turned off. Measured on an H200 (BENCHMARKS.md,
    2026-11-27) against gemm.cu's split K: 1.06-1.87x faster on five such products from K
    1024 (the MLP's first layer 15.5 -> 12.1 us, the CNN's fc1 15.8 -> 12.2), slower below K
    1024 or with A transposed first (0.75-0.84x on three)."""
    if (_route_off("gemm_wgmma_splitk") or dtype in launch.HALVES
            or ta or k < 1024):
        return 0
    splits = min(-(-launch.sm_count() // max(tiles, 1)), k // bk // _WGMMA_MIN_SLABS)
    return splits if splits > 1 else 0


THIN = 16  # gemm_thin.cu's small dimension, at most
THIN_MACS = 1 << 21  # larger thin products keep the tiled kernels (and int offsets suffice)


def _thin_kernel(m: int, n: int, k: int, nb: int):
    """gemm_thin.cu's kernel for an m x n x k product (one matrix, at most THIN_MACS
    multiply-adds) with K at most THIN (a thread per output), or N at most THIN and K at
    most 256 (a warp per row), else None. Measured on an H200 against the tiled kernels
    (BENCHMARKS.md, 2026-11-27): K 7 2.0-3.2 us against 6.3-6.7 (with 256-512 columns, up to
    1024 rows), but 26 against 11 us at 4096 x 1024 x 8; N 7 and K 256 4.4-4.7 us against
    5.9-6.6, but from K 512 on 7.4-28 us against 6.9-12.6. M small (the weight gradient dY^T
    @ X) stays tiled: a block per 32 columns left most SMs idle (9.7 against 6.3 us)."""
    if nb != 1 or m * n * max(k, 1) > THIN_MACS:  # K 0 still writes m * n outputs
        return None
    if k <= THIN:
        return "gemm_thin_k_kernel"
    if n <= THIN and k <= 256:
        return "gemm_thin_n_kernel"
    return None


def _plan_thin(name, m, n, k, a_strides, b_strides, bias_mode, beta, out_shape, dt):
    """C = A @ B (+ bias, ReLU) (+ beta * C) by gemm_thin.cu's kernel `name`, on CUDA cores in
    float (operands as they are, no TF32 rounding), no workspace and no second pass."""
    if name == "gemm_thin_n_kernel":  # its sums unrolled up to 8 or 16 columns
        fn = launch.kernel("gemm_thin.cu", name, launch.ctype(dt), "8" if n <= 8 else "16")
        block, threads = 64, 32 * m
    else:
        fn = launch.kernel("gemm_thin.cu", name, launch.ctype(dt))
        block, threads = 256, m * n
    grid = (max(1, min(-(-threads // block), launch.sm_count() * 32)),)
    tail = tuple(i32(v) for v in (m, n, k, *a_strides, *b_strides, n)) + (
        np.float32(beta), i32(bias_mode))

    def run(a, b, bias, out):
        c = output("matmul", out, out_shape, dt)
        fn(grid, (block,), (a, b, c, c if bias is None else bias) + tail)
        return c

    run.kernel, run.splits, run.accumulates = name, 1, True
    return run


def _matmul_plan(a, b, trans_a, trans_b, bias, relu=False, accumulate=False):
    ta, tb, relu, accumulate = bool(trans_a), bool(trans_b), bool(relu), bool(accumulate)
    key = ("matmul", sig("matmul", "a", a), sig("matmul", "b", b), ta, tb,
           sig("matmul", "bias", bias), relu, accumulate, runtime.precision)
    return plan(key, lambda: _plan_matmul(a, b, ta, tb, bias, relu, accumulate))


def matmul_kernel(a, b, trans_a=False, trans_b=False, *, bias=None) -> str:
    """The name of the kernel that matmul(a, b, trans_a, trans_b, bias=bias) launches."""
    if _direct_batch_shape(tuple(a.shape[:-2]), tuple(b.shape[:-2])) is None:
        a, b = _broadcast_batches(a, b)
    return _matmul_plan(a, b, trans_a, trans_b, bias).kernel


@op
def matmul(a, b, trans_a=False, trans_b=False, *, bias=None, out=None):
    """a @ b over the last two axes (either operand transposed first); batch axes broadcast.

    `bias` (N,) is added to every row of the result (y = x W^T + b in one pass).
    """
    if a.ndim > 2 and b.ndim > 2 and a.shape[:-2] != b.shape[:-2]:
        a, b = _broadcast_batches(a, b)
    return _matmul_plan(a, b, trans_a, trans_b, bias)(a, b, bias, out)


@op
def linear(x, w, b=None, relu=False):
    """x @ w^T (+ b), then ReLU if `relu`, for x (N, in) and w (out, in): Linear's forward as
    one GEMM, bias and ReLU applied in its epilogue (a 16-bit result is rounded once)."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"cuda.linear: x and w must be 2-D, got {x.shape} and {w.shape}")
    return _matmul_plan(x, w, False, True, b, relu)(x, w, b, None)


@op
def matmul_add_(c, a, b, trans_a=False, trans_b=False):
    """c += op(a) @ op(b), in place, for 2-D operands: a weight's gradient added into its
    .grad by split-K's reduce or a thin product's store (beta 1). float32 only: there the
    sum is matmul's result added to c, as add_ would (one rounding), so the bits are
    matmul's then add_'s. A product that does neither runs as those two: the tiles'
    read-modify-write epilogue (rolled) measured slower than their staged stores and a
    separate add (MLP and CNN TF32 steps 1-4%), and the wgmma kernel only writes. Returns c."""
    if c.dtype != np.float32 or a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"cuda.matmul_add_: float32 2-D operands only, got c {c.dtype} and "
                         f"{a.ndim}-D, {b.ndim}-D operands")
    launch.check_contiguous("matmul_add_", c)
    product = _matmul_plan(a, b, trans_a, trans_b, None)
    if not product.accumulates:
        return add_(c, product(a, b, None, None))
    return _matmul_plan(a, b, trans_a, trans_b, None, accumulate=True)(a, b, None, c)


@op
def matmul_into_(c, a, b, trans_a=False, trans_b=False):
    """c = op(a) @ op(b), written into c by the product's own stores, for 2-D operands: a
    weight's gradient into a .grad that holds zeros (autograd.grads_zeroed), where
    matmul_add_ would run a product that does not accumulate itself as a matmul and an add
    pass. Returns c."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"cuda.matmul_into_: 2-D operands only, got {a.ndim}-D, {b.ndim}-D")
    launch.check_contiguous("matmul_into_", c)
    return _matmul_plan(a, b, trans_a, trans_b, None)(a, b, None, c)


def _plan_matmul(a, b, ta, tb, bias, relu=False, accumulate=False):
    dt = operand_dtype("matmul", a)
    launch.check_f32("matmul", "a", a, dtype=dt)
    launch.check_f32("matmul", "b", b, dtype=dt)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"cuda.matmul: operands must be at least 2-D, got {a.shape} and {b.shape}")
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if tb else (b.shape[-2], b.shape[-1])
    if k != kb:
        raise ValueError(
            f"cuda.matmul: inner sizes differ: a{' (transposed)' if ta else ''} {a.shape} "
            f"and b{' (transposed)' if tb else ''} {b.shape}"
        )
    batch_shape = _batch_shape(a.shape[:-2], b.shape[:-2])
    out_shape = tuple(int(s) for s in batch_shape + (m, n))
    nb = math.prod(batch_shape)
    bias_mode = 0
    if bias is not None:
        launch.check_f32("matmul", "bias", bias, ndim=1, dtype=dt)
        if bias.shape[0] != n:
            raise ValueError(f"cuda.matmul: bias has shape {bias.shape}, expected ({n},)")
        bias_mode = 1
    bias_mode |= EPI_RELU if relu else 0
    if nb == 0 or m == 0 or n == 0:
        empty = lambda a, b, bias, out: output("matmul", out, out_shape, dt)  # noqa: E731
        empty.kernel, empty.splits, empty.accumulates = "none", 1, False
        return empty

    s_a = m * k if a.ndim > 2 and math.prod(a.shape[:-2]) == nb and nb > 1 else 0
    s_b = k * n if b.ndim > 2 and math.prod(b.shape[:-2]) == nb and nb > 1 else 0
    if s_b == 0 and not ta and nb > 1 and s_a:
        m, nb, s_a = m * nb, 1, 0  # (batch, M, K) @ (K, N) is one (batch*M, K) @ (K, N)
    lda, ldb, ldc, s_c = a.shape[-1], b.shape[-1], n, m * n
    beta = 1.0 if accumulate else 0.0  # the wgmma kernel only writes C
    thin = None if _route_off("gemm_thin") else _thin_kernel(m, n, k, nb)
    if thin:
        # element strides of A[m, k] and B[k, n]: a transposed operand swaps its own
        a_strides = (1, lda) if ta else (lda, 1)
        b_strides = (1, ldb) if tb else (ldb, 1)
        return _plan_thin(thin, m, n, k, a_strides, b_strides, bias_mode, beta, out_shape, dt)
    wgmma_splits = 0 if accumulate else _wgmma_splits(a, b, ta, tb, m, n, k, nb)
    if wgmma_splits:
        return _plan_wgmma(m, n, k, nb, s_a, s_b, bias_mode, out_shape, dt, ta, tb,
                           wgmma_splits)
    if m > 128 * launch.GRID_YZ_MAX:
        raise ValueError(f"cuda.matmul: M = {m} exceeds the grid's limit of "
                         f"{128 * launch.GRID_YZ_MAX}")

    tf32 = runtime.precision == "tf32"
    # Tensor-core products whose 128 x 128 tiles leave SMs idle (the FC layers at small
    # batches) take 64-row tiles: twice the blocks before any split of K.
    few = -(-m // 128) * -(-n // 128) * nb < launch.sm_count()
    bm = 64 if few else 128
    # FFMA products take 64 x 64 tiles there (bn 64 too: its threads' 4 x 4 tiles).
    bn = 64 if few and not (dt in launch.HALVES or tf32) else 128
    # A product of very few tiles (a classifier's weight gradient: 7 x 256 @ 256 x 64) splits
    # K into chunks down to one 32-wide slab: one block would otherwise walk all of K alone,
    # and these products wait on latency (32 measured 4% faster than 64 on the MLP's TF32
    # step, 1% on the CNN's bf16 step; 128 or more slower).
    tiles = -(-m // bm) * -(-n // bn) * nb
    splits, chunk = split_k(tiles, k, 32 if 4 * tiles <= launch.sm_count() else 256, 64)
    if nb * splits > launch.GRID_YZ_MAX:
        if nb > launch.GRID_YZ_MAX:
            raise ValueError(f"cuda.matmul: batch {nb} exceeds the grid's limit of "
                             f"{launch.GRID_YZ_MAX}")
        splits, chunk = 1, k
    ws_shape = (splits, nb, m, n)

    flags = (str(ta).lower(), str(tb).lower())
    tail64 = ("64",) if bm == 64 else ()
    if dt in launch.HALVES:
        smem = 3 * 2 * (tile_floats(bm, 32, not ta, 8) + tile_floats(128, 32, tb, 8))
        fn = launch.kernel("gemm.cu", "gemm_b16_kernel", launch.ctype(dt), *flags, *tail64,
                           smem=smem)
        block = (128,)
    elif tf32:
        smem = 3 * 4 * (tile_floats(bm, 32, not ta, 8 if ta else 4)
                        + tile_floats(128, 32, tb, 4 if tb else 8))
        fn = launch.kernel("gemm.cu", "gemm_tf32_kernel", "float", *flags, *tail64, smem=smem)
        block = (128,)
    else:
        smem = 3 * 4 * (tile_floats(bm, 16, False, 4) + tile_floats(bn, 16, False, 4))
        fn = launch.kernel("gemm.cu", "gemm_fp32_kernel", "float", *flags,
                           *(("64", "64") if bn == 64 else ()), smem=smem)
        block = (256,)
    grid = (-(-n // bn), -(-m // bm), nb * splits)
    # GEMM_PARAMS after (A, B, C, bias, ws): M N K lda ldb ldc sA sB sC batch splits kchunk
    # alpha beta bias_mode vec_a vec_b.
    tail = (i32(m), i32(n), i32(k), i32(lda), i32(ldb), i32(ldc),
            np.int64(s_a), np.int64(s_b), np.int64(s_c), i32(nb), i32(splits), i32(chunk),
            np.float32(1.0), np.float32(beta), i32(bias_mode),
            i32(_aligned(a, lda, s_a)), i32(_aligned(b, ldb, s_b)))
    reduce = (reducer("gemm.cu", splits, nb, m, n, ldc, s_c, bias_mode, dt, beta)
              if splits > 1 else None)
    kernel_name = ("gemm_b16_kernel" if dt in launch.HALVES else
                   "gemm_tf32_kernel" if tf32 else "gemm_fp32_kernel")

    def run(a, b, bias, out):
        c = output("matmul", out, out_shape, dt)
        ws = launch.new(ws_shape, np.float32) if reduce else c
        bias = c if bias is None else bias
        fn(grid, block, (a, b, c, bias, ws) + tail, shared_mem=smem)
        if reduce:
            reduce(ws, c, bias)
        return c

    run.kernel, run.splits, run.accumulates = kernel_name, splits, splits > 1
    return run


def _plan_wgmma(m, n, k, nb, s_a, s_b, bias_mode, out_shape, dt, ta=False, tb=True,
                splits=1):
    """C = A @ B^T by gemm_wgmma.cu: one block per 128 x 256 tile (and split of K), batch in
    grid z. A stored (K, M) (ta) or B stored (K, N) (not tb) is first transposed to K-major
    scratch, each matrix of its batch (one where its batch stride is 0). Split K: float
    partials, then gemm.cu's reduce (bias and ReLU there)."""
    fn = launch.kernel("gemm_wgmma.cu", "gemm_wgmma_kernel", launch.ctype(dt), smem=_WGMMA_SMEM)
    a_to_kmajor = transposer(nb if s_a else 1, k, m, dt) if ta else None
    b_to_kmajor = transposer(nb if s_b else 1, k, n, dt) if not tb else None
    pair = 2 * dt.itemsize  # the kernel stores pairs of elements
    bk = _WGMMA_ROW // dt.itemsize
    splits, chunk = _chunks(k, splits, bk)
    kt_split = chunk // bk  # slabs a split
    grid = ((m // _WGMMA_BM) * (n // _WGMMA_BN), 1, nb * splits)
    tail = (i32(m), i32(n), i32(k), np.int64(s_a), np.int64(s_b), np.int64(m * n), i32(bias_mode))
    reduce = (reducer("gemm.cu", splits, nb, m, n, n, m * n, bias_mode, dt)
              if splits > 1 else None)

    def run(a, b, bias, out):
        c = output("matmul", out, out_shape, dt)
        # The kernel stores pairs: an `out=` view at an odd element offset gets a copy.
        dst = c if reduce or c.data.ptr % pair == 0 else launch.new(out_shape, dt)
        if a_to_kmajor:
            a = a_to_kmajor(a)
        if b_to_kmajor:
            b = b_to_kmajor(b)
        bias = dst if bias is None else bias
        ws = launch.new((splits, nb, m, n), np.float32) if reduce else dst
        fn(grid, (256,), (a, b, dst, bias) + tail + (ws, i32(splits), i32(kt_split)),
           shared_mem=_WGMMA_SMEM)
        if reduce:
            reduce(ws, dst, bias)
        if dst is not c:
            c[...] = dst
        return c

    run.kernel, run.splits, run.accumulates = "gemm_wgmma_kernel", splits, splits > 1
    return run
