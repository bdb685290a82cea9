"""Random-resized-crop and evaluation's resize + centre crop: the NumPy reference against
torchvision's sampling rule and a per-pixel loop, ranks against one process, and (marked gpu)
the CUDA kernels against the NumPy reference."""
import math

import numpy as np
import pytest

from replay import replayed_batches
from test_loader import GraphBackend, toy

from dptrain import backend
from dptrain.data import DeviceLoader, augment
from dptrain.backend.bfloat16 import BFLOAT16, from_bfloat16, to_bfloat16
from dptrain.backend.cpu import augment as ref

cpu = backend.get("cpu")
gpu = pytest.mark.gpu
M64 = (1 << 64) - 1
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
MEAN, STD = (0.3, 0.5, 0.6), (0.2, 0.25, 0.3)


def torchvision_get_params(H, W, scale, ratio, uniform, randint):
    """torchvision.transforms.RandomResizedCrop.get_params, transcribed (math.exp, Python's
    round); uniform(lo, hi) and randint(n) stand for its torch draws."""
    area = H * W
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * uniform(scale[0], scale[1])
        aspect_ratio = math.exp(uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= W and 0 < h <= H:
            return randint(H - h + 1), randint(W - w + 1), h, w
    in_ratio = float(W) / float(H)
    if in_ratio < min(ratio):
        w = W
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = H
        w = int(round(h * max(ratio)))
    else:
        w, h = W, H
    return (H - h) // 2, (W - w) // 2, h, w


def our_draws(seed, counter, index):
    """The draws of the reference's notes, as torchvision-shaped sources."""
    base = ref.splitmix64((ref.splitmix64(seed) + counter) & M64)
    key = ref.splitmix64((index + base) & M64)
    state = {"n": 0, "i": 20}

    def uniform(lo, hi):
        u = (ref.splitmix64((key + state["n"]) & M64) >> 11) * 2.0 ** -53
        state["n"] += 1
        return lo + (hi - lo) * u

    def randint(n):
        r = ref.splitmix64((key + state["i"]) & M64) % n
        state["i"] += 1
        return r
    return uniform, randint


def test_exp_is_accurate():
    for x in np.linspace(-7, 7, 2001):
        assert abs(ref.exp(float(x)) / math.exp(x) - 1) < 1e-13


@pytest.mark.parametrize("H,W,scale,ratio", [(17, 23, SCALE, RATIO), (64, 64, SCALE, RATIO),
                                             (5, 40, (0.5, 1.0), RATIO), (9, 9, (0.9, 1.0),
                                                                          (2.0, 3.0))])
def test_boxes_follow_torchvision_get_params(H, W, scale, ratio):
    for index in range(400):
        top, left, h, w, flip = ref.rrc_box(11, 3, index, H, W, scale, ratio)
        uniform, randint = our_draws(11, 3, index)
        want = torchvision_get_params(H, W, scale, ratio, uniform, randint)
        assert (top, left, h, w) == want, index
        assert 0 <= top <= H - h and 0 <= left <= W - w and flip in (0, 1)


def test_boxes_cover_the_scale_and_ratio_ranges():
    boxes = [ref.rrc_box(1, 0, i, 224, 224, SCALE, RATIO) for i in range(3000)]
    area = np.array([h * w for _, _, h, w, _ in boxes]) / 224 ** 2
    aspect = np.array([w / h for _, _, h, w, _ in boxes])
    flips = np.array([f for *_, f in boxes])
    assert area.min() < 0.1 and area.max() > 0.95 and area.min() >= 0.07
    assert aspect.min() >= 0.7 and aspect.max() <= 1.4
    assert 0.45 < flips.mean() < 0.55


def loop_resample(image, box, size, flip, mean, std):
    """Per-pixel float64 loops: bilinear of the module's notes, then (v/255 - mean) / std."""
    top, left, h, w, vh, vw, oy, ox = box
    C = image.shape[0]
    out = np.zeros((C, size, size))

    def tap(o, n, virt):
        s = max((o + 0.5) * n / virt - 0.5, 0.0)
        lo = int(s)
        return lo, min(lo + 1, n - 1), s - lo
    for i in range(size):
        y0, y1, ly = tap(i + oy, h, vh)
        for j in range(size):
            x0, x1, lx = tap((size - 1 - j if flip else j) + ox, w, vw)
            for c in range(C):
                p = image[c, top:top + h, left:left + w].astype(np.float64)
                v = (1 - ly) * ((1 - lx) * p[y0, x0] + lx * p[y0, x1]) \
                    + ly * ((1 - lx) * p[y1, x0] + lx * p[y1, x1])
                out[c, i, j] = (v / 255 - mean[c]) / std[c]
    return out


def images(n=6, shape=(3, 13, 10), seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n,) + shape, dtype=np.uint8)


