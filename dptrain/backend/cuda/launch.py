"""The one way the CUDA launchers check their arguments and launch a kernel.

Every launcher module (elementwise.py, reduce.py, gemm.py, ...) follows the same steps:
  1. check its arguments with the helpers here; every error reads ``cuda.<op>: ...``;
  2. allocate its outputs with ``new(shape, dtype)`` (CuPy's memory pool): the single place
     the tests wrap to poison outputs, so launchers call it as ``launch.new``;
  3. get the compiled kernel with ``kernel(file, name, *template_args)``;
  4. pass every scalar cast to the kernel parameter's type (``np.int32``, ``np.int64``,
     ``np.float32``, ...: CuPy would pass a Python int as 64 bits) and every struct as one of
     the NumPy structured dtypes below;
  5. launch on the current stream, either with ``grid_stride`` (the kernels of the
     grid-stride families) or with their own fixed grids (GEMM, convolution).
Nothing here waits for the device, so a training step built from these launches can be
captured as a CUDA graph.
"""
from __future__ import annotations

import contextlib
import functools

import cupy
import numpy as np

from dptrain.backend.bfloat16 import BFLOAT16, HALVES, from_bfloat16, to_bfloat16
from dptrain.backend.cuda import loader

BLOCK = 256  # threads per block of every grid-stride launch (unless launch_shape says)
WARPS = BLOCK // 32
MAX_DIMS = 8  # DP_MAX_DIMS in kernels/common.cuh
INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535  # grid.y and grid.z limits
BLOCKS_PER_SM = 16  # grid-stride launches are capped at this many blocks per SM
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# 16-bit storage types (HALVES): the kernels that take them compute in float (bfloat16 is
# held as uint16: dptrain.backend.bfloat16)
HALF = np.dtype(np.float16)

# C type of each supported dtype, keyed by (kind, itemsize) so int64 spelled 'l' or 'q' agree.
# uint16 is bfloat16 (dptrain.backend.bfloat16): the backend has no integer uint16 arithmetic.
_CTYPES = {("f", 2): "__half", ("u", 2): "__nv_bfloat16", ("f", 4): "float", ("f", 8): "double",
           ("i", 4): "int", ("i", 8): "long long", ("u", 1): "unsigned char", ("b", 1): "bool"}
# Data movement works on raw bits: one kernel per element size serves every dtype of that size.
_BITS = {1: ("unsigned char", np.uint8), 2: ("unsigned short", np.uint16),
         4: ("unsigned int", np.uint32), 8: ("unsigned long long", np.uint64)}

# ----------------------------------------------------------------------------- kernel structs
# Kernel arguments passed by value as size-1 NumPy structured arrays; the field names and
# order are those of the C structs.

# struct Layout (kernels/common.cuh): a shape and two operands' element strides.
LAYOUT = np.dtype([("ndim", np.int32), ("shape", np.int32, (MAX_DIMS,)),
                   ("s0", np.int32, (MAX_DIMS,)), ("s1", np.int32, (MAX_DIMS,))])

# struct PoolGeom (kernels/pool.cu): n_c planes (batch * channels) of h x w in, ho x wo out;
# window kh x kw, stride sh, sw, padding ph, pw.
POOL_GEOM = np.dtype([(f, np.int32) for f in
                      ("n_c", "h", "w", "ho", "wo", "kh", "kw", "sh", "sw", "ph", "pw")])
DIRECT_GEOM = np.dtype([(f, np.int32) for f in
                        ("Nb", "C", "H", "W", "M", "Ho", "Wo", "KH", "KW", "sh", "sw", "ph", "pw")])


def struct(dtype, **fields):
    """A kernel struct argument: a size-1 structured array of `dtype` (unnamed fields 0)."""
    s = np.zeros(1, dtype=dtype)
    for name, value in fields.items():
        s[name] = value
    return s


# ----------------------------------------------------------------------------- memory


def new(shape, dtype):
    """Every output array comes from here (CuPy's pool); the tests wrap it to poison outputs."""
    return cupy.empty(shape, dtype=dtype)


# ----------------------------------------------------------------------------- kernels


