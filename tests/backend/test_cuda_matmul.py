"""Our GEMM and implicit-GEMM convolution kernels against the NumPy reference backend.

Fresh random inputs, odd sizes (not only tile multiples), outputs poisoned with NaN before each
launch (both the `out=` buffer and the memory pool that split-K workspaces come from), and the
reference computed in float64. Relative error ||out - ref|| / ||ref|| must stay under 1e-5 for
fp32 and 5e-3 for tf32.
"""
import numpy as np
import pytest

from dptrain.backend import cpu

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from dptrain.backend.cuda import gemm  # noqa: E402 - after the CuPy check

TOL = {"fp32": 1e-5, "tf32": 5e-3}


@pytest.fixture(scope="module")
def cm():
    """The cuda backend (matmul, conv2d_*, matmul_kernel, runtime)."""
    import dptrain.backend.cuda as cuda

    return cuda


@pytest.fixture(params=["fp32", "tf32"])
def prec(request, cm):
    with cm.runtime.precision_scope(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def poison_pool():
    """Leave NaN in the pool, so a workspace element nobody writes shows up in the result."""
    junk = cp.full(16 << 20, np.nan, dtype=np.float32)
    del junk
    yield


_rng = np.random.default_rng(12345)


def rand(*shape):
    return _rng.standard_normal(shape).astype(np.float32)


def nan_like(shape):
    return cp.full(shape, np.nan, dtype=np.float32)


def check(out, ref, prec):
    out = cp.asnumpy(out).astype(np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{np.count_nonzero(~np.isfinite(out))} elements not written"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= TOL[prec], f"relative error {err:.3g} > {TOL[prec]:g} ({prec})"


# ----------------------------------------------------------------------------- matmul

MNK = [
    (1, 1, 1), (7, 33, 65), (65, 7, 33), (33, 65, 7), (129, 257, 65), (257, 129, 33),
    (1, 257, 129), (129, 1, 257), (7, 7, 1000), (33, 17, 3001),  # last two: split-K
    (64, 128, 256), (260, 132, 516), (64, 48, 5000),  # multiples of 4: 16-byte tile loads
    (33, 65, 0),  # empty inner dimension: zeros
    (1537, 1409, 40),  # >= 132 tiles of 128 rows: the 128-row kernels
]


def _operands(batch_a, batch_b, m, n, k, ta, tb):
    a = rand(*batch_a, *((k, m) if ta else (m, k)))
    b = rand(*batch_b, *((n, k) if tb else (k, n)))
    return a, b


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("m,n,k", MNK)
def test_matmul_2d(cm, prec, m, n, k, ta, tb):
    a, b = _operands((), (), m, n, k, ta, tb)
    out = nan_like((m, n))
    got = cm.matmul(cp.asarray(a), cp.asarray(b), ta, tb, out=out)
    assert got is out
    ref = cpu.matmul(a.astype(np.float64), b.astype(np.float64), ta, tb)
    if k == 0:
        assert (cp.asnumpy(got) == 0).all()
    else:
        check(got, ref, prec)


BATCHED = [  # batch_a, batch_b
    ((3,), (3,)), ((3,), ()), ((), (3,)), ((1,), (3,)), ((3,), (1,)), ((2, 3), (2, 3)),
    ((2, 3), ()),
]


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("batch_a,batch_b", BATCHED)
def test_matmul_batched(cm, prec, batch_a, batch_b, ta, tb):
    a, b = _operands(batch_a, batch_b, 33, 17, 65, ta, tb)
    ref = cpu.matmul(a.astype(np.float64), b.astype(np.float64), ta, tb)
    out = nan_like(ref.shape)
    check(cm.matmul(cp.asarray(a), cp.asarray(b), ta, tb, out=out), ref, prec)


@pytest.mark.parametrize("m,n,k", [(65, 33, 129), (8, 16, 3000)])
def test_matmul_bias(cm, prec, m, n, k):
    x, w, bias = rand(m, k), rand(n, k), rand(n)
    got = cm.matmul(cp.asarray(x), cp.asarray(w), trans_b=True, bias=cp.asarray(bias))
    ref = x.astype(np.float64) @ w.astype(np.float64).T + bias
    check(got, ref, prec)


def test_matmul_split_k_repeatable(cm, prec):
    a, b = cp.asarray(rand(40, 3333)), cp.asarray(rand(3333, 24))
    first = cp.asnumpy(cm.matmul(a, b))
    second = cp.asnumpy(cm.matmul(a, b))
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))


