"""Channels-last max pooling (pool.cu's *_nhwc kernels) against the CPU reference, which pools
through NCHW copies. Outputs are poisoned before every launch (the `cu` fixture)."""
import numpy as np
import pytest

from dptrain.backend import cpu
from dptrain.backend.bfloat16 import BFLOAT16, from_bfloat16, to_bfloat16

gpu = pytest.mark.gpu
DTYPES = [np.float32, np.float64, np.float16, BFLOAT16]
WINDOWS = [((3, 3), (2, 2), (1, 1)),  # ImageNet's stem
           ((2, 2), (2, 2), (0, 0)), ((3, 3), (1, 1), (1, 1)), ((2, 3), (1, 2), (0, 1)),
           ((3, 2), (3, 2), (1, 0))]


def nhwc(rng, shape, dtype):
    """A random (N, H, W, C) array in `dtype` (bfloat16 held as uint16)."""
    a = rng.standard_normal(shape).astype(np.float32)
    return to_bfloat16(a) if dtype == BFLOAT16 else a.astype(dtype)


def as_f64(a):
    a = np.asarray(a)
    return (from_bfloat16(a) if a.dtype == BFLOAT16 else a).astype(np.float64)


def test_cpu_channels_last_equals_nchw(rng=np.random.default_rng(3)):
    """The reference itself: channels-last pooling is the NCHW pooling of the transposed
    array, idx included, and so is its backward."""
    x = nhwc(rng, (2, 9, 7, 5), np.float32)
    window = WINDOWS[0]
    y, idx = cpu.max_pool2d_forward(x, *window, channels_last=True)
    y1, idx1 = cpu.max_pool2d_forward(np.ascontiguousarray(x.transpose(0, 3, 1, 2)), *window)
    assert np.array_equal(y, y1.transpose(0, 2, 3, 1))
    assert np.array_equal(idx, idx1.transpose(0, 2, 3, 1))
    gy = nhwc(rng, y.shape, np.float32)
    dx = cpu.max_pool2d_backward(gy, idx, x.shape, window=window, channels_last=True)
    dx1 = cpu.max_pool2d_backward(np.ascontiguousarray(gy.transpose(0, 3, 1, 2)), idx1,
                                  (2, 5, 9, 7), window=window)
    assert np.array_equal(dx, dx1.transpose(0, 2, 3, 1))


def reference_input(a):
    """What the CPU reference pools: bfloat16 widened to float32 (exactly), others as they are."""
    return from_bfloat16(a) if a.dtype == BFLOAT16 else a


@gpu
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("channels", [13, 16])  # one channel a thread; the widest lanes
def test_max_pool_channels_last(cu, rng, window, dtype, relu, channels):
    """y and idx exactly the reference's; dx to one rounding of the sum (overlapping windows
    add in another order on each side, and the GPU rounds once)."""
    x = nhwc(rng, (3, 11, 9, channels), dtype)  # odd sizes
    x[0, :2, :2, :] = x[0, 0, 0, 0]  # ties
    forward = "relu_max_pool2d_forward" if relu else "max_pool2d_forward"
    y, idx = getattr(cpu, forward)(reference_input(x), *window, channels_last=True)
    dy, didx = getattr(cu, forward)(cu.asarray(x), *window, channels_last=True)
    assert np.array_equal(as_f64(cu.to_numpy(dy)), as_f64(y))
    assert np.array_equal(cu.to_numpy(didx), idx)
    if relu:
        assert (idx < 0).any() and (idx >= 0).any()
    gy = nhwc(rng, y.shape, dtype)
    ref = as_f64(cpu.max_pool2d_backward(reference_input(gy), idx, x.shape, window=window,
                                         channels_last=True))
    got = as_f64(cu.to_numpy(cu.max_pool2d_backward(cu.asarray(gy), didx, x.shape,
                                                    window=window, channels_last=True)))
    assert got.shape == ref.shape and not np.isnan(got).any()
    # float64 and float32 sum at most 4 terms; 16-bit results are rounded once (the reference
    # sums in float32 for bfloat16, in float16 for float16)
    tol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-6}.get(np.dtype(dtype), 1e-2)
    assert np.abs(got - ref).max() <= tol * max(1.0, np.abs(ref).max())


@gpu
def test_channels_last_backward_needs_the_window(cu, rng):
    x = cu.asarray(nhwc(rng, (1, 4, 4, 2), np.float32))
    y, idx = cu.max_pool2d_forward(x, (2, 2), (2, 2), (0, 0), channels_last=True)
    with pytest.raises(ValueError, match="needs window"):
        cu.max_pool2d_backward(y, idx, x.shape, channels_last=True)


