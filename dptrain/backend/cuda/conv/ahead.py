"""A step's 16-bit convolution weights reordered ahead, in one launch.

The wgmma kernels read a weight as the implicit GEMM's K-major operand (layout.weight_reorder:
the forward's for filters wider than 1x1, backward-data's for every filter), one transpose
launch per layer and pass. At 3x32x32 those launches are a step's smallest kernels and many:
ResNet-18 fp16 at batch 256 ran 37 of them, 118 us (H200). WeightOperands reorders every
weight of a set at once (transpose_many_kernel) into buffers allocated once;
``with operands.ready():`` then makes weight_reorder's runs hand out the operand of a weight
at that address and shape instead of reordering it. The step opens it around its forward
and backward, where the weights stay as they are; outside, every run reorders as before.
ResNet-18 fp16 at 3x32x32, batch 256: 35 of them (112 us) became one launch of 40 us, the step
3.443 / 3.414 -> 3.349 / 3.372 ms; ResNet-50 at 3x224x224, batch 256, 31.881 -> 31.839 ms.

The operands are the transposes weight_reorder's runs make, so the bits are theirs.
"""
from __future__ import annotations

import contextlib

import cupy
import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.conv import routes
from dptrain.backend.cuda.transpose import NARROW_BYTES, TR
from dptrain.backend.registry import op

# transpose_many_kernel's TransposeJob, field for field
JOB = np.dtype([("src", np.uint64), ("dst", np.uint64), ("first", np.int64), ("nb", np.int32),
                ("R", np.int32), ("C", np.int32), ("tiles_c", np.int32), ("wide", np.int32)],
               align=True)
TILE_BYTES = 64 * 66 * 2  # a wide job's tile in shared memory

_READY: dict = {}  # (pointer, mode, shape) -> operand, inside WeightOperands.ready()


def ready_operand(w, mode: int):
    """The operand of weight w for pass `mode` (0 forward, 1 backward-data) reordered
    ahead, or None."""
    return _READY.get((w.data.ptr, mode, tuple(w.shape))) if _READY else None


def _reorders(shape):
    """(mode, (nb, rows, cols) of the transpose, operand shape) of each operand that
    weight_reorder makes of a (C_out, C_in, KH, KW) weight: the forward's (each output
    channel's (C_in, KH*KW) turned; a 1x1 filter's is the weight itself) and backward-data's
    (the weight as one (C_out, C_in*KH*KW) matrix turned)."""
    co, ci, kh, kw = shape
    khw = kh * kw
    forward = [(0, (co, ci, khw), (co, khw * ci))] if khw > 1 else []
    return forward + [(1, (1, co, ci * khw), (ci, khw * co))]


def _job(src, nb, rows, cols):
    """(job fields, dst) turning the nb (rows, cols) matrices of src into a new (nb, cols,
    rows) array, or None where neither piece fits: a matrix past NARROW_BYTES in shared
    memory with an odd side (the pairs' tiles need even ones)."""
    if rows * cols * 2 <= NARROW_BYTES:
        job = dict(nb=nb, R=rows, C=cols, tiles_c=0, wide=0, pieces=nb)
    elif nb == 1 and rows % 2 == 0 and cols % 2 == 0:
        tiles_c = -(-cols // 64)
        job = dict(nb=1, R=rows, C=cols, tiles_c=tiles_c, wide=1, pieces=tiles_c * -(-rows // 64))
    else:
        return None
    return job, launch.new((nb, cols, rows), src.dtype)


class WeightOperands:
    """The forward's (filters wider than 1x1) and backward-data's operands of every 16-bit
    4-D weight in `weights` (contiguous device arrays that stay where they are), made by
    refresh() in one launch."""

    def __init__(self, weights):
        self._operands, fields = {}, []
        for w in weights:
            for mode, (nb, rows, cols), shape in _reorders(w.shape):
                made = _job(w, nb, rows, cols)
                if made is not None:  # else weight_reorder's run reorders it, as ever
                    job, dst = made
                    self._operands[(w.data.ptr, mode, tuple(w.shape))] = dst.reshape(shape)
                    fields.append(dict(job, src=w.data.ptr, dst=dst.data.ptr))
        table, first = np.zeros(len(fields), JOB), 0
        for row, f in zip(table, fields):
            for name in ("src", "dst", "nb", "R", "C", "tiles_c", "wide"):
                row[name] = f[name]
            row["first"], first = first, first + f["pieces"]
        self.pieces, self.jobs = first, len(fields)
        launch.check_int32("conv2d_weight_operands", self.pieces)
        self._table = cupy.asarray(table.view(np.uint8)) if fields else None
        self._smem = max([TILE_BYTES] + [f["R"] * f["C"] * 2 for f in fields if not f["wide"]])
        self._fn = launch.kernel(TR, "transpose_many_kernel", smem=self._smem) if fields else None

    def refresh(self):
        """Reorder every weight into its operands (one launch, on the current stream)."""
        if self._fn is not None:
            self._fn((self.pieces,), (256,), (self._table, np.int32(self.jobs)),
                     shared_mem=self._smem)

    @contextlib.contextmanager
    def ready(self):
        """Inside, weight_reorder's runs take these operands (refreshed by then)."""
        if _READY:
            raise RuntimeError("conv2d_weight_operands: ready() does not nest")
        _READY.update(self._operands)
        try:
            yield self
        finally:
            _READY.clear()


@op
def conv2d_weight_operands(weights):
    """WeightOperands of the 16-bit 4-D weights among `weights` whose channels the wgmma
    kernels gather (C_in in whole 16-byte chunks), or None where there are none, on a GPU
    without wgmma, or where the tests turned "weights_ahead" off."""
    from dptrain.backend.cuda.gemm import wgmma_available

    taken = [w for w in weights
             if w.ndim == 4 and w.dtype in launch.HALVES and w.shape[1] % 8 == 0
             and w.flags.c_contiguous and w.data.ptr % 16 == 0]
    if not taken or not wgmma_available() or routes.refused("weights_ahead"):
        return None
    return WeightOperands(taken)
