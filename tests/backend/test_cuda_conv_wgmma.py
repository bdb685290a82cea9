"""The Hopper convolution kernels against the float64 CPU reference: kernels/conv2d_wgmma.cu
(forward and backward-data on wgmma, channels-last gathers or TMA, 64-channel tiles plain or
turned around; TF32, fp16 and bf16) and kernels/conv2d_bwdw_wgmma.cu (backward-weight, both
operands channels-last, its pixels split or not; fp16 and bf16 gathered or fed by TMA, and
TF32 through its register-staged loader). The shapes reach their edges: partial pixel and
channel tiles, a partial K slab, strides (backward-data's phases of output pixels, those no
tap reaches included), padding, 1x1 and non-square filters, a bias. The mma.sync kernels
agree on the same inputs, channels not in whole 16-byte chunks fall back to them, and
results repeat bitwise. Needs a compute capability 9.0 GPU (skipped elsewhere). Tolerances:
convcheck.TOL."""
import numpy as np
import pytest

from convcheck import (DTYPES, close, cpu, fresh_conv_plans, hopper_cuda, inputs, passes,
                       passes_match_reference, planned_kernels, reference, routes_off, to_dt,
                       to_f32)

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from dptrain.backend.cuda import conv, gemm, launch  # noqa: E402 - after the CuPy check

WGMMA = "conv2d_wgmma_kernel"
WGMMA_TMA = "conv2d_wgmma_tma_kernel"
WGMMA_BWDW = "conv2d_bwdw_wgmma_kernel"
WGMMA_BWDW_TF32 = "conv2d_bwdw_wgmma_tf32_kernel"
TMA_BWDW = "conv2d_bwdw_tma_kernel"
HALVES = DTYPES[1:]


def _channels_last(a):
    return np.ascontiguousarray(np.asarray(a).transpose(0, 2, 3, 1))


def bwdw_kernel(dt, ws):
    """The wgmma backward-weight kernel of dtype dt and weight shape ws, or None where TF32's
    C_in*KH*KW is too short for it (TF32_BWDW_MIN_ROWS)."""
    if np.dtype(dt).itemsize == 2:
        return WGMMA_BWDW
    return WGMMA_BWDW_TF32 if np.prod(ws[1:]) >= conv.bwdw_wgmma.TF32_BWDW_MIN_ROWS else None


# Off unless a test turns them on: the TMA-fed kernels (their own tests) and the direct
# kernels (they would take the small-K cases, the 1x1 one included)
OFF = ("wgmma_tma", "bwdw_tma", "direct")
CASES = [  # x shape, w shape, stride, padding
    ((4, 32, 12, 12), (64, 32, 3, 3), (1, 1), (1, 1)),  # a reference-CNN layer (K = 288)
    ((2, 64, 6, 6), (128, 64, 3, 3), (1, 1), (1, 1)),  # the next one: a 128-channel tile
    ((3, 16, 9, 11), (24, 16, 3, 3), (1, 1), (1, 1)),  # 24 channels of a 32 tile; 297 pixels
    ((2, 8, 10, 10), (136, 8, 3, 3), (2, 2), (1, 1)),  # stride 2; K = 72, a partial slab
    ((2, 24, 8, 8), (40, 24, 1, 1), (1, 1), (0, 0)),  # 1x1: K = 24
    ((2, 16, 12, 12), (48, 16, 5, 3), (1, 2), (2, 1)),  # non-square filter, uneven stride
    ((2, 16, 9, 9), (32, 16, 1, 1), (2, 2), (0, 0)),  # backward-data: phases no tap reaches
    ((2, 16, 11, 11), (24, 16, 3, 3), (2, 2), (1, 1)),  # phases of 6x6, 6x5, 5x6, 5x5 pixels
    ((2, 8, 13, 13), (16, 8, 5, 5), (3, 3), (2, 2)),  # stride 3: nine phases, 1-2 taps each
    ((64, 64, 16, 16), (32, 64, 3, 3), (1, 1), (1, 1)),  # 16,384 pixels: many blocks
]


@pytest.fixture(scope="module")
def cu():
    return hopper_cuda()


@pytest.fixture(autouse=True)
def fresh_plans(cu, monkeypatch):
    """The routes in OFF off (the gathering wgmma kernels run); TF32 for float; plans rebuilt
    so DPTRAIN_TEST_ROUTES_OFF is read afresh; NaN in the pool."""
    routes_off(monkeypatch, *OFF)
    with fresh_conv_plans(cu):
        yield


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad", CASES)
def test_wgmma_passes_match_reference(cu, dt, xs, ws, stride, pad):
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    ran = planned_kernels(cu, x, w, gy, stride, pad)
    assert ran["forward"] == WGMMA
    assert ran["backward_data"] == WGMMA
    want = bwdw_kernel(dt, ws)
    assert ran["backward_weight"] == want if want else ran["backward_weight"] != WGMMA_BWDW_TF32
    passes_match_reference(cu, dt, x, w, gy, stride, pad)


TMA_CASES = [  # x shape, w shape, stride, padding; channels in whole 128-byte slabs
    ((2, 64, 6, 6), (128, 64, 3, 3), (1, 1), (1, 1)),  # 72 pixels: one partial tile
    ((3, 64, 9, 11), (64, 64, 3, 3), (1, 1), (1, 1)),  # rows wrapping mid-tile, 3 images
    ((2, 128, 10, 10), (128, 128, 3, 3), (2, 2), (1, 1)),  # backward-data: 4 phases, one box
    ((2, 128, 11, 11), (64, 128, 3, 3), (2, 2), (1, 1)),  # odd: phases of 6 and 5 (no TMA)
    ((2, 128, 12, 12), (64, 128, 1, 1), (2, 2), (0, 0)),  # a shortcut (forward only)
    ((2, 64, 12, 12), (96, 64, 5, 3), (1, 2), (2, 1)),  # non-square filter, uneven stride
    ((2, 64, 9, 9), (64, 64, 5, 5), (1, 1), (2, 2)),  # padding 2: five taps each way
    ((64, 64, 24, 24), (64, 64, 3, 3), (1, 1), (1, 1)),  # 288 tiles: each block walks several
    ((16, 128, 16, 16), (128, 128, 3, 3), (2, 2), (1, 1)),  # phases over several tiles
]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad", TMA_CASES)
def test_tma_fed_kernel_is_bitwise_the_same(cu, dt, xs, ws, stride, pad, monkeypatch):
    """The TMA-fed kernel loads the same slabs (the im2col map's
    zero fill standing for the gathers' padding) and multiplies them in the same order as
    conv2d_wgmma_kernel, so both passes agree to the bit, and with the reference. The
    forward always takes it here; backward-data where one box serves every phase."""
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    base = passes(cu, dt, x, w, gy, stride, pad)[:2]
    routes_off(monkeypatch, "direct")
    ran = planned_kernels(cu, x, w, gy, stride, pad)
    assert ran["forward"] == WGMMA_TMA
    (n, c, h, wd), (cout, _, kh, kw) = xs, ws
    box = conv.wgmma.tma_box(1, stride, pad, (kh, kw), gy.shape[2:], (h, wd), cout, dt)
    assert ran["backward_data"] == (WGMMA_TMA if box else WGMMA)
    for got, want in zip(passes(cu, dt, x, w, gy, stride, pad)[:2], base):
        assert got.tobytes() == want.tobytes()
    passes_match_reference(cu, dt, x, w, gy, stride, pad)