def test_matmul_rejects_bad_input(cm):
    a = cp.ones((4, 5), dtype=np.float32)
    with pytest.raises(TypeError, match="float32"):
        cm.matmul(a.astype(np.float64), a, trans_b=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        cm.matmul(a.T, a)
    with pytest.raises(ValueError, match="inner sizes"):
        cm.matmul(a, a)
    with pytest.raises(ValueError, match="do not broadcast"):
        cm.matmul(cp.ones((2, 4, 5), np.float32), cp.ones((3, 5, 2), np.float32))


def test_precision_setting(cm):
    rt = cm.runtime
    old = rt.precision
    assert old in rt.PRECISIONS
    with rt.precision_scope("fp32"):
        assert rt.precision == "fp32"
    assert rt.precision == old
    with pytest.raises(ValueError):
        rt.set_precision("fp16")
    assert rt.precision == old


# ----------------------------------------------------------------------------- conv2d

CONV = [  # n, c_in, h, w, c_out, (kh, kw), stride, padding
    (3, 33, 7, 5, 17, (3, 3), (1, 1), (1, 1)),
    (3, 33, 7, 5, 17, (3, 3), (2, 2), (0, 0)),
    (2, 5, 9, 11, 7, (5, 5), (2, 2), (2, 2)),
    (3, 1, 8, 6, 32, (3, 3), (1, 1), (1, 1)),  # first layer: one input channel
    (2, 32, 12, 10, 64, (3, 3), (1, 1), (1, 1)),  # channels % 32 == 0: one tap per K slab
    (2, 64, 6, 7, 128, (3, 3), (1, 1), (1, 1)),  # 128-row tiles
    (2, 64, 6, 7, 33, (1, 1), (1, 1), (0, 0)),  # 1x1
    (1, 3, 13, 9, 8, (3, 3), (2, 2), (1, 1)),
    (2, 16, 5, 5, 8, (5, 5), (1, 1), (2, 2)),
    (2, 6, 9, 7, 5, (3, 1), (2, 1), (1, 0)),  # non-square kernel, stride and padding
    (2, 8, 10, 9, 16, (2, 3), (1, 2), (0, 2)),  # even kernel
    (4, 32, 24, 24, 64, (3, 3), (1, 1), (1, 1)),  # a reference-CNN layer, smaller batch
    # strided with C_out % 16 == 0: fp32 backward-data by phases (conv2d.cu's mode 2)
    (2, 16, 12, 12, 32, (3, 3), (2, 2), (1, 1)),  # a ResNet stage's first convolution
    (2, 16, 11, 9, 16, (3, 3), (2, 2), (1, 1)),  # odd sizes: phases of unequal pixel counts
    (2, 8, 13, 10, 16, (5, 5), (3, 3), (2, 2)),  # 9 phases of 1 to 4 taps
    (2, 4, 10, 10, 16, (2, 2), (3, 3), (0, 0)),  # phases no tap reaches: zeros
    # C_in*KH*KW <= 32: conv2d_direct.cu (forward up to 128 output channels)
    (24, 1, 48, 48, 32, (3, 3), (1, 1), (1, 1)),  # the reference CNN's first layer
    (2, 3, 9, 7, 130, (3, 3), (1, 1), (1, 1)),  # forward: implicit GEMM; weight grad: direct
    (3, 4, 11, 10, 9, (2, 2), (2, 1), (0, 1)),  # K = 16
    (2, 1, 7, 7, 3, (1, 1), (1, 1), (0, 0)),  # K = 1
    (2, 2, 8, 9, 6, (4, 4), (3, 2), (2, 1)),  # K = 32
]
CONV_IDS = [f"n{c[0]}c{c[1]}h{c[2]}w{c[3]}o{c[4]}k{c[5][0]}{c[5][1]}s{c[6][0]}{c[6][1]}"
            f"p{c[7][0]}{c[7][1]}" for c in CONV]


def _conv_setup(case):
    n, c, h, w, cout, (kh, kw), stride, padding = case
    x, wt = rand(n, c, h, w), rand(cout, c, kh, kw)
    ho = (h + 2 * padding[0] - kh) // stride[0] + 1
    wo = (w + 2 * padding[1] - kw) // stride[1] + 1
    gy = rand(n, cout, ho, wo)
    return x, wt, gy, stride, padding


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", CONV, ids=CONV_IDS)
def test_conv2d_forward(cm, prec, case, with_bias):
    x, wt, gy, stride, padding = _conv_setup(case)
    b = rand(wt.shape[0]) if with_bias else None
    ref = cpu.conv2d_forward(x.astype(np.float64), wt.astype(np.float64),
                             None if b is None else b.astype(np.float64), stride, padding)
    out = nan_like(ref.shape)
    got = cm.conv2d_forward(cp.asarray(x), cp.asarray(wt), None if b is None else cp.asarray(b),
                            stride, padding, out=out)
    assert got is out
    check(got, ref, prec)


@pytest.mark.parametrize("case", CONV, ids=CONV_IDS)
def test_conv2d_backward_data(cm, prec, case):
    x, wt, gy, stride, padding = _conv_setup(case)
    ref = cpu.conv2d_backward_data(gy.astype(np.float64), wt.astype(np.float64), x.shape,
                                   stride, padding)
    out = nan_like(x.shape)
    check(cm.conv2d_backward_data(cp.asarray(gy), cp.asarray(wt), x.shape, stride, padding,
                                  out=out), ref, prec)


@pytest.mark.parametrize("case", CONV, ids=CONV_IDS)
def test_conv2d_backward_weight(cm, prec, case):
    x, wt, gy, stride, padding = _conv_setup(case)
    ref = cpu.conv2d_backward_weight(x.astype(np.float64), gy.astype(np.float64), wt.shape,
                                     stride, padding)
    out = nan_like(wt.shape)
    check(cm.conv2d_backward_weight(cp.asarray(x), cp.asarray(gy), wt.shape, stride, padding,
                                    out=out), ref, prec)


def test_fp32_strided_backward_data_runs_by_phases(cm):
    """Under fp32, strided backward-data of a filter wider than 1x1 over channels in whole
    16-wide slabs runs one grid z per phase; 1x1 filters, stride 1 and other channel counts
    visit every tap (a grid of one)."""
    from dptrain.backend.cuda import conv

    def phases(case):
        x, wt, gy, stride, padding = _conv_setup(case)
        return conv.passes._backward_data(cp.asarray(gy), cp.asarray(wt), x.shape, stride,
                                          padding).phases

    with cm.runtime.precision_scope("fp32"):
        assert phases((2, 16, 12, 12, 32, (3, 3), (2, 2), (1, 1))) == 4
        assert phases((2, 8, 13, 10, 16, (5, 5), (3, 3), (2, 2))) == 9
        assert phases((2, 8, 10, 9, 16, (2, 3), (1, 2), (0, 2))) == 2
        assert phases((2, 16, 12, 12, 32, (1, 1), (2, 2), (0, 0))) == 1
        assert phases((2, 16, 12, 12, 32, (3, 3), (1, 1), (1, 1))) == 1
        assert phases((2, 16, 12, 12, 24, (3, 3), (2, 2), (1, 1))) == 1


def test_conv2d_backward_weight_bitwise_repeatable(cm, prec):
    # Reduces over 8*24*24 pixels: split over K, so this checks the fixed-order reduction.
    x, wt, gy, stride, padding = _conv_setup((8, 32, 24, 24, 64, (3, 3), (1, 1), (1, 1)))
    x, gy = cp.asarray(x), cp.asarray(gy)
    first = cp.asnumpy(cm.conv2d_backward_weight(x, gy, wt.shape, stride, padding))
    second = cp.asnumpy(cm.conv2d_backward_weight(x, gy, wt.shape, stride, padding))
    assert np.isfinite(first).all()
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))


