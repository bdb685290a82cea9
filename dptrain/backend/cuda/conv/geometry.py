"""The geometry of one convolution, checked once for all three passes.

`ConvGeom` mirrors kernels/conv_geom.cuh's struct: the batch, channels, sizes, filter,
stride and padding (the forward's view: C_in summed, C_out produced), plus what the plans
choose by: the element type, the activations' layout (`cl`: (N, H, W, C)) and whether x and
gy start on 16 bytes. `gemm(mode)` is the struct's fields for a forward (mode 0) or
backward-data (mode 1, 2) pass; `replace` makes the variants a route plans (tripled
channels or batch for 3xTF32, NCHW copies, a stride-1 product).

forward(), backward_data() and backward_weight() check a pass's arguments and make its
geometry; every error reads ``cuda.<op>: ...``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dptrain.backend.cuda import launch, tma
from dptrain.backend.cuda.gemm import operand_dtype
from dptrain.backend.cuda.launch import i32


@dataclass(frozen=True)
class ConvGeom:
    n: int  # batch
    c: int  # input channels (summed by the forward)
    h: int
    w: int  # x's height and width
    cout: int  # output channels
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    ho: int
    wo: int  # y's height and width
    dtype: np.dtype  # every operand's
    cl: bool = False  # activations channels-last
    x16: bool = True  # x's start on 16 bytes (backward-weight's routes read it)
    gy16: bool = True  # gy's

    replace = dataclasses.replace

    def __str__(self):  # "16x64x48x48 * 128x3x3 /2 p1 float16 channels-last"
        return (f"{self.n}x{self.c}x{self.h}x{self.w} * {self.cout}x{self.kh}x{self.kw} "
                f"/{self.sh},{self.sw} p{self.ph},{self.pw} {self.dtype}"
                + (" channels-last" if self.cl else "")
                + ("" if self.x16 and self.gy16 else " unaligned"))

    @property
    def stride(self) -> tuple[int, int]:
        return self.sh, self.sw

    @property
    def padding(self) -> tuple[int, int]:
        return self.ph, self.pw

    @property
    def taps(self) -> int:
        return self.kh * self.kw

    @property
    def rows(self) -> int:
        """C_in*KH*KW: backward-weight's rows, the forward's K."""
        return self.c * self.kh * self.kw

    @property
    def npix(self) -> int:
        """Output pixels of the forward over the batch."""
        return self.n * self.ho * self.wo

    @property
    def x_shape(self) -> tuple:
        """x's NCHW shape (whatever its layout)."""
        return (self.n, self.c, self.h, self.w)

    @property
    def y_shape(self) -> tuple:
        """y's (and gy's) NCHW shape."""
        return (self.n, self.cout, self.ho, self.wo)

    @property
    def w_shape(self) -> tuple:
        return (self.cout, self.c, self.kh, self.kw)

    @property
    def x_size(self) -> int:
        return self.n * self.c * self.h * self.w

    @property
    def y_size(self) -> int:
        return self.n * self.cout * self.ho * self.wo

    @property
    def w_size(self) -> int:
        return self.cout * self.c * self.kh * self.kw

    def view(self, mode: int):
        """The implicit GEMM of the forward (mode 0) or backward-data (else): (M, C, source
        (H, W), output (H, W)): M the output's channels, C those summed; the source x and
        output y (forward) or gy and gx (backward-data)."""
        if mode == 0:
            return self.cout, self.c, (self.h, self.w), (self.ho, self.wo)
        return self.c, self.cout, (self.ho, self.wo), (self.h, self.w)

    def gemm(self, mode: int) -> tuple:
        """ConvGeom's Nb M C Hs Ws Ho Wo KH KW sh sw ph pw (kernels/conv_geom.cuh) of view(mode),
        as the kernels' int32 parameters."""
        m, c, src, out = self.view(mode)
        return tuple(i32(v) for v in (self.n, m, c, *src, *out, self.kh, self.kw, self.sh,
                                      self.sw, self.ph, self.pw))


def nhwc_shape(shape):
    """The channels-last (N, H, W, C) shape of NCHW `shape`."""
    n, c, h, w = shape
    return (n, h, w, c)


def nchw_shape(shape):
    """The NCHW shape of channels-last (N, H, W, C) `shape`."""
    n, h, w, c = shape
    return (n, c, h, w)


def _pair(fn: str, name: str, v) -> tuple[int, int]:
    if (not isinstance(v, (tuple, list)) or len(v) != 2
            or not all(isinstance(i, (int, np.integer)) for i in v)):
        raise ValueError(f"cuda.{fn}: {name} must be an (h, w) pair of ints, got {v!r}")
    return int(v[0]), int(v[1])


def _out_size(fn, n, k, s, p, axis):
    o = (n + 2 * p - k) // s + 1 if s >= 1 else 0
    if s < 1 or p < 0 or o < 1:
        raise ValueError(f"cuda.{fn}: size {n}, kernel {k}, stride {s}, padding {p} along "
                         f"{axis} give no output")
    return o


def _checked(f, a, a_name, b, b_name, stride, padding):
    """The checks every pass begins with: (dtype, (sh, sw), (ph, pw))."""
    dt = operand_dtype(f, a)
    launch.check_f32(f, a_name, a, 4, dt)
    launch.check_f32(f, b_name, b, 4, dt)
    return dt, _pair(f, "stride", stride), _pair(f, "padding", padding)


