"""The convolution ops and the route table of each pass (routes.py): forward,
backward-data, backward-weight, each planned once per signature (gemm.plan's cache).

Forward:         empty, direct, x3, strip, wgmma_tma, wgmma, mma
Backward-data:   empty, spread, x3, wgmma_tma, wgmma, mma
Backward-weight: empty, direct, x3, strip, bwdw_tma, bwdw_wgmma, nchw, nhwc, gemm

x3 is 3xTF32 (tf32x3.py) on a wgmma route of the pass with the summed channels (forward,
backward-data) or the batch (backward-weight) tripled, for fp32 channels-last passes on
Hopper, and for backward-weight where C_out and C_in*KH*KW fill the TF32 kernel's 128-wide
tiles (X3_BWDW_MIN). ResNet-18's fp32 step: 75.43 ms on FFMA, 42.18 this way (one H200).
nchw plans a channels-last backward-weight no channels-last kernel takes on NCHW copies.
strip (strip.py) is the ImageNet stem's forward and backward-weight over column pairs (8
channels a pixel).
"""
from __future__ import annotations

import numpy as np

from dptrain.backend.cuda import launch, tf32x3
from dptrain.backend.cuda.conv import (bwdw_wgmma, direct, geometry, implicit, layout, nhwc,
                                       routes, strip, wgmma)
from dptrain.backend.cuda.conv.geometry import ConvGeom, nhwc_shape
from dptrain.backend.cuda.conv.routes import Route
from dptrain.backend.cuda.elementwise import add_
from dptrain.backend.cuda.gemm import output, plan, sig, wgmma_available
from dptrain.backend.cuda.norm import batch_norm_stats, batch_norm_tile_stats
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.cuda.transpose import spreader
from dptrain.backend.registry import op
from dptrain.backend.spread import Spread

FORWARD, BACKWARD_DATA, BACKWARD_WEIGHT = "forward", "backward_data", "backward_weight"
# fp32 backward-weight as 3xTF32 where C_out and C_in*KH*KW both fill the TF32 kernel's
# 128-wide tiles; with 64 output channels FFMA was faster (ResNet-18's layer1: 1.73 against
# 2.13 ms, H200)
X3_BWDW_MIN = 128


# --------------------------------------------------------------------- 3xTF32 on wgmma


def _x3_refuses(g: ConvGeom, *sizes):
    if not g.cl:
        return "NCHW activations"
    if not tf32x3.enabled(g.dtype):
        return "not fp32 under precision fp32 on a wgmma GPU"
    if not tf32x3.fits(*sizes):
        return "tripled operands past int32 indexing"
    return None


def _x3_inner(table, g3: ConvGeom):
    """The route of `table` that takes the tripled pass g3 under TF32, or None."""
    with runtime.precision_scope("tf32"):
        for route in table:
            if routes.refusal(route, g3) is None:
                return route
    return None


def _x3_route(pass_, tripled, inner_table, splitters, more=lambda g: None):
    """The x3 route of a pass: tripled(g) the TF32 pass on the parts, inner_table the routes
    it may take, splitters(g) {operand position: splitter}."""
    def refuses(g):
        sizes = {FORWARD: (g.x_size, g.w_size), BACKWARD_DATA: (g.y_size, g.w_size),
                 BACKWARD_WEIGHT: (g.x_size, g.y_size)}[pass_]
        why = _x3_refuses(g, *sizes) or more(g)
        if why:
            return why
        if _x3_inner(inner_table(), tripled(g)) is None:
            return "no TF32 wgmma route takes the tripled pass"
        return None

    def plan_(g):
        g3 = tripled(g)
        return layout.x3(lambda: _x3_inner(inner_table(), g3).plan(g3), lambda: splitters(g))

    return Route("x3", refuses, plan_)


def _x3_bwdw_more(g):
    if min(g.cout, g.rows) < X3_BWDW_MIN:
        return f"C_out or C_in*KH*KW < {X3_BWDW_MIN} (FFMA is faster)"
    return None


# --------------------------------------------------------------------- the tables


def _implicit_routes(mode):
    return (Route("wgmma_tma", lambda g: wgmma.refuses_tma(g, mode),
                  lambda g: wgmma.plan(g, mode, True)),
            Route("wgmma", lambda g: wgmma.refuses(g, mode),
                  lambda g: wgmma.plan(g, mode, False)))


def _empty_route(fn_name, inputs, counts, out_shape):
    def refuses(g):
        return None if 0 in counts(g) else "not empty"
    return Route("empty", refuses, lambda g: layout.empty(fn_name, inputs, out_shape(g), g.dtype))