def test_direct_conv_backward_weight_bitwise_repeatable(cm):
    x, wt, gy, stride, padding = _conv_setup((16, 1, 48, 48, 32, (3, 3), (1, 1), (1, 1)))
    x, gy = cp.asarray(x), cp.asarray(gy)
    first = cp.asnumpy(cm.conv2d_backward_weight(x, gy, wt.shape, stride, padding))
    second = cp.asnumpy(cm.conv2d_backward_weight(x, gy, wt.shape, stride, padding))
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))


def test_direct_conv_can_be_turned_off(cm, monkeypatch):
    """The route "direct" turned off takes the implicit GEMM; both paths match the reference."""
    from dptrain.backend.cuda import conv

    x, wt, gy, stride, padding = _conv_setup((4, 1, 12, 12, 8, (3, 3), (1, 1), (1, 1)))
    ref = cpu.conv2d_forward(x.astype(np.float64), wt.astype(np.float64), None, stride, padding)
    dx, dw = cp.asarray(x), cp.asarray(wt)
    check(cm.conv2d_forward(dx, dw, None, stride, padding), ref, "tf32")
    assert "direct" in conv.conv2d_kernels(dx, dw, cp.asarray(gy), stride, padding)["forward"]
    monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", "direct")
    gemm.clear_plans()
    try:
        assert "direct" not in conv.conv2d_kernels(dx, dw, cp.asarray(gy), stride,
                                                   padding)["forward"]
        check(cm.conv2d_forward(cp.asarray(x), cp.asarray(wt), None, stride, padding), ref,
              "tf32")
    finally:
        monkeypatch.undo()
        gemm.clear_plans()


