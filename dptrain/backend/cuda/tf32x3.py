"""float32 products on TF32 tensor cores ("3xTF32"; kernels/tf32x3.cu splits the operands).

Under precision "fp32" the matrix kernels run FFMA, at most 67 TFLOP/s on an H100 against
about 490 for TF32. Splitting each operand into TF32 parts, a = hi + lo (to 2^-22 |a|), a
product is hi_a*hi_b + lo_a*hi_b + hi_a*lo_b: three TF32 products, which an unchanged TF32
kernel sums when they lie side by side along a K three times as long. The convolution
launchers (conv/) do this for the channels-last passes that a TF32 wgmma kernel takes:
the summed channels (forward, backward-data) or the batch (backward-weight) tripled.

Accuracy: the parts lose nothing that matters (2^-22), but the tensor cores' fp32
accumulation truncates where FFMA rounds, so the error grows with K. At ResNet-18's shapes
(batch 256, 48x48; H200, 2026-11-27) the largest error against float64, over the largest
output, was 1.2e-6 to 4.5e-5 a pass this way, 4.0e-7 to 4.2e-6 on our FFMA kernels,
2.9e-7 to 5.5e-5 for cuDNN's fp32 (PyTorch, TF32 off: the mode it is timed against) and
7.5e-4 to 8.3e-4 for TF32.

The convolutions' route "x3" (conv/passes.py); DPTRAIN_TEST_ROUTES_OFF=x3 keeps every fp32
convolution on FFMA kernels.
"""
from __future__ import annotations

import math

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.gemm import wgmma_available
from dptrain.backend.cuda.runtime import runtime

FILE = "tf32x3.cu"
# The parts along the tripled K: the first operand's (hi, lo, hi) meet the second's
# (hi, hi, lo), so the three products are hi*hi, lo*hi and hi*lo.
FIRST, SECOND = "hlh", "hhl"


def enabled(dt) -> bool:
    """Whether float32 passes of dtype dt may run as 3xTF32 now: precision "fp32" on a GPU
    with wgmma (Hopper)."""
    return (np.dtype(dt) == np.float32 and runtime.precision == "fp32"
            and wgmma_available())


def fits(*sizes) -> bool:
    """Whether operands of these element counts, tripled, stay within the kernels' int32
    indexing (else the pass keeps FFMA)."""
    return all(3 * int(n) <= launch.INT32_MAX for n in sizes)


def splitter(shape, axis: int, parts: str):
    """run(a) -> a new float32 array: the contiguous array a of `shape` as three parts
    concatenated along `axis`, each "h" (tf32(a)) or "l" (tf32(a - tf32(a))) as `parts`
    spells them, e.g. FIRST."""
    shape = tuple(int(s) for s in shape)
    rows, cols = math.prod(shape[:axis]), math.prod(shape[axis:])
    out_shape = shape[:axis] + (3 * shape[axis],) + shape[axis + 1:]
    lo_parts = np.int32(sum(1 << j for j, p in enumerate(parts) if p == "l"))
    launch.check_int32("tf32x3.split", 3 * rows * cols)
    fn4 = launch.kernel(FILE, "split3_kernel", "4") if cols % 4 == 0 else None
    fn1 = launch.kernel(FILE, "split3_kernel", "1")
    tail = (np.int32(rows), np.int32(cols), lo_parts)

    def run(a):
        out = launch.new(out_shape, np.float32)
        if a.size:
            aligned = fn4 is not None and a.data.ptr % 16 == 0
            fn, items = (fn4, a.size // 4) if aligned else (fn1, a.size)
            launch.grid_stride(fn, items, (a, out) + tail)
        return out

    return run