@pytest.mark.parametrize("size", [7, 16])
def test_resized_crop_matches_per_pixel_loops(size):
    x = images()
    idx = np.array([4, 0, 5, 5, 2])
    state = np.array([99, 7], np.uint64)
    got = cpu.augment_resized_crop(x, idx, state, size, SCALE, RATIO, MEAN, STD)
    assert got.shape == (5, 3, size, size) and got.dtype == np.float32
    assert state.tolist() == [99, 8]
    for b, row in enumerate(idx):
        top, left, h, w, flip = ref.rrc_box(99, 7, b, 13, 10, SCALE, RATIO)
        want = loop_resample(x[row], (top, left, h, w, size, size, 0, 0), size, flip, MEAN, STD)
        np.testing.assert_allclose(got[b], want, rtol=0, atol=2e-5)


def test_whole_image_at_its_size_is_gather_normalize_exactly():
    x = images(shape=(3, 9, 9))
    idx = np.arange(6)
    state = np.array([5, 0], np.uint64)
    got = cpu.augment_resized_crop(x, idx, state, 9, (1.0, 1.0), (1.0, 1.0), MEAN, STD)
    plain = cpu.gather_normalize(x, idx, MEAN, STD)
    flips = [ref.rrc_box(5, 0, b, 9, 9, (1.0, 1.0), (1.0, 1.0))[4] for b in range(6)]
    assert 0 < sum(flips) < 6
    for b in range(6):
        np.testing.assert_array_equal(got[b], plain[b][..., ::-1] if flips[b] else plain[b])


def test_draws_change_with_the_step_and_the_seed():
    x = images()
    a = cpu.augment_resized_crop(x, np.arange(6), np.array([1, 0], np.uint64), 8, SCALE, RATIO,
                                 MEAN, STD)
    b = cpu.augment_resized_crop(x, np.arange(6), np.array([1, 1], np.uint64), 8, SCALE, RATIO,
                                 MEAN, STD)
    c = cpu.augment_resized_crop(x, np.arange(6), np.array([2, 0], np.uint64), 8, SCALE, RATIO,
                                 MEAN, STD)
    assert not np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_augment_as_one_process(world):
    x = images(n=12)
    glob = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])
    one = cpu.augment_resized_crop(x, glob, np.array([42, 5], np.uint64), 6, SCALE, RATIO, MEAN,
                                   STD)
    for rank in range(world):
        mine = cpu.augment_resized_crop(x, glob[rank::world], np.array([42, 5], np.uint64), 6,
                                        SCALE, RATIO, MEAN, STD, rank, world)
        np.testing.assert_array_equal(mine, one[rank::world])


def test_dtypes_and_channels_last_are_the_float32_nchw_values_rounded():
    x = images()
    idx = np.arange(6)
    f32 = cpu.augment_resized_crop(x, idx, np.array([3, 0], np.uint64), 5, SCALE, RATIO, MEAN,
                                   STD)
    for dtype, cast in ((np.float16, lambda v: v.astype(np.float16)), (BFLOAT16, to_bfloat16)):
        for last in (False, True):
            got = cpu.augment_resized_crop(x, idx, np.array([3, 0], np.uint64), 5, SCALE, RATIO,
                                           MEAN, STD, dtype=dtype, channels_last=last)
            want = cast(f32.transpose(0, 2, 3, 1) if last else f32)
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, want)
    assert np.abs(from_bfloat16(to_bfloat16(f32)) - f32).max() > 0  # rounding happened


@pytest.mark.parametrize("H,W,size,want", [
    (256, 256, 224, (0, 0, 256, 256, 256, 256, 16, 16)),
    (64, 64, 64, (0, 0, 64, 64, 73, 73, 4, 4)),          # round(4.5) = 4, as torchvision
    (300, 200, 100, (0, 0, 300, 200, 171, 114, 36, 7)),  # longer side truncated
])
def test_eval_box_is_torchvision_resize_then_center_crop(H, W, size, want):
    assert ref.eval_box(H, W, size) == want


def test_resize_center_crop_matches_per_pixel_loops():
    x = images(shape=(3, 11, 14))
    got = cpu.resize_center_crop(x, np.array([2, 0]), 8, MEAN, STD)
    box = ref.eval_box(11, 14, 8)
    for b, row in enumerate([2, 0]):
        np.testing.assert_allclose(got[b], loop_resample(x[row], box, 8, False, MEAN, STD),
                                   rtol=0, atol=2e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(scale=(0.5, 0.1)), "scale must be MIN,MAX"),
    (dict(scale=(0.0, 1.0)), "scale must be MIN,MAX"),
    (dict(ratio=(1.0, float("nan"))), "ratio must be MIN,MAX"),
    (dict(ratio=(1.0,)), "ratio must be two numbers"),
    (dict(size=0), "size must be a positive integer"),
])
def test_bad_arguments(kwargs, match):
    args = dict(size=5, scale=SCALE, ratio=RATIO)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        cpu.augment_resized_crop(images(), np.arange(3), np.array([0, 0], np.uint64),
                                 args["size"], args["scale"], args["ratio"], MEAN, STD)


