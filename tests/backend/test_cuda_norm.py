"""GPU (marked `gpu`): the batch-norm kernels (kernels/norm.cu) against the NumPy reference on
fresh random inputs of odd sizes with poisoned outputs, their determinism, and a ResNet-18
training step replayed as a CUDA graph equal bitwise to the eager step."""

import numpy as np
import pytest

from dptrain import nn
from dptrain.backend import cpu
from dptrain.optim import SGD
from replay import train_steps

pytestmark = pytest.mark.gpu
F32, F64 = np.float32, np.float64
RTOL = {np.dtype(F32): 1e-5, np.dtype(F64): 1e-11}
# odd sizes (element-by-element groups), whole 16-byte groups for every dtype (8x8) and for
# 4-byte and wider types only (6x6)
SHAPES = [(5, 3, 7, 9), (3, 17, 1, 1), (2, 64, 13, 11), (7, 5), (1, 33, 31, 3), (300, 2, 9, 7),
          (4, 6, 8, 8), (3, 5, 6, 6)]
# (rows, C), as channels-last activations come: C in whole 16-byte groups of every dtype
# (the channels-last kernels: at most 256 groups, 2048 channels in 16 bits, 1024 in float32,
# 512 in float64), of 4-byte and wider types only (12), and past the channels-last kernels'
# limit in some dtypes (1024, 2048: the NCHW kernels with S = 1 there)
CL_SHAPES = [(2000, 64), (37, 512), (301, 24), (9, 8), (130, 12), (40, 1024), (21, 2048),
             (300, 768)]
SHAPES += CL_SHAPES


def close(cu, got, ref, rtol=None):
    got, ref = cu.to_numpy(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, got.dtype, ref.dtype)
    assert not np.isnan(got).any(), "NaN: an unwritten element?"
    rtol = RTOL[ref.dtype] if rtol is None else rtol
    err = np.linalg.norm(got.astype(F64) - ref.astype(F64)) / max(np.linalg.norm(ref), 1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:g}"


