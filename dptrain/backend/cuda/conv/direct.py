"""Planner of kernels/conv2d_direct.cu: small filters (C_in*KH*KW <= DIRECT_MAX_K, e.g. a
first layer on 1-3 channel images), forward (<= DIRECT_MAX_M output channels) and
backward-weight, where the implicit GEMM wastes most of each K slab.

The forward is FFMA in fp32 whatever the precision (more exact than TF32); in 16 bits with an
even C_out up to DIRECT_CL_MAX_M it writes a channels-last y itself, and conv2d_forward_stats'
statistics with it (cl_out). Backward-weight runs on tensor cores in TF32 / bf16 / fp16
(fp32 accumulation; a channels-last gy read as it lies), FFMA under fp32.
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch
from dptrain.backend.cuda.arrays import fill_
from dptrain.backend.cuda.conv import wgmma
from dptrain.backend.cuda.conv.geometry import ConvGeom
from dptrain.backend.cuda.conv.layout import tensor_cores, via_nchw
from dptrain.backend.cuda.gemm import output, reducer
from dptrain.backend.cuda.launch import i32
from dptrain.backend.cuda.norm import TILE_PIXELS

FILE = "conv2d_direct.cu"
DIRECT_MAX_K, DIRECT_MAX_M = 32, 128  # C_in*KH*KW; output channels (forward)
DIRECT_CL_MAX_M = 64  # the channels of a forward it writes channels-last
_DIRECT_MG = {4: 8, 8: 4, 12: 4, 16: 4, 20: 2, 24: 2, 28: 2, 32: 2}  # KMAX -> channels/thread


def kmax(g: ConvGeom) -> int:
    """The kernels' tap count (C_in*KH*KW rounded up to 4); they apply where it is <= 32."""
    return -(-g.rows // 4) * 4


def refuses_forward(g: ConvGeom):
    if not 0 < g.rows <= DIRECT_MAX_K:
        return f"C_in*KH*KW = {g.rows}, not within 1..{DIRECT_MAX_K}"
    if g.cout > DIRECT_MAX_M:
        return f"{g.cout} output channels > {DIRECT_MAX_M}"
    return None


def refuses_backward_weight(g: ConvGeom):
    if not 0 < g.rows <= DIRECT_MAX_K:
        return f"C_in*KH*KW = {g.rows}, not within 1..{DIRECT_MAX_K}"
    if g.cl and not tensor_cores(g.dtype):
        return "channels-last under FFMA: planned through NCHW copies"
    return None


def _geom(g: ConvGeom):
    launch.check_int32("conv2d", g.x_size, g.y_size)
    return launch.struct(launch.DIRECT_GEOM, Nb=g.n, C=g.c, H=g.h, W=g.w, M=g.cout, Ho=g.ho,
                         Wo=g.wo, KH=g.kh, KW=g.kw, sh=g.sh, sw=g.sw, ph=g.ph, pw=g.pw)


def cl_out(g: ConvGeom) -> bool:
    """Whether the forward writes a channels-last output itself (16-bit, C_out even and at
    most DIRECT_CL_MAX_M), with the batch statistics of its 128-pixel tiles where asked
    (conv2d_forward_stats)."""
    return g.cl and g.dtype in launch.HALVES and g.cout % 2 == 0 and g.cout <= DIRECT_CL_MAX_M


def forward(g: ConvGeom):
    """The direct forward; channels-last activations through NCHW copies, except an output
    it writes channels-last itself (cl_out)."""
    f = "conv2d_forward"
    run = _plan_forward(g, cl_out(g))
    out_nchw = None if cl_out(g) else g.y_shape
    return via_nchw(run, f, {1: g.x_shape}, out_nchw, g.dtype) if g.cl else run


def _plan_forward(g: ConvGeom, cl_out: bool):
    """The forward of NCHW x: y NCHW, or (N, Ho, Wo, C_out) where `cl_out`; run.stat_tiles
    is then the pixel tiles whose statistics `stats=` takes."""
    f, dt = "conv2d_forward", g.dtype
    out_shape = (g.n, g.ho, g.wo, g.cout) if cl_out else g.y_shape
    geom = _geom(g)
    targs = (launch.ctype(dt), str(kmax(g))) + (("true",) if cl_out else ())
    fn = launch.kernel(FILE, "conv2d_direct_fwd_kernel", *targs)
    npix = g.npix

    # 256-thread blocks whatever launch_shape says (__launch_bounds__(256) in the kernel).
    grid = (max(1, min(-(-npix // 256), launch.sm_count() * launch.BLOCKS_PER_SM // 2)),)

    def run(w, x, bias, out, workspace=None, stats=None):
        y = output(f, out, out_shape, dt)
        if npix and y.size:
            has_bias = bias is not None
            fn(grid, (256,), (w, x, bias if has_bias else y, y, np.int32(has_bias), geom,
                              launch.NULL if stats is None else stats))
        return y

    run.kernel = "conv2d_direct_fwd_kernel"
    run.stat_tiles = (-(-npix // TILE_PIXELS) if cl_out and npix and wgmma.epilogue_stats(dt)
                      else None)
    run.stat_rows = TILE_PIXELS
    return run


def backward_weight(g: ConvGeom):
    """The direct backward-weight: x NCHW (a channels-last x through a copy), gy as it lies
    (the tensor-core kernel reads a channels-last one)."""
    run = _plan_backward_weight(g)
    if g.cl:
        return via_nchw(run, "conv2d_backward_weight", {0: g.x_shape}, None, g.dtype)
    return run


def _plan_backward_weight(g: ConvGeom):
    f, dt, cl = "conv2d_backward_weight", g.dtype, g.cl
    geom = _geom(g)
    m, k, npix = g.cout, g.rows, g.npix
    tc = tensor_cores(dt)
    if tc:  # 32 channels x all taps per block row
        groups, rows = -(-m // 32), g.n * g.ho
        blocks = max(1, min(-(-rows // 8), 4 * launch.sm_count() // groups))
        name = "conv2d_direct_bwdw_mma_kernel"
        fn = launch.kernel(FILE, name, launch.ctype(dt), str(-(-k // 8)))
    else:
        mg = _DIRECT_MG[kmax(g)]
        groups = -(-m // mg)
        # About three resident blocks per SM over all groups (the accumulators limit occupancy).
        blocks = max(1, min(-(-npix // 256), 3 * launch.sm_count() // groups))
        name = "conv2d_direct_bwdw_kernel"
        fn = launch.kernel(FILE, name, launch.ctype(dt), str(kmax(g)), str(mg))
    if groups > launch.GRID_YZ_MAX:
        raise ValueError(f"cuda.{f}: {m} output channels exceed the grid's limit")
    reduce = reducer("conv2d.cu", blocks, 1, m, k, k, 0, 0, dt)
    even_rows = g.wo % 2 == 0
    w_shape = g.w_shape

    def run(x, gy, out, workspace=None):
        gw = output(f, out, w_shape, dt)
        if npix == 0:
            return fill_(gw, 0.0)
        ws = launch.new((blocks, m, k), np.float32)
        if tc:  # 16-bit NCHW pixel pairs as one 32-bit load where aligned
            pairs = np.int32(not cl and even_rows and gy.data.ptr % 4 == 0)
            fn((blocks, groups), (256,), (x, gy, ws, geom, pairs, i32(cl)))
        else:
            fn((blocks, groups), (256,), (x, gy, ws, geom))
        reduce(ws, gw, gw)
        return gw

    run.kernel = name
    return run
