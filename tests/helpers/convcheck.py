"""Shared by the GPU convolution tests: inputs, the float64 CPU reference of the three passes,
and the relative-norm comparison with each precision's tolerance (the TF32 and 16-bit ones of
test_cuda_matmul.py and test_cuda_amp.py)."""
import contextlib

import numpy as np
import pytest

from dptrain import backend
from dptrain.backend.bfloat16 import BFLOAT16, from_bfloat16, to_bfloat16

H = np.dtype(np.float16)
F = np.dtype(np.float32)
TOL = {F: 5e-3, H: 2e-3, BFLOAT16: 1.6e-2}
DTYPES = [pytest.param(F, id="tf32"), pytest.param(H, id="fp16"), pytest.param(BFLOAT16, id="bf16")]
cpu = backend.get("cpu")


def hopper_cuda():
    """The CUDA backend where the GPU runs wgmma (compute capability 9.0); else the test is
    skipped. For the module fixtures of the Hopper kernels' tests."""
    import cupy

    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("wgmma needs compute capability 9.0")
    return backend.get("cuda")


def to_dt(x, dt):
    return to_bfloat16(x) if dt == BFLOAT16 else np.asarray(x, np.float32).astype(dt)


def to_f32(a, dt):
    return from_bfloat16(a) if dt == BFLOAT16 else np.asarray(a).astype(np.float32)


def rand(dt, shape, seed):
    return to_dt(np.random.default_rng(seed).standard_normal(shape), dt)


def close(got, ref, dt, factor=1.0):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "elements not written"
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= TOL[dt] * factor, f"relative error {err:.2e} > {TOL[dt] * factor:.1e}"


def passes(cu, dt, x, w, gy, stride, pad):
    """The three passes on the device, as float32 NumPy arrays."""
    dx, dw, dgy = cu.asarray(x), cu.asarray(w), cu.asarray(gy)
    out = (cu.conv2d_forward(dx, dw, None, stride, pad),
           cu.conv2d_backward_data(dgy, dw, x.shape, stride, pad),
           cu.conv2d_backward_weight(dx, dgy, w.shape, stride, pad))
    return [to_f32(cu.to_numpy(o), dt) for o in out]


def planned_kernels(cu, x, w, gy, stride, pad):
    """The kernel each pass's plan picks for these host inputs (conv.conv2d_kernels)."""
    from dptrain.backend.cuda import conv

    return conv.conv2d_kernels(cu.asarray(x), cu.asarray(w), cu.asarray(gy), stride, pad)


def routes_off(monkeypatch, *names):
    """Turn the named kernel routes off (DPTRAIN_TEST_ROUTES_OFF; the list replaces any set
    before: none given, every route on) and rebuild the plans."""
    from dptrain.backend.cuda import gemm

    monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", ",".join(names))
    gemm.clear_plans()


def reference(dt, x, w, gy, stride, pad):
    x, w, gy = (to_f32(a, dt).astype(np.float64) for a in (x, w, gy))
    return (cpu.conv2d_forward(x, w, None, stride, pad),
            cpu.conv2d_backward_data(gy, w, x.shape, stride, pad),
            cpu.conv2d_backward_weight(x, gy, w.shape, stride, pad))


def passes_match_reference(cu, dt, x, w, gy, stride, pad):
    """The three passes on the device against the float64 reference, each within dt's
    tolerance (twice it for backward-weight's long sums)."""
    got, ref = passes(cu, dt, x, w, gy, stride, pad), reference(dt, x, w, gy, stride, pad)
    for g, r, factor in zip(got, ref, (1, 1, 2)):
        close(g, r, dt, factor)


def inputs(dt, xs, ws, stride, pad):
    ho = (xs[2] + 2 * pad[0] - ws[2]) // stride[0] + 1
    wo = (xs[3] + 2 * pad[1] - ws[3]) // stride[1] + 1
    return (rand(dt, xs, 1), to_dt(np.random.default_rng(2).standard_normal(ws) * 0.2, dt),
            rand(dt, (xs[0], ws[0], ho, wo), 3))


@contextlib.contextmanager
def fresh_conv_plans(cu):
    """TF32 for float32, launch plans rebuilt on entry and exit (so DPTRAIN_TEST_ROUTES_OFF is
    read afresh), and NaN left in CuPy's memory pool, so an element a kernel fails to write
    shows up as NaN."""
    import cupy
    from dptrain.backend.cuda import gemm

    gemm.clear_plans()
    junk = cupy.full(16 << 20, np.nan, dtype=np.float32)
    del junk
    try:
        with cu.runtime.precision_scope("tf32"):
            yield
    finally:
        gemm.clear_plans()