def test_conv2d_rejects_bad_input(cm):
    x, w = cp.ones((2, 3, 8, 8), np.float32), cp.ones((4, 5, 3, 3), np.float32)
    with pytest.raises(ValueError, match="channels"):
        cm.conv2d_forward(x, w, None, (1, 1), (1, 1))
    with pytest.raises(ValueError, match="stride"):
        cm.conv2d_forward(x, cp.ones((4, 3, 3, 3), np.float32), None, 1, (1, 1))


# ----------------------------------------------------------------------------- CUDA graphs


def test_capturable_in_cuda_graph(cm, prec):
    """matmul (split-K) and the three convolutions replay from a CUDA graph: no host sync."""
    a, b = cp.asarray(rand(40, 3333)), cp.asarray(rand(3333, 24))
    x, wt, gy, stride, padding = _conv_setup((4, 32, 24, 24, 64, (3, 3), (1, 1), (1, 1)))
    x, wt, gy = cp.asarray(x), cp.asarray(wt), cp.asarray(gy)

    def step():
        return (cm.matmul(a, b), cm.conv2d_forward(x, wt, None, stride, padding),
                cm.conv2d_backward_data(gy, wt, x.shape, stride, padding),
                cm.conv2d_backward_weight(x, gy, wt.shape, stride, padding))

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        eager = [cp.asnumpy(r) for r in step()]  # compiles and sets kernel attributes
        stream.begin_capture()
        outs = step()
        graph = stream.end_capture()
        for o in outs:
            o.fill(np.nan)  # so the replay must write every element again
        stream.synchronize()
        graph.launch(stream)
        stream.synchronize()
    for e, o in zip(eager, outs):
        np.testing.assert_array_equal(cp.asnumpy(o), e)


# ----------------------------------------------------------------------------- Hopper wgmma

WGMMA = "gemm_wgmma_kernel"


@pytest.fixture
def hopper(cm):
    """tf32 on a compute capability 9.0 device with the wgmma path switched on; plans rebuilt
    before and after, so the environment switch is read afresh."""
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("the wgmma path needs compute capability 9.0")
    gemm.clear_plans()
    with cm.runtime.precision_scope("tf32"):
        yield cm
    gemm.clear_plans()


# (batch_a, batch_b, m, n, k): a @ b^T, each with >= 132 output tiles of 128 x 256.
WGMMA_CASES = [
    ((), (), 1408, 3072, 32),          # 11 x 12 tiles, one K tile (fewer than the prologue)
    ((), (), 1408, 3072, 64),          # two K tiles
    ((), (), 2048, 4352, 160),         # 16 x 17 tiles, K tiles not a multiple of the stages
    ((), (), 4096, 4096, 512),
    ((4,), (4,), 1024, 2048, 288),     # batched: 4 x 8 x 8 tiles
    ((3, 2), (), 1024, 3584, 96),      # batched a, 2-D b: folded into one M = 6144
    ((), (4,), 1024, 2048, 128),       # 2-D a broadcast over a batched b (stride 0)
]