STRIP = "conv2d_strip_kernel"
STRIP_CASES = [  # x shape, w shape, stride, padding: 16-bit pixels of one 16-byte chunk
    ((2, 8, 20, 12), (64, 8, 7, 4), (2, 1), (3, 2)),  # the stem over column pairs: K = 224
    ((64, 8, 40, 24), (64, 8, 7, 4), (2, 1), (3, 2)),  # 1,280 rows: each block walks several
    ((2, 8, 9, 11), (40, 8, 7, 4), (1, 1), (0, 0)),  # 40 channels; no padding, stride 1
    ((3, 8, 7, 125), (96, 8, 7, 4), (3, 1), (2, 1)),  # rows of 124 pixels; two channel tiles
    ((2, 8, 9, 127), (64, 8, 7, 4), (1, 1), (0, 2)),  # rows of exactly 128 pixels: none idle
    ((2, 8, 9, 20), (8, 8, 7, 4), (2, 1), (3, 2)),  # 8 output channels: gy's boxes mostly zeros
]


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("xs, ws, stride, pad", STRIP_CASES)
def test_strip_forward_is_bitwise_the_gathering_kernel(cu, dt, xs, ws, stride, pad,
                                                       monkeypatch):
    """conv2d_strip.cu reads each output row's im2col matrix in place from a strip of input
    rows: the channels-last forward (with a bias) equals conv2d_wgmma_kernel's to the bit,
    and its per-row statistics agree with the statistics pass as
    test_turned_tiles_equal_the_gathering_kernel says."""
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    b = to_dt(np.linspace(-1, 1, ws[0], dtype=np.float32), dt)
    dw, db, xl = cu.asarray(w), cu.asarray(b), cu.asarray(_channels_last(x))

    def run(kernel, *off):
        routes_off(monkeypatch, *off)
        assert conv.passes._forward(xl, dw, db, stride, pad, True).kernel == kernel
        out = [cu.conv2d_forward(xl, dw, db, stride, pad, channels_last=True),
               *cu.conv2d_forward_stats(xl, dw, stride, pad, channels_last=True)]
        return [cu.to_numpy(a) for a in out]

    strip = run(STRIP, "direct")
    plain = run(WGMMA, "direct", "strip", "wgmma_tma")
    for got, want in zip(strip[:2], plain[:2]):
        assert got.tobytes() == want.tobytes()
    spread = np.sqrt(plain[3].astype(np.float64)) + 1e-30
    assert np.all(np.abs(strip[2] - plain[2]) <= 2e-5 * spread)
    assert np.all(np.abs(strip[3] - plain[3]) <= 4e-5 * plain[3] + 1e-30)
    y = to_f32(strip[0], dt).transpose(0, 3, 1, 2)
    close(y, reference(dt, x, w, gy, stride, pad)[0] + to_f32(b, dt)[:, None, None], dt)


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("xs, ws, stride, pad", STRIP_CASES)
def test_strip_backward_weight_matches_reference(cu, dt, xs, ws, stride, pad, monkeypatch):
    """conv2d_strip_bwdw_kernel (up to 64 output channels) reads the same strips as wgmma's
    MN-major B and gy's rows as its A: the weight gradient agrees with the float64
    reference within twice dt's tolerance, as the other backward-weight kernels', and
    repeats to the bit."""
    routes_off(monkeypatch, "direct")
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    xl, gyl = cu.asarray(_channels_last(x)), cu.asarray(_channels_last(gy))
    run = conv.passes._backward_weight(xl, gyl, ws, stride, pad, True)
    assert (run.kernel == "conv2d_strip_bwdw_kernel") == (ws[0] <= 64)

    def gw():
        return cu.to_numpy(cu.conv2d_backward_weight(xl, gyl, ws, stride, pad,
                                                     channels_last=True))

    first = gw()
    assert first.tobytes() == gw().tobytes()
    close(to_f32(first, dt), reference(dt, x, w, gy, stride, pad)[2], dt, 2)
    grad = np.random.default_rng(4).standard_normal(ws).astype(np.float32)
    into = cu.asarray(grad)  # added into a float .grad by the reducer, as add_ would
    cu.conv2d_backward_weight(xl, gyl, ws, stride, pad, channels_last=True, add_to=into)
    assert cu.to_numpy(into).tobytes() == (grad + to_f32(first, dt)).tobytes()


def test_strip_refusals_say_why(cu, monkeypatch):
    """The strip kernel takes only what its descriptor reads right: each refusal names why."""
    routes_off(monkeypatch)
    f16 = np.float16

    def why(xs, ws, stride, pad, cl=True):
        x = cu.asarray(np.zeros(xs, f16))
        g = conv.geometry.forward(x, cu.asarray(np.zeros(ws, f16)), None, stride, pad, cl=cl)
        return dict(conv.explain(conv.FORWARD, g)).get("strip", "not reached")

    assert why((2, 20, 12, 8), (64, 8, 7, 4), (2, 1), (3, 2)) is None
    assert "a 7x3 filter" in why((2, 20, 12, 8), (64, 8, 7, 3), (2, 1), (3, 1))
    assert "stride along the rows" in why((2, 20, 12, 8), (64, 8, 7, 4), (2, 2), (3, 2))
    assert "16-byte chunk" in why((2, 20, 12, 16), (64, 16, 7, 4), (1, 1), (1, 2))
    assert "over 128 pixels" in why((1, 8, 140, 8), (64, 8, 7, 4), (1, 1), (1, 2))
    assert "channels-last" in why((2, 8, 20, 12), (64, 8, 7, 4), (2, 1), (3, 2), cl=False)


