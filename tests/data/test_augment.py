"""Device augmentation (random crop with zero padding, horizontal flip) and per-channel
normalisation: the NumPy op against a slow reference, the loader's use of it inside a
captured step, and (marked gpu) the CUDA kernels against the NumPy op."""

import numpy as np
import pytest
from replay import replayed_batches
from test_loader import GraphBackend, toy

from dptrain import backend
from dptrain.backend.bfloat16 import BFLOAT16
from dptrain.backend.cpu.ops import augment_draws
from dptrain.data import DeviceLoader

cpu = backend.get("cpu")
gpu = pytest.mark.gpu
M64 = (1 << 64) - 1


def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference(x, seed, counter, pad, first=0, stride=1):
    """Python integers and loops: the definition, written out."""
    B, C, H, W = x.shape
    out = np.zeros_like(x)
    base = splitmix64((splitmix64(seed) + counter) & M64)
    for b in range(B):
        h = splitmix64((first + b * stride + base) & M64)
        dy, dx = (h & 0xFFFFFF) % (2 * pad + 1), ((h >> 24) & 0xFFFFFF) % (2 * pad + 1)
        flip = (h >> 48) & 1
        for i in range(H):
            for j in range(W):
                si, sj = i + dy - pad, (W - 1 - j if flip else j) + dx - pad
                if 0 <= si < H and 0 <= sj < W:
                    out[b, :, i, j] = x[b, :, si, sj]
    return out