# ----------------------------------------------------------------------------- the loader


def rrc_toy(n=40):
    data = toy(n=n, shape=(3, 12, 9))
    data.mean, data.std = np.array(MEAN), np.array(STD)
    return data


@pytest.mark.parametrize("streaming", [False, True])
def test_loader_resamples_batches_and_views_gather(streaming):
    data = rrc_toy()
    train, view = augment.resamplers(cpu, augment.RESIZED_CROP, (3, 12, 9), 7, SCALE, RATIO, 5,
                                     (0, 1))
    loader = DeviceLoader(data, cpu, 8, max_device_bytes=0 if streaming else None,
                          resample=train)
    assert loader.augment and loader.input_shape == (3, 7, 7) and loader.image_shape == (3, 12, 9)
    idx = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    loader.set_batch(idx)
    x1, y1 = loader.batch()
    x2, _ = loader.batch()
    for counter, x in enumerate((x1, x2)):
        want = cpu.augment_resized_crop(data.images, idx, np.array([5, counter], np.uint64), 7,
                                        SCALE, RATIO, MEAN, STD)
        np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y1, data.labels[idx])
    assert loader.get_augment_state().tolist() == [5, 2]
    every = np.arange(20)  # more than one staging buffer when streaming
    xs, ys = loader.gather(every)
    np.testing.assert_array_equal(xs, cpu.resize_center_crop(data.images, every, 7, MEAN, STD))
    assert loader.get_augment_state().tolist() == [5, 2]  # evaluation draws nothing
    loader.set_augment_state([5, 0])  # a checkpoint's restore: the draws repeat
    np.testing.assert_array_equal(loader.batch()[0], x1)
    plain = DeviceLoader(data, cpu, 8, resample=view)
    plain.set_batch(idx)
    np.testing.assert_array_equal(plain.batch()[0],
                                  cpu.resize_center_crop(data.images, idx, 7, MEAN, STD))


def test_captured_step_draws_new_crops_each_replay():
    data = rrc_toy()
    be = GraphBackend()
    train, _ = augment.resamplers(be, augment.RESIZED_CROP, (3, 12, 9), None, SCALE, RATIO, 11,
                                  (0, 1))
    loader = DeviceLoader(data, be, 6, resample=train)
    assert loader.input_shape == (3, 9, 9)  # default: the stored shorter side
    idx = np.arange(6)
    loader.set_batch(idx)
    replay = be.capture(loader.batch)
    assert replay.ops == ["augment_resized_crop", "getitem"]
    seen = [replay()[0].copy() for _ in range(3)]  # counters 1..3 (0 was the capture)
    for k, x in enumerate(seen, start=1):
        np.testing.assert_array_equal(x, cpu.augment_resized_crop(
            data.images, idx, np.array([11, k], np.uint64), 9, SCALE, RATIO, MEAN, STD))
    assert all(not np.array_equal(a, b) for a, b in zip(seen, seen[1:]))