STORE_CASES = [  # x shape, w shape, stride, padding: channels-last outputs of the TMA kernel
    ((2, 64, 6, 6), (128, 64, 3, 3), (1, 1), (1, 1)),  # 72 pixels: one partial tile, two boxes
    ((3, 64, 9, 11), (96, 64, 3, 3), (1, 1), (1, 1)),  # 96 of 128 channels: the second box clipped
    ((2, 128, 7, 7), (72, 128, 3, 3), (1, 1), (1, 1)),  # 72: a box of 8 channels
    ((2, 64, 8, 8), (68, 64, 3, 3), (1, 1), (1, 1)),  # 68: rows not in 16 bytes (stored as pairs)
    ((64, 64, 24, 24), (64, 64, 3, 3), (1, 1), (1, 1)),  # 288 tiles: staging reused per turn
    ((8, 128, 12, 12), (256, 128, 1, 1), (2, 2), (0, 0)),  # a strided shortcut, two channel tiles
    ((4, 128, 12, 12), (128, 128, 3, 3), (2, 2), (1, 1)),  # backward-data by phases: rolled stores
]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad", STORE_CASES)
def test_tma_stores_equal_the_register_stores(cu, dt, xs, ws, stride, pad, monkeypatch):
    """16-bit tiles of 64 or 128 channels leave the TMA kernel through shared memory: by a
    TMA store where channels-last boxes of 128 pixels x 64 channels fit (clipped at the
    tensor's edges), else by a rolled loop (NCHW, phases, rows not in 16 bytes); other tiles
    straight from the registers. All hold the same accumulators, so the forward (with a bias)
    and backward-data agree to the bit, channels-last against NCHW, whichever store ran."""
    routes_off(monkeypatch, "direct")
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    b = to_dt(np.linspace(-1, 1, ws[0], dtype=np.float32), dt)
    dx, dw, db, dgy = cu.asarray(x), cu.asarray(w), cu.asarray(b), cu.asarray(gy)
    xl, gyl = cu.asarray(_channels_last(x)), cu.asarray(_channels_last(gy))
    y = cu.to_numpy(cu.conv2d_forward(dx, dw, db, stride, pad))
    yl = cu.to_numpy(cu.conv2d_forward(xl, dw, db, stride, pad, channels_last=True))
    run = conv.passes._forward(xl, dw, db, stride, pad, True)
    assert run.kernel == WGMMA_TMA
    # 16-bit tiles of whole 16-byte rows leave by TMA stores: the case the test is for
    assert run.tma_store == (np.dtype(dt).itemsize == 2 and ws[0] % 8 == 0)
    assert _channels_last(y).tobytes() == yl.tobytes()
    nhwc = (xs[0], xs[2], xs[3], xs[1])
    gx = cu.to_numpy(cu.conv2d_backward_data(dgy, dw, xs, stride, pad))
    gxl = cu.to_numpy(cu.conv2d_backward_data(gyl, dw, nhwc, stride, pad, channels_last=True))
    assert _channels_last(gx).tobytes() == gxl.tobytes()
    close(to_f32(y, dt), reference(dt, x, w, gy, stride, pad)[0] + to_f32(b, dt)[:, None, None],
          dt)


TURN_CASES = [  # x shape, w shape, stride, padding: 16-bit TMA tiles of 64 channels
    ((3, 64, 9, 11), (64, 64, 3, 3), (1, 1), (1, 1)),  # rows wrapping mid-tile, 3 images
    ((2, 64, 6, 6), (40, 64, 3, 3), (1, 1), (1, 1)),  # 40 of 64 channels; a partial tile
    ((2, 128, 12, 12), (64, 128, 1, 1), (2, 2), (0, 0)),  # a shortcut (forward only)
    ((2, 64, 9, 9), (64, 64, 5, 5), (1, 1), (2, 2)),  # padding 2: five taps each way
    ((8, 128, 12, 12), (64, 128, 3, 3), (2, 2), (1, 1)),  # backward-data by phases: rolled
    ((64, 64, 24, 24), (64, 64, 3, 3), (1, 1), (1, 1)),  # 288 tiles: both warpgroups, turns
]


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("xs, ws, stride, pad", TURN_CASES)
def test_turned_tiles_equal_the_gathering_kernel(cu, dt, xs, ws, stride, pad, monkeypatch):
    """The TMA kernel's 16-bit tiles of 64 channels, computed turned around (the weights as
    wgmma's A), hold the same sums as conv2d_wgmma_kernel's, so the forward (with a bias;
    NCHW and channels-last) and backward-data equal the gathering kernel's to the bit; the
    epilogue's statistics and batch_norm_stats' (each within 1e-5 of the spread of float64
    statistics, test_forward_statistics_from_the_epilogue) agree within twice that."""
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    b = to_dt(np.linspace(-1, 1, ws[0], dtype=np.float32), dt)
    dx, dw, db, dgy = cu.asarray(x), cu.asarray(w), cu.asarray(b), cu.asarray(gy)
    xl = cu.asarray(_channels_last(x))

    def run(tma):
        routes_off(monkeypatch, *(("direct",) if tma else ("direct", "wgmma_tma")))
        kernel = conv.passes._forward(dx, dw, db, stride, pad).kernel
        assert kernel == (WGMMA_TMA if tma else WGMMA)
        y, mean, var = cu.conv2d_forward_stats(xl, dw, stride, pad, channels_last=True)
        return [cu.to_numpy(a) for a in (
            cu.conv2d_forward(dx, dw, db, stride, pad),
            cu.conv2d_forward(xl, dw, db, stride, pad, channels_last=True),
            cu.conv2d_backward_data(dgy, dw, xs, stride, pad), y, mean, var)]

    plain = run(False)
    turned = run(True)
    ctype = "__half" if np.dtype(dt) == np.float16 else "__nv_bfloat16"
    assert any(name.startswith(f"{WGMMA_TMA}<{ctype}, 64, true") for name in _instantiations(
        lambda: conv.passes._forward(dx, dw, db, stride, pad)))
    for got, want in zip(turned[:4], plain[:4]):
        assert got.tobytes() == want.tobytes()
    spread = np.sqrt(plain[5].astype(np.float64)) + 1e-30
    assert np.all(np.abs(turned[4] - plain[4]) <= 2e-5 * spread)
    assert np.all(np.abs(turned[5] - plain[5]) <= 4e-5 * plain[5] + 1e-30)


RESIDENT_CASES = [  # x shape, w shape, stride, padding: 16-bit passes whose weights stay
    ((3, 64, 9, 11), (64, 64, 3, 3), (1, 1), (1, 1)),  # turned, 9 slabs: RES_BYTES exactly
    ((64, 64, 24, 24), (64, 64, 3, 3), (1, 1), (1, 1)),  # 288 tiles: both warpgroups, turns
    ((2, 64, 6, 6), (40, 64, 3, 3), (1, 1), (1, 1)),  # 40 of 64 channels: rows zero-filled
    ((4, 64, 12, 12), (256, 64, 1, 1), (1, 1), (0, 0)),  # 128 tiles, two of them; one slab
    ((4, 256, 8, 8), (64, 256, 1, 1), (1, 1), (0, 0)),  # 4 slabs; backward-data: 2 tiles
    ((2, 128, 12, 12), (64, 128, 1, 1), (2, 2), (0, 0)),  # a strided shortcut's forward
]


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("xs, ws, stride, pad", RESIDENT_CASES)
def test_resident_weights_give_the_streamed_bits(cu, dt, xs, ws, stride, pad, monkeypatch):
    """Where every weight slab of a one-phase pass fits RES_BYTES, the TMA kernel loads them
    once a block and its stages carry the pixels alone; the wgmmas read the same slabs in
    the same order, so the forward (NCHW and channels-last, a bias, the epilogue's
    statistics) and backward-data equal the kernel that streams the weights, to the bit."""
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    b = to_dt(np.linspace(-1, 1, ws[0], dtype=np.float32), dt)
    dx, dw, db, dgy = cu.asarray(x), cu.asarray(w), cu.asarray(b), cu.asarray(gy)
    xl = cu.asarray(_channels_last(x))
    nhwc = (xs[0], xs[2], xs[3], xs[1])
    gyl = cu.asarray(_channels_last(gy))

    def run(res):
        routes_off(monkeypatch, *(("direct",) if res else ("direct", "wgmma_resident")))
        forward = _instantiations(lambda: conv.passes._forward(xl, dw, None, stride, pad, True))
        assert any(n.startswith(WGMMA_TMA) and n.endswith(("true, true>", "false, true>")) == res
                   for n in forward)
        y, mean, var = cu.conv2d_forward_stats(xl, dw, stride, pad, channels_last=True)
        outs = [cu.conv2d_forward(dx, dw, db, stride, pad),
                cu.conv2d_forward(xl, dw, db, stride, pad, channels_last=True), y, mean, var]
        if stride == (1, 1):  # one phase (a strided 1x1 spreads the stride-1 product)
            outs += [cu.conv2d_backward_data(dgy, dw, xs, stride, pad),
                     cu.conv2d_backward_data(gyl, dw, nhwc, stride, pad, channels_last=True)]
        return [cu.to_numpy(a).tobytes() for a in outs]

    assert run(True) == run(False)


