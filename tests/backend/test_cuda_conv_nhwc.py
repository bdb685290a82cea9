"""The channels-last backward-weight kernels (kernels/conv2d_nhwc.cu) in TF32, fp16 and bf16
(and the FFMA one under fp32, within 1e-5: test_cuda_matmul.py's fp32 tolerance) against the
CPU backend (with the other two passes on the same shapes), on shapes that take it
(C_in and Ho*Wo in whole 16-byte chunks) and reach its edges: partial tiles, strides, a 1x1
filter, a non-square filter and split-K; the NCHW kernel on the same inputs agrees, and a
misaligned gy falls back to it. Tolerances: the TF32 and 16-bit ones of test_cuda_matmul.py and
test_cuda_amp.py (relative norm error 5e-3 for TF32; 2e-3 / 1.6e-2 for fp16 / bf16, twice
that for backward-weight's long sums)."""
import numpy as np
import pytest

from convcheck import (DTYPES, F, H, close, fresh_conv_plans, inputs, passes,
                       passes_match_reference, planned_kernels, reference, routes_off, to_f32)
from dptrain import backend

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from dptrain.backend.cuda import conv  # noqa: E402 - after the CuPy check

NHWC_KERNEL = "conv2d_bwdw_nhwc_kernel"
OFF = ("direct", "bwdw_tma", "bwdw_wgmma")  # the routes these tests turn off
FP32_NHWC_KERNEL = "conv2d_bwdw_nhwc_fp32_kernel"
CASES = [  # x shape, w shape, stride, padding
    ((4, 32, 12, 12), (64, 32, 3, 3), (1, 1), (1, 1)),  # a reference-CNN layer
    ((2, 16, 10, 8), (24, 16, 3, 3), (1, 1), (1, 1)),  # 144 columns: a partial 96-column tile
    ((3, 8, 9, 16), (136, 8, 3, 3), (2, 2), (1, 1)),  # stride 2, two 128-row tiles
    ((2, 24, 8, 8), (40, 24, 1, 1), (1, 1), (0, 0)),  # 1x1: K = 24, one partial slab
    ((2, 8, 12, 12), (16, 8, 5, 3), (1, 2), (2, 1)),  # non-square filter, uneven stride
    ((64, 32, 8, 8), (32, 32, 3, 3), (1, 1), (1, 1)),  # K = 4096 pixels: split over grid z
]


@pytest.fixture(scope="module")
def cu():
    return backend.get("cuda")


@pytest.fixture(autouse=True)
def fresh_plans(cu, monkeypatch):
    """The direct kernels off (they would take the small-K cases, the 1x1 one included) and so
    is the Hopper wgmma backward-weight (test_cuda_conv_wgmma.py); TF32 for float; plans rebuilt
    so DPTRAIN_TEST_ROUTES_OFF is read afresh; NaN in the pool."""
    routes_off(monkeypatch, *OFF)
    with fresh_conv_plans(cu):
        yield


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad", CASES)
def test_channels_last_passes_match_reference(cu, dt, xs, ws, stride, pad):
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    assert planned_kernels(cu, x, w, gy, stride, pad)["backward_weight"] == NHWC_KERNEL
    passes_match_reference(cu, dt, x, w, gy, stride, pad)


@pytest.mark.parametrize("dt", DTYPES)
def test_channels_last_and_nchw_kernels_agree(cu, dt, monkeypatch):
    xs, ws, stride, pad = CASES[0]
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    nhwc = passes(cu, dt, x, w, gy, stride, pad)
    routes_off(monkeypatch, *OFF, "nhwc")
    assert planned_kernels(cu, x, w, gy, stride, pad)["backward_weight"] != NHWC_KERNEL
    nchw = passes(cu, dt, x, w, gy, stride, pad)
    for a, b in zip(nhwc, nchw):
        close(a, b, dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_misaligned_gy_falls_back(cu, dt):
    """Backward-weight reads gy in 16-byte chunks; a view that starts mid-chunk takes the
    NCHW kernel and gives the same result."""
    xs, ws, stride, pad = CASES[0]
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    dx = cu.asarray(x)
    flat = cp.empty(gy.size + 1, dtype=gy.dtype)
    shifted = flat[1:].reshape(gy.shape)  # 2 or 4 bytes past an aligned start
    shifted[...] = cp.asarray(gy)
    assert shifted.data.ptr % 16 != 0
    nchw = "conv2d_bwdw_tf32_kernel" if dt == F else "conv2d_bwdw_b16_kernel"
    assert conv.conv2d_kernels(dx, cu.asarray(w), shifted, stride, pad)["backward_weight"] == nchw
    got = to_f32(cu.to_numpy(cu.conv2d_backward_weight(dx, shifted, ws, stride, pad)), dt)
    want = to_f32(cu.to_numpy(cu.conv2d_backward_weight(dx, cu.asarray(gy), ws, stride, pad)), dt)
    close(got, want, dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_backward_weight_bitwise_repeatable(cu, dt):
    xs, ws, stride, pad = CASES[-1]  # split over K: the fixed-order reduction
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    dx, dgy = cu.asarray(x), cu.asarray(gy)
    first = cu.to_numpy(cu.conv2d_backward_weight(dx, dgy, ws, stride, pad))
    second = cu.to_numpy(cu.conv2d_backward_weight(dx, dgy, ws, stride, pad))
    assert first.tobytes() == second.tobytes()


@pytest.mark.parametrize("shape", [(3, 40, 7, 9), (2, 66, 10, 13), (2, 130, 7, 10)])
def test_to_nhwc_is_a_transpose(cu, shape):
    """Both transpose kernels (16-bit pairs where the sides are even), partial tiles."""
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    for dt in (F, H):
        a = x.astype(dt)
        got = cp.asnumpy(conv.layout.to_nhwc(a.shape, dt)(cp.asarray(a)))
        assert np.array_equal(got, a.transpose(0, 2, 3, 1))


def fp32_passes_match_reference(cu, x, w, gy, stride, pad, kernel):
    with cu.runtime.precision_scope("fp32"):
        assert planned_kernels(cu, x, w, gy, stride, pad)["backward_weight"] == kernel
        got = passes(cu, F, x, w, gy, stride, pad)
    for g, r in zip(got, reference(F, x, w, gy, stride, pad)):
        err = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert err <= 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("xs, ws, stride, pad", CASES)
def test_fp32_channels_last_backward_weight_matches_reference(cu, xs, ws, stride, pad):
    """Under fp32 the FFMA channels-last kernel takes every filter wider than 1x1 whose C_in
    is in whole 16-byte chunks (gy gathered element by element: no condition on Ho*Wo); a 1x1
    filter keeps the NCHW kernel (measured faster there)."""
    kernel = FP32_NHWC_KERNEL if ws[2] * ws[3] > 1 else "conv2d_bwdw_fp32_kernel"
    fp32_passes_match_reference(cu, *inputs(F, xs, ws, stride, pad), stride, pad, kernel)


def test_fp32_nchw_backward_weight_where_channels_leave_chunks_or_switched_off(cu, monkeypatch):
    xs, ws, stride, pad = (2, 6, 9, 9), (12, 6, 3, 3), (1, 1), (1, 1)  # 6 channels: not chunks
    fp32_passes_match_reference(cu, *inputs(F, xs, ws, stride, pad), stride, pad,
                                "conv2d_bwdw_fp32_kernel")
    xs, ws, stride, pad = CASES[0]
    routes_off(monkeypatch, *OFF, "nhwc")
    fp32_passes_match_reference(cu, *inputs(F, xs, ws, stride, pad), stride, pad,
                                "conv2d_bwdw_fp32_kernel")