def _cl(g, shape):
    return nhwc_shape(shape) if g.cl else shape


def _spread_refuses(g: ConvGeom):
    if not g.cl or (g.kh, g.kw) != (1, 1) or g.stride == (1, 1):
        return "not a channels-last strided 1x1 filter"
    if routes.first(BACKWARD_DATA_ROUTES, _dense(g)).name not in ("x3", "wgmma_tma", "wgmma"):
        return "no wgmma route takes the stride-1 product"
    return None


def _dense(g: ConvGeom) -> ConvGeom:
    """The stride-1 backward-data at the pixels a strided 1x1 filter reaches."""
    return g.replace(h=g.ho, w=g.wo, sh=1, sw=1, ph=0, pw=0)


def _spread(g: ConvGeom):
    """The channels-last backward-data of a strided 1x1 filter (a ResNet shortcut) as the
    stride-1 product at the pixels its taps reach, spread onto x's grid with zeros between
    (transpose.spreader). The one wgmma pass over every pixel of x sums taps that are zeros
    at (s^2 - 1) / s^2 of them: ResNet-18's three shortcuts, batch 256 on 48 x 48 images,
    took 0.227 ms that way and 0.099 this way in fp16, 0.265 / 0.179 in TF32, 0.661 / 0.412
    in fp32 (3xTF32; H200). The same bits."""
    f, dt = "conv2d_backward_data", g.dtype
    inner = routes.choose(BACKWARD_DATA_ROUTES, _dense(g))
    x_shape = nhwc_shape(g.x_shape)
    spread = spreader(x_shape, (g.ho, g.wo), g.stride, g.padding, dt)

    def run(w, gy, bias, out, workspace=None):
        dx = output(f, out, x_shape, dt)
        return spread(inner(w, gy, None, None, workspace), dx)

    def later(w, gy, workspace=None):
        """The product alone, as a Spread (dptrain.backend.spread): its zeros not written."""
        dense = inner(w, gy, None, None, workspace)
        return Spread(dense, x_shape, g.stride, g.padding,
                      lambda: spread(dense, output(f, None, x_shape, dt)))

    run.kernel, run.later = inner.kernel, later
    return run


def _nchw(g: ConvGeom):
    """A channels-last backward-weight on NCHW copies of x and gy (new, so 16-byte aligned);
    the FFMA kernel of conv2d_nhwc.cu reads x as it lies instead."""
    f, dt = "conv2d_backward_weight", g.dtype
    run = routes.choose(BACKWARD_WEIGHT_ROUTES, g.replace(cl=False, x16=True, gy16=True))
    if run.kernel == "conv2d_bwdw_nhwc_fp32_kernel":  # reads x channels-last: as it lies
        return layout.x_as_it_lies(run, layout.to_nchw(g.y_shape, dt))
    return layout.via_nchw(run, f, {0: g.x_shape, 1: g.y_shape}, None, dt)


FORWARD_ROUTES = (
    _empty_route("conv2d_forward", 3, lambda g: (g.npix, g.cout), lambda g: _cl(g, g.y_shape)),
    Route("direct", direct.refuses_forward, direct.forward),
    _x3_route(FORWARD, lambda g: g.replace(c=3 * g.c), lambda: _implicit_routes(0),
              lambda g: {0: tf32x3.splitter(g.w_shape, 1, tf32x3.SECOND),
                         1: tf32x3.splitter(nhwc_shape(g.x_shape), 3, tf32x3.FIRST)}),
    Route("strip", strip.refuses, strip.plan),
    *_implicit_routes(0),
    Route("mma", lambda g: None, lambda g: implicit.plan(g, 0)),
)
BACKWARD_DATA_ROUTES = (
    _empty_route("conv2d_backward_data", 3, lambda g: (g.n * g.h * g.w, g.c),
                 lambda g: _cl(g, g.x_shape)),
    Route("spread", _spread_refuses, _spread),
    _x3_route(BACKWARD_DATA, lambda g: g.replace(cout=3 * g.cout), lambda: _implicit_routes(1),
              lambda g: {0: tf32x3.splitter(g.w_shape, 0, tf32x3.SECOND),
                         1: tf32x3.splitter(nhwc_shape(g.y_shape), 3, tf32x3.FIRST)}),
    *_implicit_routes(1),
    Route("mma", lambda g: None, lambda g: implicit.plan(g, 1)),
)
_BWDW_WGMMA = (Route("strip", strip.refuses_backward_weight, strip.plan_backward_weight),
               Route("bwdw_tma", bwdw_wgmma.refuses_tma, bwdw_wgmma.plan_tma),
               Route("bwdw_wgmma", bwdw_wgmma.refuses, bwdw_wgmma.plan))