def test_resident_weights_only_where_they_fit():
    """RES takes 16-bit tiles of 64 or 128 channels of one phase whose slabs fit 72 KB."""
    resident = conv.wgmma.resident
    assert resident(64, 576, np.float16, 1)  # 3x3 over 64: 9 slabs of 64 rows
    assert resident(256, 64, np.float16, 1)  # two 128-channel tiles of one slab
    assert not resident(128, 1152, np.float16, 1)  # 3x3 over 128: 288 KB
    assert not resident(64, 576, np.float16, 4)  # backward-data by phases
    assert not resident(32, 64, np.float16, 1)  # 32-channel tiles stream
    assert not resident(64, 256, np.float32, 1)  # TF32 streams


def _instantiations(plan):
    """The kernel instantiations plan() requests, planned afresh (launch.recording)."""
    with launch.recording() as seen:
        gemm.clear_plans()
        plan()
    return {name for _, name in seen}


SPREAD_CASES = [  # x shape, w shape, stride, padding: strided 1x1 filters' backward-data
    ((2, 64, 12, 12), (128, 64, 1, 1), (2, 2), (0, 0)),  # a ResNet shortcut: 64-channel tiles
    ((2, 128, 9, 9), (256, 128, 1, 1), (2, 2), (0, 0)),  # odd: x's last row and column reached
    ((2, 64, 10, 11), (64, 64, 1, 1), (2, 3), (1, 1)),  # uneven stride, padding: edges dropped
    ((3, 20, 8, 8), (64, 20, 1, 1), (2, 2), (0, 0)),  # 20 channels: 16-bit rows not in 16 bytes
    ((2, 64, 12, 12), (24, 64, 1, 1), (2, 2), (0, 0)),  # gy's 24 channels: the gathering kernel
]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad", SPREAD_CASES)
def test_strided_1x1_backward_data_spreads_the_dense_product(cu, dt, xs, ws, stride, pad,
                                                             monkeypatch):
    """A strided 1x1 filter's channels-last backward-data (route "spread"):
    the stride-1 product at the pixels the filter reaches, spread onto x with zeros between.
    It sums the same slabs in the same order as the one pass over every pixel of x with
    zero-filled taps (the route turned off), so both agree to the bit, and with the
    reference; the pixels no tap reaches hold exact zeros."""
    routes_off(monkeypatch, "direct")
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    dw, gyl = cu.asarray(w), cu.asarray(_channels_last(gy))
    nhwc = (xs[0], xs[2], xs[3], xs[1])

    def backward_data():
        gemm.clear_plans()
        return cu.to_numpy(cu.conv2d_backward_data(gyl, dw, nhwc, stride, pad,
                                                   channels_last=True))

    seen = _instantiations(lambda: conv.passes._backward_data(gyl, dw, nhwc, stride, pad, True))
    vector = xs[1] * np.dtype(dt).itemsize % 16 == 0
    assert any(name.startswith("stride_spread_kernel") for name in seen)
    assert ("stride_spread_kernel<uint4>" in seen) == vector
    spread = backward_data()
    routes_off(monkeypatch, "direct", "spread")
    assert not any(name.startswith("stride_spread_kernel") for name in _instantiations(
        lambda: conv.passes._backward_data(gyl, dw, nhwc, stride, pad, True)))
    assert spread.tobytes() == backward_data().tobytes()
    reached = np.zeros(nhwc[1:3], bool)
    reached[(-pad[0]) % stride[0]::stride[0], (-pad[1]) % stride[1]::stride[1]] = True
    assert not to_f32(spread, dt)[:, ~reached].any()
    close(to_f32(spread, dt).transpose(0, 3, 1, 2), reference(dt, x, w, gy, stride, pad)[1], dt)


STATS_CASES = [  # x shape, w shape, stride, padding, offset of x; forward on the TMA kernel
    ((2, 64, 6, 6), (128, 64, 3, 3), (1, 1), (1, 1), 0),  # 72 pixels: one partial tile
    ((3, 64, 9, 11), (96, 64, 3, 3), (1, 1), (1, 1), 3),  # 96 of a 128 tile; means >> spread
    ((64, 64, 24, 24), (64, 64, 3, 3), (1, 1), (1, 1), 0),  # 288 tiles: both warpgroups, turns
    ((8, 64, 12, 12), (32, 64, 1, 1), (2, 2), (0, 0), 1),  # a 32 tile: a strided shortcut
    ((16, 128, 16, 16), (256, 128, 3, 3), (2, 2), (1, 1), 0),  # two channel tiles
]