def test_loader_writes_the_models_dtype():
    data = rrc_toy()
    train, view = augment.resamplers(cpu, augment.RESIZED_CROP, (3, 12, 9), 5, SCALE, RATIO, 2,
                                     (0, 1), dtype=np.float16)
    loader = DeviceLoader(data, cpu, 4, resample=train)
    idx = np.array([0, 7, 7, 1])
    loader.set_batch(idx)
    x = loader.batch()[0]
    assert x.dtype == np.float16
    np.testing.assert_array_equal(x, cpu.augment_resized_crop(
        data.images, idx, np.array([2, 0], np.uint64), 5, SCALE, RATIO, MEAN, STD,
        dtype=np.float16))
    assert loader.gather(idx)[0].dtype == np.float16


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_loaders_resample_like_one_process(world):
    data = rrc_toy()
    idx = np.arange(16)[::-1].copy()

    def loader(batch, shard):
        train, _ = augment.resamplers(cpu, augment.RESIZED_CROP, (3, 12, 9), 6, SCALE, RATIO,
                                      3, shard)
        return DeviceLoader(data, cpu, batch, resample=train)
    whole = loader(16, (0, 1))
    whole.set_batch(idx)
    x = [whole.batch()[0] for _ in range(2)]
    for rank in range(world):
        part = loader(16 // world, (rank, world))
        part.set_batch(idx[rank::world])
        for step in range(2):
            np.testing.assert_array_equal(part.batch()[0], x[step][rank::world])


def test_augment_kind_and_input_shape():
    assert augment.kind(None) is None and augment.kind(False) is None
    assert augment.kind(True) == augment.CROP_FLIP
    assert augment.kind("random-resized-crop") == augment.RESIZED_CROP
    with pytest.raises(ValueError, match="'zoom'"):
        augment.kind("zoom")
    assert augment.input_shape("crop-flip", (1, 28, 28), 64) == (1, 28, 28)
    assert augment.input_shape("random-resized-crop", (1, 28, 30), None) == (1, 28, 28)
    with pytest.raises(ValueError, match="--rrc-scale"):
        augment.ResizedCrop(cpu, 8, scale=(0.0, 1.0))


# ----------------------------------------------------------------------------- the kernels


def compare(got, want, dtype):
    """fp32: within 1e-5 relative (bitwise is expected); 16-bit: within one ulp."""
    if np.dtype(dtype) == np.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        g, w = got.view(np.int16).astype(np.int32), want.view(np.int16).astype(np.int32)
        assert np.abs(g - w).max() <= 1


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape,size", [((3, 37, 29), 23), ((1, 8, 8), 8), ((3, 64, 64), 56)])
def test_cuda_resized_crop_equals_cpu(cu, dtype, channels_last, shape, size):
    x = images(n=11, shape=shape, seed=size)
    idx = np.array([10, 3, 3, 0, 7, 1, 9])
    mean, std = (MEAN, STD) if shape[0] == 3 else (0.4, 0.3)
    host_state = np.array([2**63 + 9, 2**64 - 1], np.uint64)  # the counter wraps
    state = cu.asarray(host_state.copy())
    dev_x, dev_idx = cu.asarray(x), cu.asarray(idx)
    for _ in range(2):
        got = cu.augment_resized_crop(dev_x, dev_idx, state, size, SCALE, RATIO, mean, std, 1, 2,
                                      dtype=dtype, channels_last=channels_last)
        want = cpu.augment_resized_crop(x, idx, host_state, size, SCALE, RATIO, mean, std, 1, 2,
                                        dtype=dtype, channels_last=channels_last)
        got = cu.to_numpy(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        compare(got, want, dtype)
        np.testing.assert_array_equal(cu.to_numpy(state), host_state)


@gpu
def test_cuda_resized_crop_is_bit_for_bit(cu):
    # The intent behind the tolerances above: boxes exact, and every float operation rounded
    # once on both sides (no FMA), so float32 values equal NumPy's bit for bit.
    x = images(n=9, shape=(3, 31, 31))
    state = cu.asarray(np.array([4, 0], np.uint64))
    idx = np.arange(9)
    got = cu.to_numpy(cu.augment_resized_crop(cu.asarray(x), cu.asarray(idx), state, 31,
                                              (0.08, 1.0), RATIO, MEAN, STD))
    want = cpu.augment_resized_crop(x, idx, np.array([4, 0], np.uint64), 31, (0.08, 1.0), RATIO,
                                    MEAN, STD)
    np.testing.assert_array_equal(got, want)


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_resize_center_crop_equals_cpu(cu, dtype, channels_last):
    x = images(n=5, shape=(3, 41, 33), seed=3)
    idx = np.array([4, 0, 2])
    got = cu.resize_center_crop(cu.asarray(x), cu.asarray(idx), 27, MEAN, STD, dtype=dtype,
                                channels_last=channels_last)
    want = cpu.resize_center_crop(x, idx, 27, MEAN, STD, dtype=dtype,
                                  channels_last=channels_last)
    compare(cu.to_numpy(got), want, dtype)


@gpu
@pytest.mark.parametrize("streaming", [False, True])
def test_cuda_resampled_graph_step_replays_new_crops(cuda, streaming):
    """The loader's random-resized-crop captured as a CUDA graph: each replay draws the next
    counter's crops, what the CPU loader draws for the same seed; gather() is the eval view."""
    data = rrc_toy()

    def loader(be):
        train, _ = augment.resamplers(be, augment.RESIZED_CROP, (3, 12, 9), 7, SCALE, RATIO, 21,
                                      (0, 1))
        return DeviceLoader(data, be, 6, max_device_bytes=0 if streaming else None,
                            resample=train)
    dev, host = loader(cuda), loader(cpu)
    seen = replayed_batches(cuda, dev, host, np.array([7, 3, 3, 0, 39, 12]), (6, 3, 7, 7))
    assert dev.get_augment_state().tolist() == [21, 5]
    for x in seen:
        compare(x, host.batch()[0], np.float32)
    assert all(not np.array_equal(a, b) for a, b in zip(seen, seen[1:]))
    every = np.arange(20)
    compare(cuda.to_numpy(dev.gather(every)[0]), host.gather(every)[0], np.float32)