BACKWARD_WEIGHT_ROUTES = (
    _empty_route("conv2d_backward_weight", 2, lambda g: (g.cout, g.rows), lambda g: g.w_shape),
    Route("direct", direct.refuses_backward_weight, direct.backward_weight),
    _x3_route(BACKWARD_WEIGHT, lambda g: g.replace(n=3 * g.n, x16=True, gy16=True),
              lambda: _BWDW_WGMMA,
              lambda g: {0: tf32x3.splitter(nhwc_shape(g.x_shape), 0, tf32x3.FIRST),
                         1: tf32x3.splitter(nhwc_shape(g.y_shape), 0, tf32x3.SECOND)},
              more=_x3_bwdw_more),
    *_BWDW_WGMMA,
    Route("nchw", lambda g: None if g.cl else "NCHW operands", _nchw),
    Route("nhwc", nhwc.refuses, nhwc.backward_weight),
    Route("gemm", lambda g: "channels-last operands: planned through NCHW copies" if g.cl
          else None, implicit.backward_weight),
)
TABLES = {FORWARD: FORWARD_ROUTES, BACKWARD_DATA: BACKWARD_DATA_ROUTES,
          BACKWARD_WEIGHT: BACKWARD_WEIGHT_ROUTES}


def explain(pass_: str, g: ConvGeom) -> list[tuple[str, str | None]]:
    """[(route, why it refuses g)] of pass `pass_` ("forward", "backward_data",
    "backward_weight") in order, ending with the route that takes g (why: None)."""
    return routes.explain(TABLES[pass_], g)


def describe(pass_: str, g: ConvGeom) -> str:
    """explain() as one line: "forward 2x64x12x12 * ...: wgmma_tma (passed over direct: ...;
    x3: ...)" (an empty route that refuses not named)."""
    rows = explain(pass_, g)
    passed = "; ".join(f"{name}: {why}" for name, why in rows[:-1] if name != "empty")
    return f"{pass_} {g}: {rows[-1][0]}" + (f" (passed over {passed})" if passed else "")


def _choose(pass_, g):
    routes.check_names(TABLES.values())
    return routes.choose(TABLES[pass_], g)


# --------------------------------------------------------------------- the ops


def _key(v):
    """A hashable stand-in for a stride / padding / shape argument (validated later)."""
    return tuple(v) if isinstance(v, (list, tuple)) else v


@op
def conv2d_forward(x, w, b, stride, padding, *, channels_last=False, out=None, workspace=None):
    """y[n, co] = sum over (ci, kh, kw) of w[co, ci, kh, kw] * x[n, ci, shifted] (+ b[co]);
    x and y are (N, H, W, C) where `channels_last`."""
    return _forward(x, w, b, stride, padding, channels_last)(w, x, b, out, workspace)


def _forward(x, w, b, stride, padding, cl=False):
    f = "conv2d_forward"
    key = (f, sig(f, "x", x), sig(f, "w", w), sig(f, "b", b), _key(stride), _key(padding),
           bool(cl), runtime.precision)
    return plan(key, lambda: _choose(FORWARD, geometry.forward(x, w, b, stride, padding,
                                                               bool(cl))))