def _geom(f, x_shape, w_shape, stride, padding, dt, cl, **aligned) -> ConvGeom:
    """The geometry of NCHW x_shape and w_shape; out-size errors name `f`."""
    (n, c, h, wd), (cout, _, kh, kw), (sh, sw), (ph, pw) = x_shape, w_shape, stride, padding
    ho, wo = _out_size(f, h, kh, sh, ph, "H"), _out_size(f, wd, kw, sw, pw, "W")
    return ConvGeom(n, c, h, wd, cout, kh, kw, sh, sw, ph, pw, ho, wo, dt, cl, **aligned)


def _check_gy(f, gy, g: ConvGeom):
    gy_shape = nhwc_shape(g.y_shape) if g.cl else g.y_shape
    if gy.shape != gy_shape:
        raise ValueError(f"cuda.{f}: gy has shape {gy.shape}, expected {gy_shape}")


def forward(x, w, b, stride, padding, cl=False) -> ConvGeom:
    f = "conv2d_forward"
    dt, stride, padding = _checked(f, x, "x", w, "w", stride, padding)
    n, c, h, wd = nchw_shape(x.shape) if cl else x.shape
    cout, cin, kh, kw = w.shape
    if cin != c:
        raise ValueError(f"cuda.{f}: x has {c} channels but w {w.shape} expects {cin}")
    if b is not None:
        launch.check_f32(f, "b", b, 1, dt)
        if b.shape[0] != cout:
            raise ValueError(f"cuda.{f}: b has shape {b.shape}, expected ({cout},)")
    return _geom(f, (n, c, h, wd), w.shape, stride, padding, dt, cl)


def backward_data(gy, w, x_shape, stride, padding, cl=False) -> ConvGeom:
    f = "conv2d_backward_data"
    dt, stride, padding = _checked(f, gy, "gy", w, "w", stride, padding)
    x_shape = tuple(int(s) for s in x_shape)
    n, c, h, wd = nchw_shape(x_shape) if cl else x_shape
    cout, cin, kh, kw = w.shape
    if cin != c:
        raise ValueError(f"cuda.{f}: x_shape {x_shape} has {c} channels, w {w.shape} {cin}")
    g = _geom(f, (n, c, h, wd), w.shape, stride, padding, dt, cl)
    _check_gy(f, gy, g)
    return g


def backward_weight(x, gy, w_shape, stride, padding, cl=False) -> ConvGeom:
    f = "conv2d_backward_weight"
    dt, stride, padding = _checked(f, x, "x", gy, "gy", stride, padding)
    n, c, h, wd = nchw_shape(x.shape) if cl else x.shape
    cout, cin, kh, kw = (int(s) for s in w_shape)
    if cin != c:
        raise ValueError(f"cuda.{f}: x has {c} channels but w_shape {tuple(w_shape)} expects {cin}")
    g = _geom(f, (n, c, h, wd), (cout, cin, kh, kw), stride, padding, dt, cl,
              x16=x.data.ptr % 16 == 0, gy16=gy.data.ptr % 16 == 0)
    _check_gy(f, gy, g)
    return g


def tma_slower(mode, stride, ksize) -> bool:
    """Where conv2d_wgmma_kernel takes a pass the TMA kernel could: a strided backward-data
    of a 1x1 filter, whose phases are mostly tiles of zeros (2.4x slower on TMA than the
    gathering kernel's one grid with zero-filled taps, H100, before the TMA kernel's
    ping-pong). Needed as well as faster: such a pass gets no phases (plan's `phased`), and
    the TMA kernel traps on a strided backward-data without them."""
    return mode == 1 and tuple(stride) != (1, 1) and tuple(ksize) == (1, 1)


def tma_box(mode, stride, padding, ksize, src_hw, out_hw, c, dt):
    """The im2col box of conv2d_wgmma_tma_kernel's pixel map as (lower, upper, strides) per
    (h, w), or None where that kernel does not apply: c not in whole 128-byte slabs, phases
    whose base pixels differ, corners past the map's range, or where the gathering kernel
    is faster (tma_slower).
    Forward: the bases o * s - p for o < out. Backward-data: per phase, its pixels i plus
    (r + p - rk) / s - (nk - 1) (conv2d_wgmma.cu), one box for every phase that has taps.
    (ResNet-18's strided backward-data into 64 channels: 169 us gathering, 95 us here.)"""
    if c % (128 // np.dtype(dt).itemsize) or tma_slower(mode, stride, ksize):
        return None
    lower, upper, steps = [], [], []
    for s, p, k, size, out in zip(stride, padding, ksize, src_hw, out_hw):
        if k - 1 > tma.OFFSET_MAX:
            return None
        if mode == 0:
            bases = {(-p, out)}
        else:
            bases = set()
            for r in range(s):
                rk = (r + p) % s
                nk = -(-(k - rk) // s) if rk < k else 0
                if nk:
                    bases.add(((r + p - rk) // s - (nk - 1), -(-(out - r) // s)))
        if len(bases) != 1:
            return None
        (low, count), step = bases.pop(), s if mode == 0 else 1
        high = low + step * (count - 1) - (size - 1)
        if not tma.CORNER_MIN <= min(low, high) <= max(low, high) <= tma.CORNER_MAX:
            return None
        lower.append(low), upper.append(high), steps.append(step)
    return tuple(lower), tuple(upper), tuple(steps)