def _inputs(rng, shape, dtype):
    c = shape[1]
    x = (rng.standard_normal(shape) * rng.uniform(0.5, 3, (1, c) + (1,) * (len(shape) - 2))
         + rng.uniform(-2, 2, (1, c) + (1,) * (len(shape) - 2))).astype(dtype)
    gy = rng.standard_normal(shape).astype(dtype)
    w, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    return x, gy, w, b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_batch_norm_ops_match_numpy(cu, rng, shape, dtype):
    x, gy, w, b = _inputs(rng, shape, dtype)
    dx, dgy, dw, db = (cu.asarray(a) for a in (x, gy, w, b))
    eps = 1e-5
    # statistics: float64 references rounded back, so float32 is judged against the exact sum
    mean = cpu.batch_norm_mean(x.astype(F64)).astype(dtype)
    var = cpu.batch_norm_var(x.astype(F64), mean.astype(F64)).astype(dtype)
    close(cu, cu.batch_norm_mean(dx), mean)
    dmean = cu.asarray(mean)
    close(cu, cu.batch_norm_var(dx, dmean), var)
    dvar = cu.asarray(var)
    smean, svar = cu.batch_norm_stats(dx)
    close(cu, smean, mean)
    close(cu, svar, var)
    close(cu, cu.batch_norm_forward(dx, dmean, dvar, dw, db, eps),
          cpu.batch_norm_forward(x, mean, var, w, b, eps))
    r = rng.standard_normal(shape).astype(dtype)
    close(cu, cu.batch_norm_forward(dx, dmean, dvar, dw, db, eps, residual=cu.asarray(r),
                                    relu=True),
          cpu.batch_norm_forward(x, mean, var, w, b, eps, residual=r, relu=True))
    sums = cpu.batch_norm_backward_reduce(gy.astype(F64), x.astype(F64), mean.astype(F64),
                                          var.astype(F64), eps).astype(dtype)
    close(cu, cu.batch_norm_backward_reduce(dgy, dx, dmean, dvar, eps), sums)
    count = x.size // shape[1] * 3  # as if all-reduced over 3 ranks
    close(cu, cu.batch_norm_backward_data(dgy, dx, dmean, dvar, dw, cu.asarray(sums), eps, count),
          cpu.batch_norm_backward_data(gy, x, mean, var, w, sums, eps, count))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_16_bit_batch_norm_keeps_fp32_statistics(cu, rng, shape, half):
    """16-bit x and gy (mixed precision) with fp32 statistics, parameters and sums: the kernels
    against the float64 reference on the same (rounded) inputs. Statistics and sums come back
    float32 at float32's tolerance; y and dx in x's dtype within its rounding (relative norm
    error 2e-3 for float16, 1.6e-2 for bfloat16)."""
    from dptrain.backend.bfloat16 import from_bfloat16, to_bfloat16

    x, gy, w, b = _inputs(rng, shape, F32)
    if half == "float16":
        x, gy = x.astype(np.float16), gy.astype(np.float16)
        dx, dgy, tol = cu.asarray(x), cu.asarray(gy), 2e-3
        x64, gy64 = x.astype(F64), gy.astype(F64)
    else:
        bx, bgy = to_bfloat16(x), to_bfloat16(gy)
        dx, dgy, tol = cu.asarray(bx), cu.asarray(bgy), 1.6e-2
        x64, gy64 = from_bfloat16(bx).astype(F64), from_bfloat16(bgy).astype(F64)
    dw, db, eps = cu.asarray(w), cu.asarray(b), 1e-5
    mean = cpu.batch_norm_mean(x64)
    var = cpu.batch_norm_var(x64, mean)
    close(cu, cu.batch_norm_mean(dx), mean.astype(F32))
    dmean, dvar = cu.asarray(mean.astype(F32)), cu.asarray(var.astype(F32))
    close(cu, cu.batch_norm_var(dx, dmean), var.astype(F32))
    smean, svar = cu.batch_norm_stats(dx)
    close(cu, smean, mean.astype(F32))
    close(cu, svar, var.astype(F32))

    def widened(a):  # a 16-bit device result as float64 on the host
        a = cu.astype(a, np.dtype(F32)) if a.dtype != np.float16 else a
        return cu.to_numpy(a).astype(F64)

    y = cu.batch_norm_forward(dx, dmean, dvar, dw, db, eps)
    assert y.dtype == dx.dtype
    ref = cpu.batch_norm_forward(x64, mean, var, w.astype(F64), b.astype(F64), eps)
    assert np.linalg.norm(widened(y) - ref) / np.linalg.norm(ref) <= tol
    # the residual (gy's values) added and ReLU applied in fp32 before the one rounding
    y = cu.batch_norm_forward(dx, dmean, dvar, dw, db, eps, residual=dgy, relu=True)
    ref = cpu.batch_norm_forward(x64, mean, var, w.astype(F64), b.astype(F64), eps,
                                 residual=gy64, relu=True)
    assert y.dtype == dx.dtype
    assert np.linalg.norm(widened(y) - ref) / np.linalg.norm(ref) <= tol
    sums = cpu.batch_norm_backward_reduce(gy64, x64, mean, var, eps)
    close(cu, cu.batch_norm_backward_reduce(dgy, dx, dmean, dvar, eps), sums.astype(F32),
          rtol=1e-5)
    count = x.size // shape[1]
    g = cu.batch_norm_backward_data(dgy, dx, dmean, dvar, dw, cu.asarray(sums.astype(F32)), eps,
                                    count)
    assert g.dtype == dx.dtype
    ref = cpu.batch_norm_backward_data(gy64, x64, mean, var, w.astype(F64), sums, eps, count)
    assert np.linalg.norm(widened(g) - ref) / max(np.linalg.norm(ref), 1e-30) <= 2 * tol