@gpu
@pytest.mark.parametrize("window", WINDOWS[:2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("channels", [13, 16, 64])
def test_batch_norm_relu_max_pool_is_the_two_passes(cu, rng, window, dtype, channels):
    """batch_norm_relu_max_pool2d gives the bits of the GPU's own two passes, batch_norm_forward
    with relu (stored) then max_pool2d_forward, y and idx; and the CPU reference's values."""
    x = nhwc(rng, (3, 11, 9, channels), dtype)
    stat = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    mean, var, weight, bias = (rng.standard_normal(channels).astype(stat) * 0.3 for _ in "abcd")
    var, eps = np.abs(var) + stat(0.5), 1e-5
    stats = [cu.asarray(a) for a in (mean, var, weight, bias)]
    dx = cu.asarray(x)
    z = cu.batch_norm_forward(dx.reshape(-1, channels), *stats, eps, relu=True)
    y, idx = cu.max_pool2d_forward(z.reshape(x.shape), *window, channels_last=True)
    fy, fidx = cu.batch_norm_relu_max_pool2d(dx, *stats, eps, *window)
    assert np.array_equal(cu.to_numpy(fy).view(np.uint8), cu.to_numpy(y).view(np.uint8))
    assert np.array_equal(cu.to_numpy(fidx), cu.to_numpy(idx))
    ref, _ = cpu.batch_norm_relu_max_pool2d(as_f64(x), mean.astype(np.float64),
                                            var.astype(np.float64), weight.astype(np.float64),
                                            bias.astype(np.float64), eps, *window)
    tol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}.get(np.dtype(dtype), 1e-2)
    assert np.abs(as_f64(cu.to_numpy(fy)) - ref).max() <= tol * max(1.0, np.abs(ref).max())


@gpu
def test_batch_norm_relu_max_pool_refuses_channels_past_shared_memory(cu):
    """Each block holds every channel's mean, scale and shift in shared memory: a channel
    count whose three vectors would not fit is refused, naming the op and the count."""
    c = 4104  # 3 x 4104 floats: past 48 KB
    x = cu.asarray(np.zeros((1, 3, 3, c), np.float32))
    stats = [cu.asarray(np.ones(c, np.float32)) for _ in range(4)]
    with pytest.raises(ValueError, match="batch_norm_relu_max_pool2d: 4104 channels"):
        cu.batch_norm_relu_max_pool2d(x, *stats, 1e-5, *WINDOWS[0])


def test_cpu_backward_adds_a_second_part_first(rng=np.random.default_rng(5)):
    x = nhwc(rng, (2, 9, 7, 5), np.float16)
    y, idx = cpu.max_pool2d_forward(x, *WINDOWS[0], channels_last=True)
    ga, gb = nhwc(rng, y.shape, np.float16), nhwc(rng, y.shape, np.float16)
    both = cpu.max_pool2d_backward(ga, idx, x.shape, window=WINDOWS[0], channels_last=True,
                                   gb=gb)
    summed = cpu.max_pool2d_backward(cpu.add(ga, gb), idx, x.shape, window=WINDOWS[0],
                                     channels_last=True)
    assert both.tobytes() == summed.tobytes()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=gpu)])
def test_backward_refuses_a_second_part_unlike_gy(request, backend,
                                                  rng=np.random.default_rng(6)):
    """`gb` of another dtype is a TypeError, of another shape a ValueError, on both backends."""
    be = cpu if backend == "cpu" else request.getfixturevalue("cu")
    x = be.asarray(nhwc(rng, (2, 9, 7, 8), np.float16))
    y, idx = be.max_pool2d_forward(x, *WINDOWS[0], channels_last=True)
    for gb, error in ((be.astype(y, np.float32), TypeError), (y[:1], ValueError)):
        with pytest.raises(error, match="max_pool2d_backward: gb"):
            be.max_pool2d_backward(y, idx, x.shape, window=WINDOWS[0], channels_last=True,
                                   gb=be.asarray(np.ascontiguousarray(be.to_numpy(gb))))


@gpu
@pytest.mark.parametrize("shape", [(3, 11, 9), (2, 8, 14), (1, 1, 5), (2, 17, 33)], ids=str)
@pytest.mark.parametrize("dtype,channels", [(np.float16, 8), (np.float16, 64),
                                            (np.float16, 256), (BFLOAT16, 64),
                                            (np.float32, 8), (np.float32, 128)],
                         ids=lambda v: v if isinstance(v, int) else np.dtype(v).name)
def test_the_stems_walking_backward_has_the_gathers_bits(cu, rng, monkeypatch, shape, dtype,
                                                         channels):
    """The 3x3/2 window's walking backward (a thread walks a column of windows down the rows,
    its right neighbour's windows shuffled over) gives the per-pixel gather's bits, with a
    second part of gy or without, after a plain and a ReLU forward. Odd and even sizes, runs
    and warps cut short, 1 to 32 channel groups a warp."""
    from dptrain.backend.cuda import pool

    window = WINDOWS[0]
    x = nhwc(rng, (shape[0], shape[1], shape[2], channels), dtype)
    x[0, :2, :3, :] = x[0, 0, 0, 0]  # ties
    assert pool._walk(x.dtype, channels, window) is not None
    dx = cu.asarray(x)
    runs = []
    for forward in (cu.max_pool2d_forward, cu.relu_max_pool2d_forward):
        y, idx = forward(dx, *window, channels_last=True)
        ga, gb = (cu.asarray(nhwc(rng, y.shape, dtype)) for _ in range(2))
        for part in (None, gb):
            runs.append(lambda idx=idx, ga=ga, part=part: cu.to_numpy(cu.max_pool2d_backward(
                ga, idx, x.shape, window=window, channels_last=True, gb=part)).tobytes())
    walked = [run() for run in runs]
    monkeypatch.setattr(pool, "_walk", lambda *a: None)
    assert walked == [run() for run in runs]