def kernel(filename: str, name: str, *targs: str, smem: int = 0):
    """Kernel `name` of kernels/`filename`, instantiated as name<targs...> when template
    arguments are given (the spelling must match the file's `// instantiate:` line), allowed
    `smem` bytes of dynamic shared memory (opted in: with its static shared memory a kernel
    past 48 KB must be). Inside
    ``recording()``: a stand-in that launches nothing, the kernel noted instead."""
    if _recorded is not None:
        seen = (filename, f"{name}<{', '.join(targs)}>" if targs else name)
        if seen not in _recorded:
            _recorded.add(seen)
            if _on_record is not None:
                _on_record(*seen)
        return _NOT_LAUNCHED
    return _kernel(filename, name, *targs, smem=smem)


@functools.lru_cache(maxsize=None)
def _kernel(filename: str, name: str, *targs: str, smem: int = 0):
    fn = loader.function(filename, f"{name}<{', '.join(targs)}>" if targs else name)
    if smem > fn.max_dynamic_shared_size_bytes:  # one function, many sizes: only raised
        fn.max_dynamic_shared_size_bytes = smem
    return fn


# -- recording: which kernels a piece of code launches, without building or launching them.
# A training step reads no device value on the host (see dptrain.run.step), so the kernels
# it launches depend on shapes and dtypes only: one pass with stand-ins names them all.
_recorded: set | None = None
_on_record = None


class _NotLaunched:
    """What ``kernel()`` hands out while recording: a launch does nothing."""

    def __call__(self, *args, **kwargs):
        pass


_NOT_LAUNCHED = _NotLaunched()


@contextlib.contextmanager
def recording(on_record=None):
    """Context: kernels requested inside are not built and their launches do nothing, so
    outputs hold garbage; yields the set of (file, instantiation) requested, and calls
    ``on_record(file, instantiation)`` at each one's first request (to start its build).
    Plans made inside (which hold the stand-ins) are not kept."""
    global _recorded, _on_record
    if _recorded is not None:
        raise RuntimeError("cuda: kernel recordings do not nest")
    _recorded, _on_record = set(), on_record
    try:
        yield _recorded
    finally:
        _recorded = _on_record = None


def is_recording() -> bool:
    return _recorded is not None


def ctype(dtype) -> str:
    """The C type of `dtype`, for template arguments."""
    dt = np.dtype(dtype)
    try:
        return _CTYPES[(dt.kind, dt.itemsize)]
    except KeyError:
        raise TypeError(f"cuda: dtype {dt} is not supported") from None


def bits(itemsize):
    """(C type, NumPy dtype) of the unsigned integer of `itemsize` bytes."""
    try:
        return _BITS[itemsize]
    except KeyError:
        raise TypeError(f"cuda: no copy kernel for {itemsize}-byte elements") from None


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def sm_count() -> int:
    """Streaming multiprocessors of the current device (looked up once per device)."""
    return _sm_count(cupy.cuda.runtime.getDevice())


def i32(v) -> np.int32:
    """`v` as a kernel int, or a ValueError when it does not fit."""
    if not -(2**31) <= v <= INT32_MAX:
        raise ValueError(f"cuda: value {v} does not fit the kernels' 32-bit indices")
    return np.int32(v)


# ----------------------------------------------------------------------------- launch shape
# For scaling/threads.py, which sweeps the launch shape from one thread up. It applies to every
# grid_stride launch (elementwise, copies, reductions, softmax, pooling, optimizers, data);
# GEMM and convolution keep their fixed tiles. Default: BLOCK threads, 16 blocks per SM.

_threads = None  # threads per block; None: BLOCK
_max_blocks = None  # blocks per launch at most; None: BLOCKS_PER_SM per SM


def launch_shape(threads_per_block=None, max_blocks=None):
    """Context manager: inside it, grid_stride launches use `threads_per_block` (1..1024)
    threads and at most `max_blocks` blocks; None keeps the default. Kernels whose lanes
    cooperate (shuffles, block trees: reductions, softmax rows, max-pool backward) need whole
    warps, so they get the value rounded down to a multiple of 32, and at least 32. The
    previous setting comes back on exit, also on an exception. Arguments are checked here,
    before the block is entered."""
    for flag, value, top in (("threads_per_block", threads_per_block, 1024),
                             ("max_blocks", max_blocks, INT32_MAX)):
        if value is not None and not (isinstance(value, (int, np.integer))
                                      and not isinstance(value, bool) and 1 <= value <= top):
            raise ValueError(f"cuda.launch_shape: {flag} must be an integer in [1, {top}] or "
                             f"None, got {value!r}")
    return _shape_override(None if threads_per_block is None else int(threads_per_block),
                           None if max_blocks is None else int(max_blocks))