@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[6:])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_relu_mask_recomputed_in_the_backward_equals_its_own_pass(cu, rng, shape, dtype):
    """relu=(weight, bias): both backward kernels zero gy where relu(bn(x)) was 0, recomputed
    from x as the forward rounded it. Bitwise the results of masking gy with the forward's
    output first (relu_backward), in every dtype; the same on the NumPy reference."""
    from dptrain.backend.bfloat16 import to_bfloat16

    x, gy, w, b = _inputs(rng, shape, F32)
    stat = F64 if dtype == "float64" else F32
    w, b = w.astype(stat), b.astype(stat)
    if dtype == "bfloat16":
        x, gy = to_bfloat16(x), to_bfloat16(gy)
    else:
        x, gy = x.astype(dtype), gy.astype(dtype)
    for be, asarray in ((cu, cu.asarray), (cpu, np.asarray)):
        dx, dgy, dw, db = (asarray(a) for a in (x, gy, w, b))
        mean, var = be.batch_norm_stats(dx)
        eps, count = 1e-5, x.size // shape[1]
        y = be.batch_norm_forward(dx, mean, var, dw, db, eps, relu=True)
        masked = be.relu_backward(y, dgy)
        sums = be.batch_norm_backward_reduce(masked, dx, mean, var, eps)
        fused = be.batch_norm_backward_reduce(dgy, dx, mean, var, eps, relu=(dw, db))
        assert np.array_equal(be.to_numpy(fused), be.to_numpy(sums))
        gx = be.batch_norm_backward_data(masked, dx, mean, var, dw, sums, eps, count)
        fused = be.batch_norm_backward_data(dgy, dx, mean, var, dw, sums, eps, count,
                                            relu=(dw, db))
        assert np.array_equal(be.to_numpy(fused).view(np.uint8), be.to_numpy(gx).view(np.uint8))
    dx, dw, db = cu.asarray(x), cu.asarray(w), cu.asarray(b)
    mean, var = cu.batch_norm_stats(dx)
    with pytest.raises(ValueError, match="relu's weight"):  # the mask's scale is the weight's
        cu.batch_norm_backward_data(dx, dx, mean, var, dw, cu.asarray(sums), 1e-5, count,
                                    relu=(cu.asarray(w), db))