def test_splitmix64_is_the_published_one():
    # The first output of Vigna's splitmix64.c from state 0.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    from dptrain.backend.cpu.ops import _splitmix64
    assert int(_splitmix64(np.uint64(0))) == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("pad", [0, 1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_augment_matches_the_reference_and_advances_its_state(pad, dtype):
    rng = np.random.default_rng(pad)
    x = rng.standard_normal((13, 3, 7, 5)).astype(dtype)
    seed = 2**63 + 12345
    state = np.array([seed, 2**64 - 2], np.uint64)  # the counter wraps
    first = cpu.augment_crop_flip(x, state, pad)
    assert first.dtype == dtype and first.shape == x.shape
    np.testing.assert_array_equal(first, reference(x, seed, 2**64 - 2, pad))
    assert state.tolist() == [seed, 2**64 - 1]
    second = cpu.augment_crop_flip(x, state, pad)
    np.testing.assert_array_equal(second, reference(x, seed, 2**64 - 1, pad))
    assert state.tolist() == [seed, 0]
    assert not np.array_equal(first, second)
    # every image is a flip and/or a shifted window of its own, zeros outside
    draws = augment_draws(seed, 2**64 - 2, np.arange(13, dtype=np.uint64), pad)
    assert all((d >= 0).all() and (d <= 2 * pad).all() for d in draws[:2])
    assert 0 < draws[2].sum() < 13  # both flipped and unflipped images


def test_augment_of_a_shard_equals_its_rows_of_the_global_batch():
    x = np.random.default_rng(1).standard_normal((12, 2, 6, 6)).astype(np.float32)
    whole = cpu.augment_crop_flip(x, np.array([9, 4], np.uint64), 2)
    for rank in range(3):
        part = cpu.augment_crop_flip(x[rank::3], np.array([9, 4], np.uint64), 2, rank, 3)
        np.testing.assert_array_equal(part, whole[rank::3])


def test_augment_bad_arguments():
    x = np.zeros((2, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="pad"):
        cpu.augment_crop_flip(x, np.zeros(2, np.uint64), -1)
    with pytest.raises(ValueError, match="state"):
        cpu.augment_crop_flip(x, np.zeros(2, np.int64), 1)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        cpu.augment_crop_flip(x[0], np.zeros(2, np.uint64), 1)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
def test_loader_writes_the_models_16_bits(dtype):
    """A loader of the model's 16-bit dtype gives the float32 batch rounded once, as the cast
    after it gave, augmented alike: the model sees the same bits."""
    data = channel_toy()
    idx = np.array([7, 3, 3, 0, 39, 12])
    batches = []
    for d in (np.float32, dtype):
        loader = DeviceLoader(data, cpu, 6, augment=True, augment_pad=2, augment_seed=5, dtype=d)
        loader.set_batch(idx)
        batches.append(loader.batch()[0])
    assert batches[1].dtype == np.dtype(dtype)
    assert batches[1].tobytes() == cpu.astype(batches[0], dtype).tobytes()


def test_per_channel_gather_normalize():
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (20, 3, 5, 7), dtype=np.uint8)
    idx = np.array([4, 0, 19, 4])
    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    x = cpu.gather_normalize(images, idx, mean, std)
    want = (images[idx] / 255.0 - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    assert x.dtype == np.float32
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)
    # equal per-channel values give the scalar result bit for bit
    same = cpu.gather_normalize(images, idx, (0.4,) * 3, (0.2,) * 3)
    assert same.tobytes() == cpu.gather_normalize(images, idx, 0.4, 0.2).tobytes()
    with pytest.raises(ValueError, match="length C=3"):
        cpu.gather_normalize(images, idx, (0.1, 0.2), 0.3)


@pytest.mark.parametrize("layout", [(0, 0, 1, 3), (0, 0, 1, 8), (1, 0, 2, 8), (1, 2, 2, 6),
                                    (2, 1, 1, 4), (2, 0, 3, 11)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gather_normalize_laid_out_is_to_channels_last_of_it(layout, dtype):
    """With a layout the rows come laid out as the stem reads them, bit for bit the NCHW
    rows laid out by to_channels_last (zero columns, column groups, zero channels)."""
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (20, 3, 5, 7), dtype=np.uint8)
    idx = np.array([4, 0, 19, 4])
    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    left, right, group, channels = layout
    got = cpu.gather_normalize(images, idx, mean, std, dtype, layout=layout)
    want = cpu.to_channels_last(cpu.gather_normalize(images, idx, mean, std, dtype), group,
                                left, right, channels)
    assert got.shape == want.shape == (4, 5, (left + 7 + right) // group, channels)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    # a row outside the images: the NCHW op's error, as the composition gives it
    with pytest.raises(IndexError):
        cpu.gather_normalize(images, np.array([0, 20]), mean, std, dtype, layout=layout)


@pytest.mark.parametrize("layout, why", [
    ((0, 0, 1, 2), "channels >= group"), ((-1, 0, 1, 3), "columns >= 0"),
    ((0, 0, 2, 6), "whole groups"), ((1, 0, 0, 3), "does not lay out 3x5x7"),
    ((0, 0, 1), "4 integers"), ((0, 0, 1.0, 3), "4 integers"), ("0013", "4 integers")])
def test_gather_normalize_refuses_a_layout_that_does_not_fit(layout, why):
    images = np.zeros((4, 3, 5, 7), np.uint8)
    with pytest.raises(ValueError, match=f"gather_normalize: layout .*{why}"):
        cpu.gather_normalize(images, np.array([0]), 0.5, 0.25, layout=layout)
    with pytest.raises(ValueError, match="gather_normalize: layout .* needs images"):
        cpu.gather_normalize(images[:, 0], np.array([0]), 0.5, 0.25, layout=(0, 0, 1, 3))


def channel_toy():
    data = toy(n=40, shape=(3, 6, 5))
    data.mean, data.std = np.array([0.3, 0.5, 0.6]), np.array([0.2, 0.25, 0.3])
    return data


@pytest.mark.parametrize("streaming", [False, True])
def test_loader_augments_batches_never_gather(streaming):
    data = channel_toy()
    loader = DeviceLoader(data, cpu, 8, max_device_bytes=0 if streaming else None,
                          augment=True, augment_pad=2, augment_seed=5)
    plain = DeviceLoader(data, cpu, 8)
    assert loader.mean == (0.3, 0.5, 0.6) and loader.augment and not plain.augment
    idx = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    loader.set_batch(idx)
    plain.set_batch(idx)
    clean = plain.batch()[0]
    x1, y1 = loader.batch()
    x2, _ = loader.batch()
    np.testing.assert_array_equal(x1, reference(clean, 5, 0, 2))
    np.testing.assert_array_equal(x2, reference(clean, 5, 1, 2))
    np.testing.assert_array_equal(y1, data.labels[idx])
    assert loader.get_augment_state().tolist() == [5, 2]
    np.testing.assert_array_equal(loader.gather(idx)[0], clean)  # never augmented
    loader.set_augment_state([5, 1])
    np.testing.assert_array_equal(loader.batch()[0], x2)


def test_captured_augmented_step_draws_new_crops_each_replay():
    data = channel_toy()
    be = GraphBackend()
    loader = DeviceLoader(data, be, 6, augment=True, augment_pad=3, augment_seed=11)
    idx = np.array([0, 1, 2, 3, 4, 5])
    loader.set_batch(idx)
    replay = be.capture(loader.batch)
    assert replay.ops == ["gather_normalize", "augment_crop_flip", "getitem"]
    clean = cpu.gather_normalize(data.images, idx, data.mean, data.std)
    seen = [replay()[0].copy() for _ in range(4)]  # counters 1..4 (0 was the capture)
    for k, x in enumerate(seen, start=1):
        np.testing.assert_array_equal(x, reference(clean, 11, k, 3))
    assert all(not np.array_equal(a, b) for a, b in zip(seen, seen[1:]))


def test_sharded_loaders_augment_like_one_process():
    data = channel_toy()
    idx = np.arange(12)
    whole = DeviceLoader(data, cpu, 12, augment=True, augment_seed=3)
    whole.set_batch(idx)
    x = whole.batch()[0]
    for rank in range(2):
        part = DeviceLoader(data, cpu, 6, augment=True, augment_seed=3, shard=(rank, 2))
        part.set_batch(idx[rank::2])
        np.testing.assert_array_equal(part.batch()[0], x[rank::2])


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("pad", [0, 1, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BFLOAT16],
                         ids=["fp32", "fp64", "fp16", "bf16"])
def test_cuda_augment_equals_cpu(cu, rng, pad, dtype):
    x = cpu.astype(rng.standard_normal((37, 3, 11, 9)), dtype)
    seed, counter = int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 2**63))
    host_state = np.array([seed, counter], np.uint64)
    state = cu.asarray(host_state.copy())
    for k in range(3):
        got = cu.augment_crop_flip(cu.asarray(x), state, pad, 1, 2)
        want = cpu.augment_crop_flip(x, host_state, pad, 1, 2)
        np.testing.assert_array_equal(cu.to_numpy(got), want)
        np.testing.assert_array_equal(cu.to_numpy(state), host_state)


@gpu
def test_cuda_augmented_graph_step_replays_new_crops(cuda, rng):
    """The loader's augmented batch captured as a CUDA graph: each replay draws the next
    counter's crops, exactly what the CPU loader draws for the same seed."""
    data = channel_toy()
    loader = DeviceLoader(data, cuda, 6, augment=True, augment_pad=2, augment_seed=21)
    host = DeviceLoader(data, cpu, 6, augment=True, augment_pad=2, augment_seed=21)
    seen = replayed_batches(cuda, loader, host, np.array([7, 3, 3, 0, 39, 12]), (6, 3, 6, 5))
    assert loader.get_augment_state().tolist() == [21, 5]
    for x in seen:
        np.testing.assert_array_equal(x, host.batch()[0])
    assert all(not np.array_equal(a, b) for a, b in zip(seen, seen[1:]))


@gpu
@pytest.mark.parametrize("itype", [np.int64, np.int32])
def test_cuda_per_channel_gather_normalize(cu, rng, itype):
    images = rng.integers(0, 256, (41, 3, 7, 5)).astype(np.uint8)
    idx = rng.integers(0, 41, 13).astype(itype)
    mean, std = rng.uniform(0.2, 0.7, 3), rng.uniform(0.1, 0.4, 3)
    want = cpu.gather_normalize(images, idx, mean, std)
    got = cu.gather_normalize(cu.asarray(images), cu.asarray(idx), mean, std)
    np.testing.assert_array_equal(cu.to_numpy(got), want)  # bit for bit
    one = rng.integers(0, 256, (9, 1, 4, 3)).astype(np.uint8)
    got = cu.gather_normalize(cu.asarray(one), cu.asarray(idx % 9), (0.3,), (0.2,))
    np.testing.assert_array_equal(cu.to_numpy(got),
                                  cpu.gather_normalize(one, idx % 9, (0.3,), (0.2,)))