@pytest.mark.parametrize("batch_a,batch_b,m,n,k", WGMMA_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_wgmma_matmul(hopper, batch_a, batch_b, m, n, k, with_bias):
    a, b = _operands(batch_a, batch_b, m, n, k, False, True)
    bias = rand(n) if with_bias else None
    ga, gb = cp.asarray(a), cp.asarray(b)
    gbias = None if bias is None else cp.asarray(bias)
    assert hopper.matmul_kernel(ga, gb, False, True, bias=gbias) == WGMMA
    shape = np.broadcast_shapes(batch_a, batch_b) + (m, n)
    out = nan_like(shape)
    res = hopper.matmul(ga, gb, False, True, bias=gbias, out=out)
    assert res is out
    ref = np.matmul(a.astype(np.float64), np.swapaxes(b.astype(np.float64), -1, -2))
    if bias is not None:
        ref = ref + bias
    check(out, ref, "tf32")
    # a second call on fresh inputs through the cached plan, output allocated by matmul
    a2, b2 = _operands(batch_a, batch_b, m, n, k, False, True)
    res = hopper.matmul(cp.asarray(a2), cp.asarray(b2), False, True, bias=gbias)
    ref2 = np.matmul(a2.astype(np.float64), np.swapaxes(b2.astype(np.float64), -1, -2))
    check(res, ref2 if bias is None else ref2 + bias, "tf32")


def test_wgmma_misaligned_out(hopper):
    m, n, k = 1408, 3072, 64
    a, b = _operands((), (), m, n, k, False, True)
    buf = nan_like((m * n + 1,))
    out = buf[1:].reshape(m, n)  # 4 bytes off: the launcher goes through a copy
    hopper.matmul(cp.asarray(a), cp.asarray(b), False, True, out=out)
    check(out, a.astype(np.float64) @ b.astype(np.float64).T, "tf32")
    assert np.isnan(cp.asnumpy(buf[:1])).all()


# (batch_a, batch_b, m, n, k, ta, tb): the layouts whose MN-major operands are transposed to
# scratch first.
WGMMA_LAYOUTS = [
    ((), (), 2048, 4096, 256, False, False),       # a @ b: b copied
    ((), (), 2048, 4096, 256, True, False),        # a^T @ b: both copied
    ((), (), 2048, 4096, 256, True, True),         # a^T @ b^T: a copied
    ((4,), (4,), 1024, 2048, 288, True, False),    # batched, each matrix copied
    ((3, 2), (), 1024, 3584, 96, False, False),    # folded batch, one b copied
    ((), (4,), 1024, 2048, 128, True, False),      # a broadcast (stride 0): copied once
]


@pytest.mark.parametrize("batch_a,batch_b,m,n,k,ta,tb", WGMMA_LAYOUTS)
def test_wgmma_other_layouts(hopper, batch_a, batch_b, m, n, k, ta, tb):
    a, b = _operands(batch_a, batch_b, m, n, k, ta, tb)
    ga, gb = cp.asarray(a), cp.asarray(b)
    assert hopper.matmul_kernel(ga, gb, ta, tb) == WGMMA
    shape = np.broadcast_shapes(batch_a, batch_b) + (m, n)
    out = nan_like(shape)
    assert hopper.matmul(ga, gb, ta, tb, out=out) is out
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = np.matmul(np.swapaxes(a64, -1, -2) if ta else a64,
                    np.swapaxes(b64, -1, -2) if tb else b64)
    check(out, ref, "tf32")
    assert np.array_equal(cp.asnumpy(ga), a) and np.array_equal(cp.asnumpy(gb), b)  # untouched


@pytest.mark.parametrize("m,n,k,ta,tb,why", [
    (2000, 4096, 256, False, True, "M not a multiple of 128"),
    (2048, 4000, 256, False, True, "N not a multiple of 256"),
    (2048, 4096, 260, False, True, "K not a multiple of 32"),
    (512, 1024, 256, False, True, "16 tiles: under a quarter of the SMs"),
    (16384, 256, 256, True, False, "128 tiles, but an A^T as large as C to transpose"),
    (512, 2304, 64, True, False, "36 tiles, K 64 with an operand to transpose"),
])
def test_wgmma_unsupported_shapes_fall_back(hopper, m, n, k, ta, tb, why):
    a, b = _operands((), (), m, n, k, ta, tb)
    ga, gb = cp.asarray(a), cp.asarray(b)
    assert hopper.matmul_kernel(ga, gb, ta, tb) == "gemm_tf32_kernel", why
    out = nan_like((m, n))
    hopper.matmul(ga, gb, ta, tb, out=out)
    check(out, cpu.matmul(a.astype(np.float64), b.astype(np.float64), ta, tb), "tf32")


@pytest.mark.parametrize("m,n,k,ta,tb,bf16", [
    (512, 2304, 256, True, False, False),   # the MLP's first weight gradient
    (9472, 256, 64, False, True, False),    # the ViT's MLP up-projection: nothing to transpose
    (1024, 2048, 256, False, True, False),
    (9472, 256, 1024, True, False, True),   # 16 bits: from K 1024 on
])
def test_wgmma_takes_products_that_fill_a_quarter_of_the_sms(hopper, m, n, k, ta, tb, bf16):
    """33-131 tiles of 128 x 256 (132 SMs) where wgmma measured faster than split-K; the same
    product 256 rows high (under a quarter of the SMs) stays on split-K."""
    from dptrain.backend.bfloat16 import BFLOAT16

    if 4 * (m // 128) * (n // 256) < gemm.launch.sm_count():
        pytest.skip("fewer SMs than an H100 / H200: these shapes fill under a quarter")
    a, b = _operands((), (), m, n, k, ta, tb)
    ga, gb = cp.asarray(a), cp.asarray(b)
    if bf16:
        ga, gb = hopper.astype(ga, BFLOAT16), hopper.astype(gb, BFLOAT16)
    assert hopper.matmul_kernel(ga, gb, ta, tb) == WGMMA
    low = cp.asarray(_operands((), (), 256, n, k, ta, tb)[0])
    assert hopper.matmul_kernel(hopper.astype(low, ga.dtype), gb, ta, tb) != WGMMA
    if not bf16:
        out = nan_like((m, n))
        hopper.matmul(ga, gb, ta, tb, out=out)
        check(out, cpu.matmul(a.astype(np.float64), b.astype(np.float64), ta, tb), "tf32")


@pytest.mark.parametrize("batch,m,n,k,ta,tb,bias", [
    ((), 256, 512, 2304, False, True, "relu"),   # the MLP's first layer: bias, ReLU in the reduce
    ((), 256, 256, 4608, False, True, "bias"),   # the CNN's fc1 forward
    ((), 128, 256, 2336, False, False, None),     # B transposed first; 73 slabs
    ((2,), 128, 512, 1024, False, False, None),   # batched: partials per matrix
])
def test_wgmma_split_k_matches_reference(hopper, monkeypatch, batch, m, n, k, ta, tb, bias):
    """Products of too few 128 x 256 tiles and K >= 1024 split K on wgmma (float partials,
    gemm.cu's reduce adding bias and ReLU); the route gemm_wgmma_splitk turned off keeps
    gemm.cu's kernels."""
    a, b = _operands(batch, batch, m, n, k, ta, tb)
    ga, gb = cp.asarray(a), cp.asarray(b)
    gbias = cp.asarray(rand(n)) if bias else None
    relu = bias == "relu"
    plan = gemm._matmul_plan(ga, gb, ta, tb, gbias, relu)
    assert plan.kernel == WGMMA and plan.splits > 1
    out = nan_like(batch + (m, n))
    assert plan(ga, gb, gbias, out) is out
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = np.matmul(np.swapaxes(a64, -1, -2) if ta else a64,
                    np.swapaxes(b64, -1, -2) if tb else b64)
    if bias:
        ref = ref + cp.asnumpy(gbias)
    check(out, np.maximum(ref, 0) if relu else ref, "tf32")
    monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", "gemm_wgmma_splitk")
    gemm.clear_plans()
    assert hopper.matmul_kernel(ga, gb, ta, tb, bias=gbias) == "gemm_tf32_kernel"


@pytest.mark.parametrize("m,n,k,ta,tb,why", [
    (128, 256, 2304, True, False, "A transposed first"),
    (256, 512, 512, False, False, "K under 1024"),
])
def test_wgmma_split_k_only_where_measured_faster(hopper, m, n, k, ta, tb, why):
    a, b = _operands((), (), m, n, k, ta, tb)
    assert hopper.matmul_kernel(cp.asarray(a), cp.asarray(b), ta, tb) == "gemm_tf32_kernel", why


def test_wgmma_falls_back_when_misaligned_or_fp32(hopper):
    m, n, k = 1408, 3072, 64
    a, b = _operands((), (), m, n, k, False, True)
    buf = cp.asarray(np.concatenate([rand(1), a.ravel()]))
    ga = buf[1:].reshape(m, k)  # 4 bytes off 16-byte alignment
    assert hopper.matmul_kernel(ga, cp.asarray(b), False, True) == "gemm_tf32_kernel"
    with hopper.runtime.precision_scope("fp32"):
        assert hopper.matmul_kernel(cp.asarray(a), cp.asarray(b), False, True) == \
            "gemm_fp32_kernel"


def test_wgmma_route_turned_off(hopper, monkeypatch):
    m, n, k = 1408, 3072, 64
    a, b = _operands((), (), m, n, k, False, True)
    ga, gb = cp.asarray(a), cp.asarray(b)
    monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", "gemm_wgmma")
    gemm.clear_plans()
    assert hopper.matmul_kernel(ga, gb, False, True) == "gemm_tf32_kernel"
    out = nan_like((m, n))
    hopper.matmul(ga, gb, False, True, out=out)
    check(out, a.astype(np.float64) @ b.astype(np.float64).T, "tf32")
    monkeypatch.delenv("DPTRAIN_TEST_ROUTES_OFF")
    gemm.clear_plans()
    assert hopper.matmul_kernel(ga, gb, False, True) == WGMMA


# ----------------------------------------------------------------------------- linear (+ ReLU)

# (m, n, k): rolled epilogue (odd N), staged, split-K of each, the MLP's first layer
LINEAR = [(65, 33, 129), (64, 128, 256), (8, 16, 3000), (8, 24, 3000), (256, 512, 2304)]


def _as(dtype, x):
    from dptrain.backend.bfloat16 import to_bfloat16

    return cp.asarray(to_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype))


def _values(a):
    from dptrain.backend.bfloat16 import from_bfloat16

    a = cp.asnumpy(a)
    return from_bfloat16(a) if a.dtype == np.uint16 else a.astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", LINEAR)
def test_linear_bias_relu(cm, prec, dtype, m, n, k):
    """linear(x, w, b, relu) against float64, and bitwise equal to its parts: matmul with the
    bias in its epilogue, then relu's own kernel (ReLU commutes with the one rounding)."""
    if dtype != "float32" and prec == "fp32":
        pytest.skip("16-bit operands take one kernel whatever the float32 precision")
    x, w, b = (_as(dtype, a) for a in (rand(m, k), rand(n, k), rand(n)))
    plain = cm.linear(x, w, b)
    fused = cm.linear(x, w, b, relu=True)
    assert cp.array_equal(plain, cm.matmul(x, w, trans_b=True, bias=b))
    assert cp.array_equal(fused, cm.relu(plain))
    xv, wv, bv = (_values(a).astype(np.float64) for a in (x, w, b))
    ref = np.maximum(xv @ wv.T + bv, 0)
    got = _values(fused).astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= (TOL[prec] if dtype == "float32" else 1e-2), err
    assert (got[ref < -1e-2 * np.abs(ref).max()] == 0).all()


def test_linear_without_bias_and_bad_input(cm):
    x, w = cp.asarray(rand(5, 7)), cp.asarray(rand(3, 7))
    assert cp.array_equal(cm.linear(x, w, relu=True), cm.relu(cm.matmul(x, w, trans_b=True)))
    with pytest.raises(ValueError, match="cuda.linear: x and w must be 2-D"):
        cm.linear(x[None], w)


def test_wgmma_linear_relu(hopper):
    x, w, b = cp.asarray(rand(1408, 64)), cp.asarray(rand(3072, 64)), cp.asarray(rand(3072))
    assert hopper.matmul_kernel(x, w, False, True, bias=b) == WGMMA
    plain = hopper.linear(x, w, b)
    assert cp.array_equal(hopper.linear(x, w, b, relu=True), hopper.relu(plain))
    ref = np.maximum(cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w).astype(np.float64).T
                     + cp.asnumpy(b), 0)
    check(hopper.linear(x, w, b, relu=True), ref, "tf32")