@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dt", DTYPES[1:])
@pytest.mark.parametrize("xs, ws, stride, pad, offset", STATS_CASES)
def test_forward_statistics_from_the_epilogue(cu, dt, xs, ws, stride, pad, offset, cl,
                                               monkeypatch):
    """conv2d_forward_stats on the TMA-fed 16-bit forward: y is conv2d_forward's, to the bit;
    mean and variance (each tile's float sums about its first pixel, merged in double) are
    the float64 statistics of y as stored within 1e-5 of its spread (the variance within
    2e-5 of itself), as close as batch_norm_stats' (one read of y) are; tiles of every
    width sum them, to the same bits each time. Where the gathering kernel runs, they are
    batch_norm_stats' bits."""
    routes_off(monkeypatch, "direct")
    x, w, _ = inputs(dt, xs, ws, stride, pad)
    x = to_dt(to_f32(x, dt) + offset, dt)
    dx, dw = cu.asarray(_channels_last(x) if cl else x), cu.asarray(w)
    run = conv.passes._forward(dx, dw, None, stride, pad, cl)
    assert run.kernel == WGMMA_TMA and run.stat_tiles is not None
    y, mean, var = cu.conv2d_forward_stats(dx, dw, stride, pad, channels_last=cl)
    plain = cu.conv2d_forward(dx, dw, None, stride, pad, channels_last=cl)
    assert cu.to_numpy(y).tobytes() == cu.to_numpy(plain).tobytes()
    rows = y.reshape(-1, ws[0]) if cl else y
    y64 = to_f32(cu.to_numpy(y), dt).astype(np.float64)
    y64 = y64.reshape(-1, ws[0]) if cl else y64.transpose(0, 2, 3, 1).reshape(-1, ws[0])
    ref_mean, ref_var = y64.mean(axis=0), y64.var(axis=0)
    spread = np.sqrt(ref_var) + 1e-30
    for got_mean, got_var in ((mean, var), cu.batch_norm_stats(rows)):
        got_mean, got_var = cu.to_numpy(got_mean), cu.to_numpy(got_var)
        assert got_mean.dtype == got_var.dtype == np.float32
        assert np.all(np.abs(got_mean - ref_mean) <= 1e-5 * spread)
        assert np.all(np.abs(got_var - ref_var) <= 2e-5 * ref_var + 1e-30)
    again = cu.conv2d_forward_stats(dx, dw, stride, pad, channels_last=cl)[1:]
    for got, want in zip(again, (mean, var)):
        assert cu.to_numpy(got).tobytes() == cu.to_numpy(want).tobytes()
    routes_off(monkeypatch, "direct", "wgmma_tma")
    assert conv.passes._forward(dx, dw, None, stride, pad, cl).stat_tiles is None
    _, mean0, var0 = cu.conv2d_forward_stats(dx, dw, stride, pad, channels_last=cl)
    for got, want in zip((mean0, var0), cu.batch_norm_stats(rows)):
        assert cu.to_numpy(got).tobytes() == cu.to_numpy(want).tobytes()


def test_tma_box_covers_resnet_passes():
    """ResNet-18's passes fit one box (stride 1 and 2, 3x3 and 1x1, even sizes, into 64
    channels too); the strided backward-data of 1x1 filters stays on the gathering kernel."""
    bf16 = np.dtype(np.uint16)

    def box(mode, stride, pad, k, src, out, c):
        return conv.wgmma.tma_box(mode, stride, pad, k, src, out, c, bf16)

    s1, s2, p1, p0, k3, k1 = (1, 1), (2, 2), (1, 1), (0, 0), (3, 3), (1, 1)
    assert box(0, s1, p1, k3, (48, 48), (48, 48), 64) == ((-1, -1), (-1, -1), (1, 1))
    assert box(0, s2, p1, k3, (48, 48), (24, 24), 64) == ((-1, -1), (-2, -2), (2, 2))
    assert box(0, s2, p0, k1, (48, 48), (24, 24), 64) == ((0, 0), (-1, -1), (2, 2))
    assert box(1, s1, p1, k3, (24, 24), (24, 24), 128) == ((-1, -1), (-1, -1), (1, 1))
    assert box(1, s2, p1, k3, (12, 12), (24, 24), 256) == ((0, 0), (0, 0), (1, 1))
    assert box(1, s2, p1, k3, (24, 24), (48, 48), 128) == ((0, 0), (0, 0), (1, 1))  # into 64
    assert box(1, s2, p0, k1, (12, 12), (24, 24), 256) is None  # phases of zeros
    assert box(1, s2, p1, k3, (6, 6), (11, 11), 128) is None  # phases of 6 and 5
    assert box(0, s1, p1, k3, (48, 48), (48, 48), 32) is None  # half a slab


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad, split", [
    ((2, 256, 6, 6), (512, 256, 3, 3), (1, 1), (1, 1), False),  # 36 tiles, 72 pixels: one split
    ((64, 64, 16, 16), (32, 64, 3, 3), (1, 1), (1, 1), True),  # 16,384 pixels: many splits
    ((16, 128, 12, 12), (128, 128, 1, 1), (2, 2), (0, 0), True),  # a ResNet shortcut
])
def test_wgmma_backward_weight_with_and_without_splits(cu, dt, xs, ws, stride, pad, split):
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    assert planned_kernels(cu, x, w, gy, stride, pad)["backward_weight"] == bwdw_kernel(dt, ws)
    bwdw = conv.passes._backward_weight(cu.asarray(x), cu.asarray(gy), ws, stride, pad)
    assert (bwdw.splits > 1) == split
    got = to_f32(cu.to_numpy(cu.conv2d_backward_weight(cu.asarray(x), cu.asarray(gy), ws,
                                                       stride, pad)), dt)
    x64, gy64 = (to_f32(a, dt).astype(np.float64) for a in (x, gy))
    close(got, cpu.conv2d_backward_weight(x64, gy64, ws, stride, pad), dt, 2)


@pytest.mark.parametrize("dt", DTYPES)
def test_wgmma_backward_weight_agrees_with_the_mma_kernel(cu, dt, monkeypatch):
    xs, ws, stride, pad = CASES[0]
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    fast = passes(cu, dt, x, w, gy, stride, pad)[2]
    routes_off(monkeypatch, *OFF, "bwdw_wgmma")
    assert planned_kernels(cu, x, w, gy, stride, pad)["backward_weight"] != bwdw_kernel(dt, ws)
    close(fast, passes(cu, dt, x, w, gy, stride, pad)[2], dt, 2)


T128, T192 = (128, 128), (64, 192)
TMA_BWDW_CASES = [  # x shape, w shape, stride, padding, the tile
    ((2, 64, 10, 10), (64, 64, 3, 3), (1, 1), (1, 1), T192),  # ResNet's first stage; a partial slab
    ((4, 64, 12, 12), (128, 64, 3, 3), (1, 1), (2, 2), T192),  # 128 channels; padding 2: 14 x 14
    ((2, 128, 7, 9), (40, 128, 3, 3), (1, 1), (1, 1), T192),  # 40 of a 64-channel tile; 6 j tiles
    ((3, 192, 5, 5), (72, 192, 1, 1), (1, 1), (0, 0), T192),  # 1x1: one j tile; two m tiles
    ((64, 64, 16, 16), (64, 64, 3, 3), (1, 1), (1, 1), T192),  # 16,384 pixels: many splits
    ((2, 512, 3, 3), (512, 512, 3, 3), (1, 1), (1, 1), T192),  # 144 tiles of one slab: one split
    ((2, 128, 8, 8), (136, 128, 3, 3), (1, 1), (1, 1), T192),  # 136 channels: 8 of a third tile
    ((4, 256, 8, 8), (136, 256, 1, 1), (1, 1), (0, 0), T128),  # 128 x 128 tiles: 8 of the second
    ((16, 256, 12, 12), (256, 256, 3, 3), (1, 1), (1, 1), T128),  # 128 x 128 tiles, splits
]


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("xs, ws, stride, pad, tile", TMA_BWDW_CASES)
def test_tma_backward_weight_matches_reference(cu, dt, xs, ws, stride, pad, tile, monkeypatch):
    """conv2d_bwdw_tma_kernel (route "bwdw_tma") within the 16-bit tolerance
    of float64, as close to the gathering wgmma kernel, bitwise repeatable, channels-last
    bitwise the same."""
    routes_off(monkeypatch, "direct")
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    dx, dgy = cu.asarray(x), cu.asarray(gy)
    assert planned_kernels(cu, x, w, gy, stride, pad)["backward_weight"] == TMA_BWDW
    run = conv.passes._backward_weight(dx, dgy, ws, stride, pad)
    splits = run.splits
    assert run.tile == tile
    if xs[1] == 512:
        assert splits == 1  # gw written by the tiles themselves
    elif xs[0] >= 16:
        assert splits > 1
    run = lambda: cu.to_numpy(cu.conv2d_backward_weight(dx, dgy, ws, stride, pad))  # noqa: E731
    got = run()
    assert got.tobytes() == run().tobytes()
    x64, gy64 = (to_f32(a, dt).astype(np.float64) for a in (x, gy))
    close(to_f32(got, dt), cpu.conv2d_backward_weight(x64, gy64, ws, stride, pad), dt, 2)
    xl, gyl = cu.asarray(_channels_last(x)), cu.asarray(_channels_last(gy))
    cl = cu.conv2d_backward_weight(xl, gyl, ws, stride, pad, channels_last=True)
    assert cu.to_numpy(cl).tobytes() == got.tobytes()
    routes_off(monkeypatch, "direct", "bwdw_tma")
    assert planned_kernels(cu, x, w, gy, stride, pad)["backward_weight"] == WGMMA_BWDW
    close(to_f32(got, dt), to_f32(run(), dt), dt, 2)


