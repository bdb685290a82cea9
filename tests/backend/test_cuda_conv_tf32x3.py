"""fp32 convolutions as 3xTF32 on Hopper (dptrain/backend/cuda/tf32x3.py, kernels/tf32x3.cu):
the split's parts bit for bit against a NumPy rounding, and each channels-last pass it takes
against the float64 CPU reference within the FFMA kernels' tolerance (relative norm 1e-5,
where TF32's is 5e-3), the passes it leaves to FFMA included. Needs a compute capability
9.0 GPU (skipped elsewhere)."""
import numpy as np
import pytest

from convcheck import F, fresh_conv_plans, hopper_cuda, inputs, reference

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from dptrain.backend.cuda import conv, gemm, launch, tf32x3  # noqa: E402 - after the CuPy check

TOL = 1e-5
PASSES = ("forward", "backward_data", "backward_weight")


@pytest.fixture(scope="module")
def cu():
    return hopper_cuda()


@pytest.fixture(autouse=True)
def fp32(cu, monkeypatch):
    """Every route on, plans rebuilt, fp32."""
    monkeypatch.delenv("DPTRAIN_TEST_ROUTES_OFF", raising=False)
    with fresh_conv_plans(cu), cu.runtime.precision_scope("fp32"):
        yield


def tf32_round(a):
    """cvt.rna.tf32.f32 in NumPy: round the magnitude to 10 mantissa bits, ties away."""
    u = np.asarray(a, np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("shape, axis", [((3, 5, 7, 8), 3), ((3, 5, 7, 8), 0),
                                         ((6, 5, 3, 3), 1), ((2, 3, 5), 2)])
@pytest.mark.parametrize("aligned", [True, False], ids=["vec4", "scalar"])
def test_split_parts_bitwise(cu, shape, axis, aligned):
    """Three parts along `axis` as FIRST / SECOND spell them: hi = tf32(a), lo = tf32(a - hi),
    hi + lo within 2^-22 of a; an unaligned source takes the scalar kernel."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 8, shape)).astype(np.float32)
    a.flat[:3] = (0.0, -0.0, 1.0 + 2.0 ** -11)  # zeros; a tie rounds away from zero
    buf = cp.zeros(a.size + 1, np.float32)
    src = buf[1:] if not aligned else buf[:-1]
    src[...] = cp.asarray(a.ravel())
    src = src.reshape(shape)
    hi = tf32_round(a)
    lo = tf32_round(a - hi)
    assert np.all(np.abs(a - hi - lo) <= 2.0 ** -22 * np.abs(a))
    for parts in (tf32x3.FIRST, tf32x3.SECOND):
        got = cp.asnumpy(tf32x3.splitter(shape, axis, parts)(src))
        want = np.concatenate([lo if p == "l" else hi for p in parts], axis=axis)
        assert got.tobytes() == want.tobytes()


CASES = [  # x shape, w shape, stride, padding, passes as 3xTF32 (forward, data, weight)
    ((2, 64, 6, 6), (128, 64, 3, 3), (1, 1), (1, 1), (True, True, True)),  # TMA-fed
    ((3, 16, 9, 11), (24, 16, 3, 3), (1, 1), (1, 1), (True, True, False)),  # weight: FFMA
    ((2, 16, 11, 11), (136, 16, 3, 3), (2, 2), (1, 1), (True, True, True)),  # phases
    ((2, 128, 6, 6), (256, 128, 1, 1), (2, 2), (0, 0), (True, True, True)),  # a shortcut
    ((2, 24, 8, 8), (40, 24, 1, 1), (1, 1), (0, 0), (False, True, False)),  # direct forward
    ((2, 6, 8, 8), (32, 6, 3, 3), (1, 1), (1, 1), (False, True, False)),  # 18: not chunks
]


def _cl(a):
    return np.ascontiguousarray(np.asarray(a).transpose(0, 2, 3, 1))


def cl_passes(cu, x, w, gy, stride, pad):
    """The three passes on channels-last activations, as float64 NCHW / weight arrays."""
    dx, dw, dgy = cu.asarray(_cl(x)), cu.asarray(w), cu.asarray(_cl(gy))
    y = cu.conv2d_forward(dx, dw, None, stride, pad, channels_last=True)
    gx = cu.conv2d_backward_data(dgy, dw, dx.shape, stride, pad, channels_last=True)
    gw = cu.conv2d_backward_weight(dx, dgy, w.shape, stride, pad, channels_last=True)
    nchw = (lambda a: np.asarray(cp.asnumpy(a), np.float64).transpose(0, 3, 1, 2))
    return nchw(y), nchw(gx), np.asarray(cp.asnumpy(gw), np.float64)


@pytest.mark.parametrize("xs, ws, stride, pad, routed", CASES)
def test_channels_last_fp32_passes_match_reference(cu, xs, ws, stride, pad, routed):
    x, w, gy = inputs(F, xs, ws, stride, pad)
    ran = conv.conv2d_kernels(cu.asarray(_cl(x)), cu.asarray(w), cu.asarray(_cl(gy)),
                                stride, pad, channels_last=True)
    assert tuple(ran[p].startswith("3xtf32 ") for p in PASSES) == routed, ran
    for p, got, want in zip(PASSES, cl_passes(cu, x, w, gy, stride, pad),
                            reference(F, x, w, gy, stride, pad)):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= TOL, f"{p}: relative error {err:.2e}"


def test_switched_off_or_nchw_stays_on_ffma(cu, monkeypatch):
    """The route x3 turned off, or NCHW activations: no pass splits; and under TF32 the
    route does not apply (the operands are rounded to TF32 anyway)."""
    xs, ws, stride, pad, _ = CASES[0]
    x, w, gy = (cu.asarray(a) for a in inputs(F, xs, ws, stride, pad))
    assert not any(k.startswith("3xtf32") for k in conv.conv2d_kernels(
        x, w, gy, stride, pad).values())
    xc, gc = cp.ascontiguousarray(x.transpose(0, 2, 3, 1)), cp.ascontiguousarray(
        gy.transpose(0, 2, 3, 1))
    with cu.runtime.precision_scope("tf32"):
        assert not any(k.startswith("3xtf32") for k in conv.conv2d_kernels(
            xc, w, gc, stride, pad, channels_last=True).values())
        assert cu.conv2d_channels_last_native(np.float32)
    assert cu.conv2d_channels_last_native(np.float32)
    monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", "x3")
    gemm.clear_plans()
    assert not any(k.startswith("3xtf32") for k in conv.conv2d_kernels(
        xc, w, gc, stride, pad, channels_last=True).values())
    assert not cu.conv2d_channels_last_native(np.float32)


def test_repeatable(cu):
    """Same inputs, same bits: the split and the TF32 kernels fix their order of sums."""
    xs, ws, stride, pad, _ = CASES[2]
    x, w, gy = inputs(F, xs, ws, stride, pad)
    first = cl_passes(cu, x, w, gy, stride, pad)
    second = cl_passes(cu, x, w, gy, stride, pad)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, second))


def test_resnet_fp32_alike_either_way(cu, monkeypatch):
    """A small ResNet under fp32: channels_last="auto" now runs channels-last with 3xTF32
    convolutions (layer4's backward-weight included: 128 channels); with the route off it runs
    NCHW on FFMA. Same weights, the same loss and gradients to 1e-4."""
    import dptrain as dp
    from dptrain import nn

    x = np.random.default_rng(0).standard_normal((4, 1, 12, 12)).astype(np.float32)
    model = nn.resnet18((1, 12, 12), 3, widths=(16, 32, 64, 128)).to("cuda")
    results = {}
    for route in ("1", "0"):
        monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", "" if route == "1" else "x3")
        gemm.clear_plans()
        for p in model.parameters():
            p.grad = None
        xt = dp.tensor(x, device="cuda")
        assert model.layout(xt) == (route == "1")
        loss = dp.functional.cross_entropy(model(xt), np.array([0, 2, 1, 0]))
        loss.backward()
        results[route] = [loss.numpy()] + [p.grad.numpy() for p in model.parameters()]
    for got, ref in zip(results["1"], results["0"]):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_fits_bounds_the_tripled_operands_by_int32():
    """tf32x3.fits, which keeps a pass on FFMA where a tripled operand would pass int32
    indexing (a pass that large is not built here)."""
    limit = launch.INT32_MAX
    assert tf32x3.fits(limit // 3, 10)
    assert not tf32x3.fits(10, limit // 3 + 1)