# ----------------------------------------------------------------------------- thin products

THIN_CASES = [  # (m, n, k, ta, tb, kernel): a classifier head's products in every layout
    (256, 7, 256, False, True, "gemm_thin_n_kernel"),   # x @ W^T: a warp per row
    (64, 10, 256, True, False, "gemm_thin_n_kernel"),
    (300, 16, 33, False, False, "gemm_thin_n_kernel"),  # the 16-column instantiation
    (256, 256, 7, False, False, "gemm_thin_k_kernel"),  # dY @ W: a thread per output
    (33, 1000, 16, True, True, "gemm_thin_k_kernel"),
]


@pytest.mark.parametrize("m,n,k,ta,tb,kernel", THIN_CASES)
def test_thin_products_match_reference(cm, prec, m, n, k, ta, tb, kernel):
    """Products with N or K at most 16 run gemm_thin.cu's kernels in float (no TF32 rounding:
    fp32's tolerance in both precisions), bias and ReLU in the store, bitwise repeatable."""
    a, b = _operands((), (), m, n, k, ta, tb)
    ga, gb = cp.asarray(a), cp.asarray(b)
    assert cm.matmul_kernel(ga, gb, ta, tb) == kernel
    ref = cpu.matmul(a.astype(np.float64), b.astype(np.float64), ta, tb)
    out = nan_like((m, n))
    check(cm.matmul(ga, gb, ta, tb, out=out), ref, "fp32")
    assert cp.array_equal(out, cm.matmul(ga, gb, ta, tb))
    bias = cp.asarray(rand(n))
    relu = gemm._matmul_plan(ga, gb, ta, tb, bias, relu=True)(ga, gb, bias, None)
    check(relu, np.maximum(ref + cp.asnumpy(bias), 0), "fp32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,ta,tb,kernel", THIN_CASES[:5:2])