REDUCE_CASES = [  # dtype, x shape, w shape, stride, padding: backward-weight split over
    # pixels, on tiles that fill 132 SMs (so the tiled reduce runs by default)
    (HALVES[0], (16, 256, 12, 12), (256, 256, 3, 3), (1, 1), (1, 1)),  # TMA
    (HALVES[1], (8, 256, 12, 12), (136, 256, 3, 3), (2, 2), (1, 1)),  # partial tiles both ways
    (HALVES[0], (8, 576, 12, 12), (1056, 576, 1, 1), (2, 2), (0, 0)),  # 1x1: one tap
    (DTYPES[0], (16, 256, 12, 12), (256, 256, 3, 3), (1, 1), (1, 1)),  # TF32's float partials
]


@pytest.mark.parametrize("dt, xs, ws, stride, pad", REDUCE_CASES)
def test_tiled_reduce_equals_a_thread_per_output(cu, dt, xs, ws, stride, pad, monkeypatch):
    """The split-K partials summed a tile at a time through shared memory (where the tiles
    fill the SMs) and a thread per output (route "bwdw_reduce_tiled" turned off): the same
    additions in the same order, so the same bits. Both add into a float .grad (add_to=) in
    their own pass as add_ of the gradient would."""
    dt = dt.values[0]
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    dx, dgy = cu.asarray(_channels_last(x)), cu.asarray(_channels_last(gy))
    grad = np.random.default_rng(4).standard_normal(ws).astype(np.float32)

    def run(tiled):
        routes_off(monkeypatch, *(("direct",) if tiled else ("direct", "bwdw_reduce_tiled")))
        assert conv.passes._backward_weight(dx, dgy, ws, stride, pad, True).splits > 1
        seen = _instantiations(lambda: conv.passes._backward_weight(dx, dgy, ws, stride, pad, True))
        assert any(name.startswith("conv2d_bwdw_reduce_tiled_kernel") for name in seen) == tiled
        into = cu.asarray(grad)
        assert cu.conv2d_backward_weight(dx, dgy, ws, stride, pad, channels_last=True,
                                         add_to=into) is into
        return (cu.to_numpy(cu.conv2d_backward_weight(dx, dgy, ws, stride, pad,
                                                      channels_last=True)), cu.to_numpy(into))

    got, added = run(True)
    assert added.tobytes() == (grad + to_f32(got, dt)).tobytes()
    assert [a.tobytes() for a in run(False)] == [got.tobytes(), added.tobytes()]
    close(to_f32(got, dt), reference(dt, x, w, gy, stride, pad)[2], dt, 2)