@pytest.mark.parametrize("dtype", [F32, np.uint16], ids=["float32", "bfloat16"])
def test_unaligned_arrays_take_the_element_path(cu, rng, dtype):
    """Views that start off a 16-byte boundary (S a whole number of groups) give the same
    results as aligned copies: the kernels fall back to element-by-element groups."""
    shape = (4, 3, 8, 8)
    x, gy, w, b = _inputs(rng, shape, F32)
    size = x.size

    def on_device(a, offset):  # a as a contiguous view `offset` elements into a buffer
        buf, a = cu.asarray(np.zeros(size + 8, F32)), cu.asarray(a)
        if dtype != F32:  # bfloat16, held as uint16
            buf, a = cu.astype(buf, np.dtype(dtype)), cu.astype(a, np.dtype(dtype))
        view = buf[offset:offset + size].reshape(shape)
        cu.copy_(view, a)
        return view

    dw, db = cu.asarray(w), cu.asarray(b)
    results = []
    for offset in (0, 1):
        dx, dgy = on_device(x, offset), on_device(gy, offset)
        assert (dx.data.ptr % 16 == 0) == (offset == 0)
        mean, var = cu.batch_norm_stats(dx)
        y = cu.batch_norm_forward(dx, mean, var, dw, db, 1e-5, residual=dgy, relu=True)
        sums = cu.batch_norm_backward_reduce(dgy, dx, mean, var, 1e-5)
        g = cu.batch_norm_backward_data(dgy, dx, mean, var, dw, sums, 1e-5, size // 3)
        results.append([cu.to_numpy(a) for a in (mean, var, y, sums, g)])
    for aligned, unaligned in zip(*results):
        np.testing.assert_array_equal(unaligned, aligned)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_batch_norm_update_matches_numpy(cu, rng, dtype):
    c = 37
    rm, rv = rng.standard_normal(c).astype(dtype), rng.uniform(0.5, 2, c).astype(dtype)
    mean, var = rng.standard_normal(c).astype(dtype), rng.uniform(0.5, 2, c).astype(dtype)
    drm, drv, dnb = cu.asarray(rm), cu.asarray(rv), cu.asarray(np.array(4, np.int64))
    nb = np.array(4, np.int64)
    cpu.batch_norm_update_(rm, rv, nb, mean, var, 0.1, 123)
    cu.batch_norm_update_(drm, drv, dnb, cu.asarray(mean), cu.asarray(var), 0.1, 123)
    close(cu, drm, rm)
    close(cu, drv, rv)
    assert int(cu.to_numpy(dnb)) == int(nb) == 5


def test_batch_norm_reductions_are_deterministic(cu, rng):
    x, gy, w, b = _inputs(rng, (64, 96, 17, 17), F32)
    dx, dgy = cu.asarray(x), cu.asarray(gy)

    def run():
        mean = cu.batch_norm_mean(dx)
        var = cu.batch_norm_var(dx, mean)
        smean, svar = cu.batch_norm_stats(dx)
        return [cu.to_numpy(a) for a in (mean, var, smean, svar,
                                         cu.batch_norm_backward_reduce(dgy, dx, mean, var, 1e-5))]

    first = run()
    for _ in range(3):
        for f, a in zip(first, run()):
            np.testing.assert_array_equal(a, f)


def _resnet_train(graph, steps=4, seed=3):
    model, _ = train_steps("cuda", lambda: nn.resnet18((1, 32, 32), 5), (1, 32, 32), 5, graph,
                           steps, seed, images=64, batch=16,
                           optimizer=lambda flat: SGD(flat, lr=0.05, momentum=0.9))
    return dict(model.state_dict())


def test_resnet18_graph_replay_equals_eager_bitwise():
    """The captured step (BN statistics, running estimates and the batch counter updated on
    the device inside the graph) replays exactly like the eager step."""
    eager, graph = _resnet_train(graph=False), _resnet_train(graph=True)
    assert int(graph["bn1.num_batches_tracked"]) == 4
    for name, value in eager.items():
        assert np.array_equal(graph[name], value), f"{name} differs after replay"


def test_channels_last_kernels_take_rows_of_whole_groups(cu):
    """The (rows, C) batches the channels-last kernels take: C in whole 16-byte groups of
    the dtype, at most norm.CL_THREADS groups; everything else runs the NCHW kernels."""
    from dptrain.backend.cuda import norm

    for shape, dtype, takes in [((2000, 64), F32, True), ((130, 12), F32, True),
                                ((130, 12), np.float16, False), ((40, 1024), F32, True),
                                ((40, 2048), F32, False), ((40, 1024), F64, False),
                                ((21, 2048), np.float16, True), ((21, 4096), np.float16, False),
                                ((4, 64, 8, 8), F32, False), ((37, 512), np.float16, True)]:
        assert norm._cl(cu.asarray(np.zeros(shape, dtype))) is takes, (shape, dtype)


def test_resnet18_channels_last_gradients_equal_nchw(cu, rng, monkeypatch):
    """ResNet-18 with channels-last activations (the default) against the NCHW network from
    the same weights on one batch, in strict fp32 on FFMA convolutions (TF32's rounding, or
    3xTF32's accumulation, would hide a real difference): the same loss and parameter
    gradients to float rounding (the batch norms' sums run in other orders). Float sums of a
    channel's statistics failed this at 0.7%: they are kept in double."""
    import dptrain.engine.functional as F
    from dptrain.backend.cuda import gemm
    from dptrain.engine.autograd import Tensor

    monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", "x3")
    gemm.clear_plans()

    x = cu.asarray(rng.standard_normal((16, 1, 32, 32)).astype(F32))
    labels = cu.asarray(rng.integers(0, 5, 16))
    state = nn.resnet18((1, 32, 32), 5, channels_last=False).state_dict()
    precision = cu.runtime.precision
    cu.runtime.set_precision("fp32")
    try:
        grads = []
        for channels_last in (False, True):
            model = nn.resnet18((1, 32, 32), 5, channels_last=channels_last)
            model.load_state_dict(state)
            model.to("cuda")
            loss = F.cross_entropy(model(Tensor(x)), Tensor(labels))
            loss.backward()
            grads.append({n: cu.to_numpy(p.grad.data) for n, p in model.named_parameters()})
    finally:
        cu.runtime.set_precision(precision)
    nchw, cl = grads
    for name, value in nchw.items():
        a, b = np.asarray(value, F64), np.asarray(cl[name], F64)
        err = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
        assert err <= 1e-4, f"{name}: relative difference {err:.2e}"


@pytest.mark.parametrize("shape", [(4, 16, 5, 5), (300, 16), (3, 700)], ids=str)
@pytest.mark.parametrize("dtype", [F32, "bf16"])
def test_the_forward_updates_the_running_estimates_as_the_update_op(cu, rng, dtype, shape):
    """batch_norm_forward(update=...) (NCHW, the channels-last rows, a C past one block's
    threads): y as without it, the running estimates and counter the bits of
    batch_norm_update_ with the same statistics."""
    from dptrain.backend.bfloat16 import to_bfloat16
    x = rng.standard_normal(shape).astype(F32)
    x = cu.asarray(to_bfloat16(x) if dtype == "bf16" else x)
    c = shape[1]
    mean, var = cu.batch_norm_stats(x)
    w, b = (cu.asarray(rng.standard_normal(c).astype(F32)) for _ in range(2))
    start = (rng.standard_normal(c).astype(F32), rng.uniform(0.5, 2, c).astype(F32),
             np.array(7, np.int64))
    fused, apart = ([cu.asarray(a) for a in start] for _ in range(2))
    y = cu.batch_norm_forward(x, mean, var, w, b, 1e-5, relu=True, update=(*fused, 0.1, 99))
    cu.batch_norm_update_(*apart, mean, var, 0.1, 99)
    plain = cu.batch_norm_forward(x, mean, var, w, b, 1e-5, relu=True)
    assert cu.to_numpy(y).tobytes() == cu.to_numpy(plain).tobytes()
    for got, want in zip(fused, apart):
        assert cu.to_numpy(got).tobytes() == cu.to_numpy(want).tobytes()
    assert int(cu.to_numpy(fused[2])) == 8


@pytest.mark.parametrize("dtype", [np.float16, F32])
@pytest.mark.parametrize("shape", [(20000, 64), (9000, 512), (30001, 24)])
def test_channels_last_elementwise_bits_do_not_depend_on_the_grid(cu, rng, monkeypatch, shape,
                                                                  dtype):
    """The channels-last forward (residual and ReLU) and backward-data (ReLU) give the same
    bits at 4 blocks an SM as at 2 (norm._cl_map picks by rows a thread): the grid only
    splits rows. The shapes have rows enough that the two grids differ."""
    from dptrain.backend.cuda import norm

    x, gy, w, b = _inputs(rng, shape, dtype)
    res = rng.standard_normal(shape).astype(dtype)
    dx, dgy, dres = (cu.asarray(a) for a in (x, gy, res))
    assert norm._cl_grid(dx, norm.MAP_PER_SM) != norm._cl_grid(dx, norm.MAP_FEW_PER_SM)
    dw, db = cu.asarray(w.astype(F32)), cu.asarray(b.astype(F32))  # fp32 for 16-bit x too
    mean, var = cu.batch_norm_stats(dx)
    sums = cu.batch_norm_backward_reduce(dgy, dx, mean, var, 1e-5, relu=(dw, db))

    def run():
        y = cu.batch_norm_forward(dx, mean, var, dw, db, 1e-5, residual=dres, relu=True)
        g = cu.batch_norm_backward_data(dgy, dx, mean, var, dw, sums, 1e-5, shape[0],
                                        relu=(dw, db))
        return [cu.to_numpy(a).tobytes() for a in (y, g)]

    outs = []
    for rows in (0, 10**9):  # every launch at MAP_PER_SM, then at MAP_FEW_PER_SM
        monkeypatch.setattr(norm, "MAP_THREAD_ROWS", rows)
        outs.append(run())
    assert outs[0] == outs[1]


def _as(dtype, a):
    """a (float32) in dtype: float16, bfloat16 (the bits of to_bfloat16) or float32."""
    from dptrain.backend.bfloat16 import to_bfloat16

    return to_bfloat16(a) if dtype == "bfloat16" else a.astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(2000, 64), (37, 512), (301, 24), (3, 8, 5, 5), (21, 2048)])