@contextlib.contextmanager
def _shape_override(threads, max_blocks):
    global _threads, _max_blocks
    old = _threads, _max_blocks
    _threads, _max_blocks = threads, max_blocks
    try:
        yield
    finally:
        _threads, _max_blocks = old


def current_launch_shape():
    """(threads_per_block, max_blocks) as set by launch_shape; None where the default applies."""
    return _threads, _max_blocks


def block_threads(warps=False):
    """Threads per block for the next launch; `warps`: the kernel needs whole warps."""
    threads = _threads or BLOCK
    return max(32, threads - threads % 32) if warps else threads


def grid_stride(fn, items, args, per_block=BLOCK, warps=False, smem=0):
    """Launch `fn` on the current stream with enough blocks for `items` work items of which
    one block takes `per_block`; capped, since every such kernel loops grid-stride.
    `per_block` counts items per block of BLOCK threads, so BLOCK // per_block threads share
    an item (1, a group of lanes, a warp, or the whole block); launch_shape may change the
    block. `warps`: the kernel needs whole warps even with a thread per item. `smem`: bytes
    of dynamic shared memory a block gets."""
    per_item = BLOCK // per_block
    threads = block_threads(warps=warps or per_item > 1)
    per_block = 1 if per_item == BLOCK else max(1, threads // per_item)
    cap = _max_blocks or sm_count() * BLOCKS_PER_SM
    grid = max(1, min(cap, -(-items // per_block)))
    fn((grid,), (threads,), args, shared_mem=smem)


# ----------------------------------------------------------------------------- checks


def is_cupy(a) -> bool:
    return isinstance(a, cupy.ndarray)


def check_arrays(op, *arrays):
    for a in arrays:
        if not is_cupy(a):
            raise TypeError(f"cuda.{op}: expected a CuPy array, got {type(a).__name__}")


def check_float(op, *arrays, half=False):
    """CuPy arrays of one floating dtype: float32 or float64, and float16 or bfloat16 where
    the op's kernels have 16-bit instantiations (`half`)."""
    check_arrays(op, *arrays)
    dt = arrays[0].dtype
    if dt not in FLOATS and not (half and dt in HALVES):
        kinds = "float16, bfloat16, float32 or float64" if half else "float32 or float64"
        raise TypeError(f"cuda.{op}: dtype {dt} not supported ({kinds})")
    for a in arrays[1:]:
        if a.dtype != dt:
            raise TypeError(f"cuda.{op}: mixed dtypes {dt} and {a.dtype}")


def check_contiguous(op, *arrays):
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError(f"cuda.{op}: arrays must be C-contiguous (shape {a.shape}, "
                             f"strides {a.strides})")


def check_shape(op, a, shape, what="array"):
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"cuda.{op}: {what} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def check_int_labels(op, labels, n):
    check_arrays(op, labels)
    if labels.dtype.kind != "i" or labels.dtype.itemsize not in (4, 8):
        raise TypeError(f"cuda.{op}: labels must be int32 or int64, got {labels.dtype}")
    check_contiguous(op, labels)
    check_shape(op, labels, (n,), "labels")


def check_int32(op, *counts):
    if max(counts, default=0) > INT32_MAX:
        raise ValueError(f"cuda.{op}: size {max(counts)} exceeds 32-bit indexing")


# A null pointer argument: CuPy passes None as 0xffffffff, not 0 (cupy/cupy#9046).
NULL = np.uint64(0)


def group_size(dtype) -> int:
    """Elements of `dtype` in one 16-byte group (common.cuh's Group<T>::size)."""
    return 16 // np.dtype(dtype).itemsize


def aligned(*arrays) -> np.int32:
    """The `vec` flag of a flat grouped kernel (common.cuh's load_group): 1 when every array
    starts 16-byte aligned."""
    return np.int32(all(a.data.ptr % 16 == 0 for a in arrays))


def whole_groups(row: int, *arrays) -> np.int32:
    """The `vec` flag of a kernel grouping rows of `row` elements: 1 when they split into
    whole 16-byte groups and every array starts 16-byte aligned."""
    return np.int32(row % group_size(arrays[0].dtype) == 0 and aligned(*arrays))


def scalar(dtype, value):
    """A host scalar as the kernel parameter compute_t<T> of element dtype `dtype`, rounded to
    `dtype` first, as NumPy rounds a scalar to the array's dtype."""
    if np.dtype(dtype) == HALF:
        return np.float32(np.float16(value))
    if np.dtype(dtype) == BFLOAT16:
        return from_bfloat16(to_bfloat16(np.float32(value)))[()]
    return np.dtype(dtype).type(value)


def check_f32(op, name, a, ndim=None, dtype=np.float32):
    """The GEMM family's operands: a C-contiguous CuPy array of `dtype` (float32, or float16 /
    bfloat16 for the 16-bit kernels) with int32 indices."""
    if not is_cupy(a):
        raise TypeError(f"cuda.{op}: {name} must be a cupy.ndarray, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"cuda.{op}: {name} must be {np.dtype(dtype)}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"cuda.{op}: {name} must be C-contiguous (use cupy.ascontiguousarray)")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"cuda.{op}: {name} must be {ndim}-D, got shape {a.shape}")
    if a.size > INT32_MAX:
        raise ValueError(f"cuda.{op}: {name} has {a.size} elements; the kernels index with int32")


# ----------------------------------------------------------------------------- strides


def estrides(a):
    """Strides in elements rather than bytes."""
    return [s // a.itemsize for s in a.strides]


def broadcast_shape(op, *shapes):
    nd = max(len(s) for s in shapes)
    out = []
    for i in range(nd):
        dims = {s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise ValueError(f"cuda.{op}: shapes {', '.join(map(str, shapes))} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def bstrides(a, shape):
    """Element strides of `a` broadcast to `shape` (0 along broadcast axes)."""
    lead = len(shape) - a.ndim
    if lead < 0:
        raise ValueError(f"cuda: cannot broadcast shape {a.shape} to {tuple(shape)}")
    out = [0] * len(shape)
    for i, (n, s) in enumerate(zip(a.shape, estrides(a))):
        if n == shape[lead + i]:
            out[lead + i] = s if n != 1 else 0
        elif n != 1:
            raise ValueError(f"cuda: cannot broadcast shape {a.shape} to {tuple(shape)}")
    return out


def collapse(shape, *strides):
    """Drop size-1 axes and merge neighbours that are contiguous in every operand, so the
    kernel does fewer index divisions (a contiguous copy becomes one axis)."""
    dims, merged = [], [[] for _ in strides]
    for i, n in enumerate(shape):
        if n == 1:
            continue
        if dims and all(m[-1] == s[i] * n for m, s in zip(merged, strides)):
            dims[-1] *= n
            for m, s in zip(merged, strides):
                m[-1] = s[i]
        else:
            dims.append(n)
            for m, s in zip(merged, strides):
                m.append(s[i])
    return dims, merged


def layout(shape, s0, s1=None):
    """A struct Layout kernel argument for `shape` and the operands' element strides."""
    if len(shape) > MAX_DIMS:
        raise ValueError(f"cuda: {len(shape)} non-mergeable axes (at most {MAX_DIMS})")
    for st in (s0, s1 or ()):
        if sum((n - 1) * abs(s) for n, s in zip(shape, st)) > INT32_MAX:
            raise ValueError("cuda: array too large for 32-bit strided indexing")
    lay = np.zeros(1, dtype=LAYOUT)
    nd = len(shape)
    lay["ndim"] = nd
    lay["shape"][0, :nd] = shape
    lay["s0"][0, :nd] = s0
    if s1 is not None:
        lay["s1"][0, :nd] = s1
    return lay


def rows(op, *arrays, half=False):
    """(rows, row length) of float, contiguous arrays of one shape, taken along the last axis:
    the layout of every row-wise kernel (softmax, cross-entropy, layer norm); 16-bit arrays
    too with `half`."""
    check_float(op, *arrays, half=half)
    check_contiguous(op, *arrays)
    for a in arrays[1:]:
        check_shape(op, a, arrays[0].shape)
    x = arrays[0]
    if x.ndim == 0:
        raise ValueError(f"cuda.{op}: needs at least one axis")
    c = x.shape[-1]
    r = x.size // c if c else 0
    check_int32(op, r, c)
    return r, c