def test_tma_backward_weight_tiles_as_measured(monkeypatch):
    """The tiling's estimate ranks ResNet-18's stride-1 3x3 passes (batch 256, 48 x 48 images,
    132 SMs) as measured: 128 x 128 tiles for its 128- and 256-channel stages, 64 x 192 for
    64 channels (the only tile there) and for 512 (0.099 against 0.110 ms, fp16, H200)."""
    monkeypatch.setattr(launch, "sm_count", lambda: 132)
    tiles = {c: conv.bwdw_wgmma.tma_tiling(c, 9 * c, 256 * (3072 // c) ** 2)[:2]
             for c in (64, 128, 256, 512)}
    assert tiles == {64: (64, 192), 128: (128, 128), 256: (128, 128), 512: (64, 192)}
    assert conv.bwdw_wgmma.tma_tiling(64, 64, 4096) is None  # 64 columns: neither tile fits


@pytest.mark.parametrize("xs, ws, stride, pad", [
    ((2, 32, 8, 8), (64, 32, 3, 3), (1, 1), (1, 1)),  # 32 channels: half a 128-byte slab
    ((2, 64, 8, 8), (64, 64, 1, 1), (1, 1), (0, 0)),  # 64 columns: a third of a tile
    ((4, 64, 12, 12), (128, 64, 3, 3), (2, 2), (1, 1)),  # a stride: slower here (measured)
])
def test_tma_backward_weight_leaves_what_it_cannot_take(cu, xs, ws, stride, pad, monkeypatch):
    routes_off(monkeypatch, "direct")
    x, w, gy = inputs(HALVES[0].values[0], xs, ws, stride, pad)
    assert planned_kernels(cu, x, w, gy, stride, pad)["backward_weight"] == WGMMA_BWDW


def test_tf32_backward_weight_takes_wgmma_where_its_rows_fill_a_tile(cu, monkeypatch):
    """By default TF32 backward-weight runs on wgmma where it measured faster: C_in*KH*KW of
    TF32_BWDW_MIN_ROWS or more; below, conv2d_nhwc.cu's kernel."""
    f32, nhwc = DTYPES[0].values[0], "conv2d_bwdw_nhwc_kernel"
    for cin, k, kernel in ((64, 1, nhwc), (128, 1, WGMMA_BWDW_TF32), (64, 3, WGMMA_BWDW_TF32)):
        gemm.clear_plans()
        x, w, gy = inputs(f32, (2, cin, 6, 6), (64, cin, k, k), (1, 1), (k // 2, k // 2))
        assert planned_kernels(cu, x, w, gy, (1, 1), (k // 2,) * 2)["backward_weight"] == kernel
    assert conv.bwdw_wgmma.TF32_BWDW_MIN_ROWS == 128


@pytest.mark.parametrize("dt", DTYPES)
def test_bias_in_the_epilogue(cu, dt):
    xs, ws, stride, pad = CASES[2]
    x, w, _ = inputs(dt, xs, ws, stride, pad)
    b = to_dt(np.random.default_rng(7).standard_normal(ws[0]), dt)
    got = to_f32(cu.to_numpy(cu.conv2d_forward(cu.asarray(x), cu.asarray(w), cu.asarray(b),
                                               stride, pad)), dt)
    x64, w64, b64 = (to_f32(a, dt).astype(np.float64) for a in (x, w, b))
    close(got, cpu.conv2d_forward(x64, w64, b64, stride, pad), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_wgmma_and_mma_kernels_agree(cu, dt, monkeypatch):
    xs, ws, stride, pad = CASES[0]
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    fast = passes(cu, dt, x, w, gy, stride, pad)[:2]
    routes_off(monkeypatch, *OFF, "wgmma")
    assert planned_kernels(cu, x, w, gy, stride, pad)["forward"] != WGMMA
    slow = passes(cu, dt, x, w, gy, stride, pad)[:2]
    for a, b in zip(fast, slow):
        close(a, b, dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_channels_not_in_whole_chunks_fall_back(cu, dt):
    """6 channels are not a whole 16-byte chunk in any precision: the mma.sync kernels run."""
    xs, ws, stride, pad = (2, 6, 9, 9), (24, 6, 3, 3), (1, 1), (1, 1)
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    ran = planned_kernels(cu, x, w, gy, stride, pad)
    assert ran["forward"] != WGMMA and ran["backward_data"] == WGMMA  # gy has 24 channels
    passes_match_reference(cu, dt, x, w, gy, stride, pad)


@pytest.mark.parametrize("dt", DTYPES)
def test_wgmma_bitwise_repeatable(cu, dt):
    xs, ws, stride, pad = CASES[-1]
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    dx, dw, dgy = cu.asarray(x), cu.asarray(w), cu.asarray(gy)
    for run in (lambda: cu.conv2d_forward(dx, dw, None, stride, pad),
                lambda: cu.conv2d_backward_data(dgy, dw, x.shape, stride, pad),
                lambda: cu.conv2d_backward_weight(dx, dgy, w.shape, stride, pad)):
        assert cu.to_numpy(run()).tobytes() == cu.to_numpy(run()).tobytes()


CL_CASES = CASES + TMA_CASES + [
    ((2, 16, 8, 8), (21, 16, 3, 3), (1, 1), (1, 1)),  # odd C_out: single-channel stores
    ((2, 6, 9, 9), (24, 6, 3, 3), (1, 1), (1, 1)),  # 6 channels: the NCHW kernels, copies
    ((4, 1, 12, 12), (64, 1, 3, 3), (1, 1), (1, 1)),  # a 1-channel stem: direct kernels
    ((2, 3, 10, 10), (13, 3, 3, 3), (2, 2), (1, 1)),  # 3 channels, odd C_out: direct, stores
]


@pytest.mark.parametrize("tma", ["0", "1"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs, ws, stride, pad", CL_CASES)
def test_channels_last_passes_equal_nchw_bitwise(cu, dt, xs, ws, stride, pad, tma, monkeypatch):
    """channels_last=True: the same kernels on the same K order, only the epilogue's stores
    (or, where no channels-last kernel applies, copies around the NCHW one) differ, so every
    pass equals the NCHW pass transposed, to the bit, a bias included; and the plan names the
    NCHW plan's kernel. A strided 1x1 filter's backward-data is the exception: channels-last,
    it runs the dense product at the pixels reached (on the TMA kernel where it applies),
    the same slabs in the same order, spread."""
    routes_off(monkeypatch, *(() if tma == "1" else ("wgmma_tma", "bwdw_tma")))
    x, w, gy = inputs(dt, xs, ws, stride, pad)
    b = to_dt(np.random.default_rng(7).standard_normal(ws[0]), dt)
    dx, dw, db, dgy = (cu.asarray(a) for a in (x, w, b, gy))
    xl, gyl = cu.asarray(_channels_last(x)), cu.asarray(_channels_last(gy))
    want = (cu.conv2d_forward(dx, dw, db, stride, pad),
            cu.conv2d_backward_data(dgy, dw, x.shape, stride, pad),
            cu.conv2d_backward_weight(dx, dgy, w.shape, stride, pad))
    got = (cu.conv2d_forward(xl, dw, db, stride, pad, channels_last=True),
           cu.conv2d_backward_data(gyl, dw, xl.shape, stride, pad, channels_last=True),
           cu.conv2d_backward_weight(xl, gyl, w.shape, stride, pad, channels_last=True))
    assert got[0].shape == (xs[0],) + gy.shape[2:] + (ws[0],)
    assert got[1].shape == xl.shape
    for g, ref, nhwc in zip(got, want, (True, True, False)):
        ref = cu.to_numpy(ref)
        assert cu.to_numpy(g).tobytes() == (_channels_last(ref) if nhwc else ref).tobytes()
    kernels = [conv.conv2d_kernels(xl, dw, gyl, stride, pad, channels_last=True),
               conv.conv2d_kernels(dx, dw, dgy, stride, pad)]
    if ws[2:] == (1, 1) and stride != (1, 1):
        for k in kernels:
            del k["backward_data"]
    assert kernels[0] == kernels[1]


def test_channels_last_stem_backward_weight_needs_no_copies(cu, monkeypatch):
    """A one-channel stem's tensor-core backward-weight takes channels-last activations as
    they lie: it reads gy so, and x of one channel is its own NCHW view. No transpose or copy
    kernel is planned."""
    routes_off(monkeypatch, "wgmma_tma", "bwdw_tma")
    x, w, gy = inputs(HALVES[0].values[0], (4, 1, 12, 12), (64, 1, 3, 3), (1, 1), (1, 1))
    xl, gyl = cu.asarray(_channels_last(x)), cu.asarray(_channels_last(gy))
    seen = _instantiations(
        lambda: conv.passes._backward_weight(xl, gyl, w.shape, (1, 1), (1, 1), True)(xl, gyl, None))
    assert any(name.startswith("conv2d_direct_bwdw_mma_kernel") for name in seen)
    assert not [name for name in seen if "transpose" in name or "copy" in name]


DIRECT_CL_CASES = [  # x shape, w shape, stride, padding: all direct (C_in*KH*KW <= 32)
    ((4, 1, 12, 12), (64, 1, 3, 3), (1, 1), (1, 1)),  # ResNet-18's stem: 576 pixels
    ((3, 3, 11, 9), (32, 3, 3, 3), (2, 2), (1, 1)),  # 3 channels (x copied to NCHW); 90 pixels
    ((2, 1, 13, 13), (2, 1, 5, 5), (1, 1), (2, 2)),  # 2 channels; KMAX 28; 338 pixels
    ((2, 1, 9, 9), (5, 1, 3, 3), (1, 1), (0, 0)),  # odd C_out: NCHW and the transpose
]


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("xs, ws, stride, pad", DIRECT_CL_CASES)
def test_direct_forward_writes_channels_last_itself(cu, dt, xs, ws, stride, pad, monkeypatch):
    """A 16-bit direct forward with an even C_out up to 64 writes a channels-last y itself
    (a round of 256 pixels staged in shared memory): the NCHW forward's bits, turned, with
    and without bias, and no transpose; conv2d_forward_stats takes its tiles' statistics on
    the way: within 1e-5 of the spread of float64 statistics of y as stored (the variance
    within 2e-5 of itself)."""
    routes_off(monkeypatch, "wgmma_tma", "bwdw_tma")
    x, w, _ = inputs(dt, xs, ws, stride, pad)
    dx, dw = cu.asarray(x), cu.asarray(w)
    xl = cu.asarray(_channels_last(x))
    db = cu.asarray(to_dt(np.linspace(-1, 1, ws[0]), dt))
    itself = ws[0] % 2 == 0 and xs[1] * ws[2] * ws[3] <= 32
    for bias in (None, db):
        want = _channels_last(cu.to_numpy(cu.conv2d_forward(dx, dw, bias, stride, pad)))
        seen = _instantiations(lambda: conv.passes._forward(xl, dw, bias, stride, pad, True)(
            dw, xl, bias, None, None))
        assert any(n.startswith("conv2d_direct_fwd_kernel") for n in seen)
        assert any(n.endswith(", true>") for n in seen) == itself
        # (x of more than one channel is copied to NCHW either way)
        assert any("transpose" in n for n in seen) == (not itself or xs[1] > 1)
        got = cu.conv2d_forward(xl, dw, bias, stride, pad, channels_last=True)
        assert cu.to_numpy(got).tobytes() == want.tobytes()
    y, mean, var = cu.conv2d_forward_stats(xl, dw, stride, pad, channels_last=True)
    assert cu.to_numpy(y).tobytes() == _channels_last(
        cu.to_numpy(cu.conv2d_forward(dx, dw, None, stride, pad))).tobytes()
    rows = y.reshape(-1, ws[0])
    y64 = to_f32(cu.to_numpy(rows), dt).astype(np.float64)
    ref_mean, ref_var = y64.mean(axis=0), y64.var(axis=0)
    spread = np.sqrt(ref_var) + 1e-30
    got_mean, got_var = cu.to_numpy(mean), cu.to_numpy(var)
    assert np.all(np.abs(got_mean - ref_mean) <= 1e-5 * spread)
    assert np.all(np.abs(got_var - ref_var) <= 2e-5 * ref_var + 1e-30)


def test_channels_last_checks_its_shapes(cu):
    x = cu.asarray(np.zeros((2, 8, 8, 16), np.float32))
    w = cu.asarray(np.zeros((32, 16, 3, 3), np.float32))
    with pytest.raises(ValueError, match="channels"):
        cu.conv2d_forward(x, w, None, (1, 1), (1, 1))  # NCHW read: 8 channels, not 16
    gy = cu.asarray(np.zeros((2, 32, 8, 8), np.float32))  # NCHW gy for a channels-last pass
    with pytest.raises(ValueError, match="gy has shape"):
        cu.conv2d_backward_data(gy, w, x.shape, (1, 1), (1, 1), channels_last=True)


def test_channels_last_native_where_wgmma_runs(cu, monkeypatch):
    """The wgmma kernels read channels-last activations as they lie: 16-bit, or float32
    under TF32; under fp32 with FFMA convolutions (3xTF32 off: test_cuda_conv_tf32x3.py) or
    with the wgmma routes turned off a channels-last pass copies, and a ResNet of
    channels_last="auto" then runs NCHW (both layouts: the same loss to rounding)."""
    from dptrain import nn
    from dptrain.engine import functional as F
    from dptrain.engine.autograd import Tensor

    routes_off(monkeypatch, *OFF, "x3")

    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    assert cu.conv2d_channels_last_native(f32) and cu.conv2d_channels_last_native(f16)
    x = np.random.default_rng(0).standard_normal((2, 1, 12, 12)).astype(np.float32)
    model = nn.resnet18((1, 12, 12), 3, widths=(16, 16, 16, 16)).to("cuda")
    losses = {}
    for prec in ("tf32", "fp32"):
        with cu.runtime.precision_scope(prec):
            assert cu.conv2d_channels_last_native(f32) == (prec == "tf32")
            assert cu.conv2d_channels_last_native(f16)  # 16-bit whatever the precision
            xt = Tensor(cu.asarray(x))
            assert model.layout(xt) == (prec == "tf32")
            losses[prec] = float(F.cross_entropy(model(xt), np.array([0, 2])).numpy())
    assert abs(losses["tf32"] - losses["fp32"]) <= 1e-2 * abs(losses["fp32"])
    routes_off(monkeypatch, *OFF, "x3", "wgmma")
    assert not cu.conv2d_channels_last_native(f16)


def test_explain_lists_the_routes_a_shape_passed_over(cu, monkeypatch):
    """explain(pass, geometry): each route before the one that takes the shape says why not,
    and the route that takes it plans the kernel conv2d_kernels names. An unknown name in
    DPTRAIN_TEST_ROUTES_OFF is an error, not a test that tests nothing."""
    routes_off(monkeypatch)
    f16 = np.float16
    x, w = cu.asarray(np.zeros((2, 3, 32, 32), f16)), cu.asarray(np.zeros((64, 3, 7, 7), f16))
    gy = cu.asarray(np.zeros((2, 64, 16, 16), f16))
    stem = conv.geometry.forward(x, w, None, (2, 2), (3, 3))  # 3 channels, 7x7 / 2
    rows = conv.explain(conv.FORWARD, stem)
    assert [name for name, _ in rows] == ["empty", "direct", "x3", "strip", "wgmma_tma", "wgmma",
                                          "mma"]
    assert all(why for _, why in rows[:-1]) and rows[-1][1] is None
    assert "147" in dict(rows)["direct"]  # C_in*KH*KW
    assert conv.conv2d_kernels(x, w, gy, (2, 2), (3, 3))["forward"] == "conv2d_b16_kernel"
    assert conv.describe(conv.FORWARD, stem).endswith(")") and ": mma (" in conv.describe(
        conv.FORWARD, stem)
    xl = cu.asarray(np.zeros((2, 12, 12, 64), f16))
    layer = conv.geometry.forward(xl, cu.asarray(np.zeros((64, 64, 3, 3), f16)), None, (1, 1),
                                  (1, 1), cl=True)
    assert conv.explain(conv.FORWARD, layer)[-1] == ("wgmma_tma", None)
    routes_off(monkeypatch, "wgmma_tma")
    assert conv.explain(conv.FORWARD, layer)[-2:] == [
        ("wgmma_tma", "turned off by DPTRAIN_TEST_ROUTES_OFF"), ("wgmma", None)]
    routes_off(monkeypatch, "no_such_route")
    with pytest.raises(ValueError, match="DPTRAIN_TEST_ROUTES_OFF: no route named no_such"):
        cu.conv2d_forward(xl, cu.asarray(np.zeros((64, 64, 3, 3), f16)), None, (1, 1), (1, 1),
                          channels_last=True)