def test_thin_products_in_16_bits(cm, dtype, m, n, k, ta, tb, kernel):
    """16-bit operands: float sums, the result rounded once (1e-2 of the float64 reference
    of the rounded operands)."""
    a, b = (_as(dtype, x) for x in _operands((), (), m, n, k, ta, tb))
    assert cm.matmul_kernel(a, b, ta, tb) == kernel
    got = _values(cm.matmul(a, b, ta, tb)).astype(np.float64)
    ref = cpu.matmul(_values(a).astype(np.float64), _values(b).astype(np.float64), ta, tb)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-2


@pytest.mark.parametrize("m,n,k,ta,tb,why", [
    (7, 256, 256, True, False, "M small (dY^T @ X): a block per 32 columns measured slower"),
    (256, 7, 512, False, True, "N small, but K over 256"),
    (4096, 1024, 8, False, False, "over THIN_MACS multiply-adds"),
    (4096, 1024, 0, False, False, "K 0, but as many outputs as THIN_MACS allows products"),
    (2, 8, 4, False, False, "a batch of products"),
])
def test_thin_kernels_only_where_measured_faster(cm, m, n, k, ta, tb, why):
    batch = (3,) if "batch" in why else ()
    a, b = (cp.asarray(x) for x in _operands(batch, batch, m, n, k, ta, tb))
    assert "thin" not in cm.matmul_kernel(a, b, ta, tb), why