@pytest.mark.parametrize("join", ["parts", "mask", "parts+mask", "parts+relu"])
def test_joined_backward_sums_equal_the_ops_in_turn(cu, rng, shape, dtype, join):
    """batch_norm_backward_reduce_joined (gy = ga + gb, masked by the ReLU output after a
    residual add, stored by the sums' channels-last pass; a 4-D x composes the ops): gy is
    add's / relu_backward's / relu_backward_sum's, to the bit, and the sums and the .grad it
    adds them into are batch_norm_backward_reduce's of that gy, to the bit."""
    x, ga, w, b = _inputs(rng, shape, F32)
    gb, y = rng.standard_normal(shape).astype(F32), rng.standard_normal(shape).astype(F32)
    dx, dga, dgb, dy = (cu.asarray(_as(dtype, a)) for a in (x, ga, gb, y))
    dw, db = cu.asarray(w), cu.asarray(b)
    mean, var = cu.batch_norm_stats(dx)
    parts = "parts" in join
    relu_out = dy if "mask" in join else None
    relu = (dw, db) if join == "parts+relu" else None
    if relu_out is None:
        want = cu.add(dga, dgb)
    elif parts:
        want = cu.relu_backward_sum(dy, dga, dgb)
    else:
        want = cu.relu_backward(dy, dga)
    c = shape[1] if len(shape) > 2 else shape[-1]
    start = rng.standard_normal((2, c)).astype(F32)
    grads = [cu.asarray(start) for _ in range(2)]  # two .grad pairs holding the same values
    want_sums = cu.batch_norm_backward_reduce(want, dx, mean, var, 1e-5, relu=relu,
                                              add_to=(grads[0][0], grads[0][1]))
    gy, sums = cu.batch_norm_backward_reduce_joined(
        dga, dgb if parts else None, dx, mean, var, 1e-5, relu=relu, relu_out=relu_out,
        add_to=(grads[1][0], grads[1][1]))
    for name, got, ref in (("gy", gy, want), ("sums", sums, want_sums),
                           (".grad", grads[1], grads[0])):
        assert cu.to_numpy(got).tobytes() == cu.to_numpy(ref).tobytes(), name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("grid, stride, pad, flat", [
    ((2, 12, 12, 64), (2, 2), (0, 0), True),    # a ResNet shortcut's grid, as (rows, C)
    ((2, 9, 9, 128), (2, 2), (0, 0), True),     # odd: the last row and column reached
    ((2, 10, 11, 64), (2, 3), (1, 1), True),    # uneven stride, padding: edges dropped
    ((3, 6, 6, 24), (2, 2), (0, 0), False),     # 4-D x: the ops in turn, the Spread written
])
def test_joined_sums_read_a_spread_where_it_lies(cu, rng, grid, stride, pad, flat, dtype):
    """batch_norm_backward_reduce_joined with gb a Spread (a strided 1x1's backward-data,
    its zeros not written): gy and the sums to the bit of gb given as the spread array."""
    from dptrain.backend.spread import Spread

    n, h, w, c = grid
    bh, bw = ((h + 2 * pad[0] - 1) // stride[0] + 1, (w + 2 * pad[1] - 1) // stride[1] + 1)
    dense = rng.standard_normal((n, bh, bw, c)).astype(F32)
    full = np.zeros(grid, F32)
    for i in range(bh):
        for j in range(bw):
            y, x = stride[0] * i - pad[0], stride[1] * j - pad[1]
            if 0 <= y < h and 0 <= x < w:
                full[:, y, x] = dense[:, i, j]
    shape = (n * h * w, c) if flat else grid
    x, ga = (rng.standard_normal(shape).astype(F32) for _ in range(2))
    y = rng.standard_normal(shape).astype(F32)
    dx, dga, dy = (cu.asarray(_as(dtype, a)) for a in (x, ga, y))
    dfull = cu.asarray(_as(dtype, full))
    spread = Spread(cu.asarray(_as(dtype, dense)), grid, stride, pad, lambda: dfull.copy())
    mean, var = cu.batch_norm_stats(dx)
    want = cu.batch_norm_backward_reduce_joined(dga, dfull.reshape(shape), dx, mean, var, 1e-5,
                                                relu_out=dy)
    got = cu.batch_norm_backward_reduce_joined(dga, spread.reshape(shape), dx, mean, var, 1e-5,
                                               relu_out=dy)
    for name, a, b in zip(("gy", "sums"), got, want):
        assert cu.to_numpy(a).tobytes() == cu.to_numpy(b).tobytes(), name