@op
def conv2d_forward_stats(x, w, stride, padding, *, channels_last=False, out=None,
                         workspace=None):
    """(y, mean, var): the bias-free conv2d_forward y and batch_norm_stats of it per output
    channel (over the batch and the pixels), for a batch norm that follows in training. Where
    the TMA-fed kernel runs a 16-bit forward, or the direct one writes channels-last, the
    kernel sums each tile's statistics and one small kernel merges them
    (batch_norm_tile_stats): no pass over y. Else the two ops."""
    run = _forward(x, w, None, stride, padding, channels_last)
    tiles = getattr(run, "stat_tiles", None)
    if tiles is None:
        y = run(w, x, None, out, workspace)
        return (y, *batch_norm_stats(y.reshape(-1, y.shape[-1]) if channels_last else y))
    ws = launch.new((tiles, 3, w.shape[0]), np.dtype(np.float32))
    y = run(w, x, None, out, workspace, stats=ws)
    return (y, *batch_norm_tile_stats(ws, y.size // w.shape[0], run.stat_rows))


@op
def conv2d_backward_data(gy, w, x_shape, stride, padding, *, channels_last=False, out=None,
                         workspace=None, spread_later=False):
    """Gradient of conv2d_forward with respect to x, of shape x_shape (both gy and x
    (N, H, W, C) where `channels_last`). `spread_later` (and no `out`): where the pass
    would spread a smaller product onto x's grid (the spread route), it returns that
    product as a Spread (dptrain.backend.spread) instead."""
    run = _backward_data(gy, w, x_shape, stride, padding, channels_last)
    if spread_later and out is None and hasattr(run, "later"):
        return run.later(w, gy, workspace)
    return run(w, gy, None, out, workspace)


def _backward_data(gy, w, x_shape, stride, padding, cl=False):
    f = "conv2d_backward_data"
    key = (f, sig(f, "gy", gy), sig(f, "w", w), _key(x_shape), _key(stride), _key(padding),
           bool(cl), runtime.precision)
    return plan(key, lambda: _choose(BACKWARD_DATA, geometry.backward_data(
        gy, w, x_shape, stride, padding, bool(cl))))


@op
def conv2d_backward_weight(x, gy, w_shape, stride, padding, *, channels_last=False, out=None,
                           workspace=None, add_to=None):
    """Gradient of conv2d_forward with respect to w, of shape w_shape; bitwise repeatable.
    x and gy are (N, H, W, C) where `channels_last`. `add_to`: an array of w_shape, gy's
    dtype or float32 (a 16-bit weight's fp32 .grad), that the gradient is added into, as
    add_ would add it, and returned; a plan whose reducer can add into float32 does so in
    its own pass (`.adds`)."""
    run = _backward_weight(x, gy, w_shape, stride, padding, channels_last)
    if add_to is None:
        return run(x, gy, out, workspace)
    f = "conv2d_backward_weight"
    launch.check_arrays(f, add_to)
    launch.check_contiguous(f, add_to)
    launch.check_shape(f, add_to, tuple(w_shape), "add_to")
    if add_to.dtype not in (gy.dtype, np.float32):
        raise TypeError(f"cuda.{f}: add_to must be float32 or {gy.dtype} like gy, got "
                        f"{add_to.dtype}")
    if getattr(run, "adds", False) and add_to.dtype == np.float32:
        return run(x, gy, None, workspace, add_to=add_to)
    return add_(add_to, run(x, gy, out, workspace))


def _backward_weight(x, gy, w_shape, stride, padding, cl=False):
    f = "conv2d_backward_weight"
    key = (f, sig(f, "x", x), sig(f, "gy", gy), _key(w_shape), _key(stride), _key(padding),
           bool(cl), runtime.precision)
    return plan(key, lambda: _choose(BACKWARD_WEIGHT, geometry.backward_weight(
        x, gy, w_shape, stride, padding, bool(cl))))


def conv2d_kernels(x, w, gy, stride, padding, channels_last=False) -> dict[str, str]:
    """The kernel each pass of this convolution runs, as the plans choose it now (for tests
    and benchmarks): {"forward": ..., "backward_data": ..., "backward_weight": ...}."""
    cl = channels_last
    return {"forward": _forward(x, w, None, stride, padding, cl).kernel,
            "backward_data": _backward_data(gy, w, x.shape, stride, padding, cl).kernel,
            "backward_weight": _backward_weight(x, gy, w.shape, stride, padding, cl).kernel}


@op
def conv2d_channels_last_native(dtype) -> bool:
    """Whether the convolutions read and write channels-last activations of `dtype` as they
    lie under the current precision: the wgmma kernels' (Hopper, 16-bit, TF32, or fp32 as
    3xTF32). Elsewhere a channels-last pass copies its activations to NCHW and back
    (layout.via_nchw), and NCHW activations run faster (ResNet-18 with FFMA fp32
    convolutions: 75.5 against 81.4 ms a step)."""
    dt = np.dtype(dtype)
    return (not routes.refused("wgmma") and wgmma_available()
            and (dt in launch.HALVES or dt == np.float32)
            and (layout.tensor_cores(dt) or tf32x3.enabled(dt) and not routes.refused("x3")))


@op
def conv2d_channels_last_pad(channels, kh, kw, dtype) -> int:
    """Zero input channels a channels-last convolution of `channels` inputs and a kh x kw
    filter should gain (on its input and weight) to run on the native kernels, which gather
    whole 16-byte chunks of channels: 3 -> 8 in 16 bits. ImageNet's stem (7x7/2, batch 128 at
    224 px, bf16, H200): forward with statistics 2.80 -> 0.70 ms, backward-weight 2.28 ->
    0.44 ms (through NCHW copies before). Filters the direct kernels take stay as they are."""
    dt = np.dtype(dtype)
    direct_takes = (0 < channels * kh * kw <= direct.DIRECT_MAX_K
                    and not routes.refused("direct"))
    if not conv2d_channels_last_native(dt) or direct_takes:
        return 0
    return -channels % layout.chunk(dt)