def test_thin_route_turned_off(cm, monkeypatch):
    a, b = cp.asarray(rand(256, 256)), cp.asarray(rand(7, 256))
    monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", "gemm_thin")
    gemm.clear_plans()
    assert "thin" not in cm.matmul_kernel(a, b, False, True)
    monkeypatch.delenv("DPTRAIN_TEST_ROUTES_OFF")
    gemm.clear_plans()
    assert cm.matmul_kernel(a, b, False, True) == "gemm_thin_n_kernel"


# ----------------------------------------------------------------------------- adds in place

@pytest.mark.parametrize("m,n,k,ta", [(65, 33, 129, False), (512, 2304, 256, True),
                                      (8, 16, 3000, False), (7, 256, 256, True),
                                      (16, 12, 7, True), (256, 256, 7, False),
                                      (1408, 3072, 64, False)])
def test_matmul_add_equals_matmul_then_add(cm, prec, m, n, k, ta):
    """c += op(a) @ b, by split-K's reduce where the product splits K or the thin kernels'
    store (a dimension of at most 16), else matmul and add_: the bits of matmul then add_
    either way."""
    a = cp.asarray(rand(*((k, m) if ta else (m, k))))
    b, c = cp.asarray(rand(k, n)), cp.asarray(rand(m, n))
    want = cm.add_(c.copy(), cm.matmul(a, b, ta))
    got = c.copy()
    assert cm.matmul_add_(got, a, b, ta) is got
    assert cp.array_equal(got, want)
    with pytest.raises(ValueError, match="float32 2-D operands only"):
        cm.matmul_add_(c.astype(np.float16), a.astype(np.float16), b.astype(np.float16), ta)


@pytest.mark.parametrize("m,n,k,ta", [(65, 33, 129, False), (512, 2304, 256, True),
                                      (8, 16, 3000, False), (7, 256, 256, True),
                                      (1408, 3072, 64, False)])
def test_matmul_into_writes_matmul_into_c(cm, prec, m, n, k, ta):
    """c = op(a) @ b into c itself (split-K's reduce with beta 0, or the tiles' stores):
    matmul's bits, c's old contents (NaN) never read."""
    a = cp.asarray(rand(*((k, m) if ta else (m, k))))
    b = cp.asarray(rand(k, n))
    c = cp.full((m, n), np.nan, np.float32)
    assert cm.matmul_into_(c, a, b, ta) is c
    assert cp.array_equal(c, cm.matmul(a, b, ta))
    with pytest.raises(ValueError, match="out has shape"):
        cm.matmul_into_(cp.zeros((m, n + 1), np.float32), a, b, ta)


@pytest.mark.parametrize("shape", [(256, 512), (5000, 64), (3, 8, 5, 5), (0, 4), (6, 9000)],
                         ids=str)
def test_bias_grad_add_equals_bias_grad_then_add(cm, shape):
    """dst += bias_grad(gy) by the sum's last kernel (one-launch column sums, the two-pass
    ones, the channel sums of NCHW, the generic reduce): the bits of bias_grad then add_."""
    gy, dst = cp.asarray(rand(*shape)), cp.asarray(rand(shape[1]))
    want = cm.add_(dst.copy(), cm.bias_grad(gy))
    got = dst.copy()
    assert cm.bias_grad_add_(got, gy) is got
    assert cp.array_equal(got, want)
