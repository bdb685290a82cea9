"""DeviceLoader: resident and streaming modes give the same batches; batch() is capture-friendly.

The capture contract is checked on the CPU with ``GraphBackend``, a backend that records
the ops a step issues and replays them as a CUDA graph would: the same functions on the
same device buffers (read at their current content), host values frozen as captured, and
results written into the arrays the capture returned. A step that read a host value, or
uploaded inside itself, would replay stale data and fail here.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from dptrain import backend
from dptrain.backend import OPS
from dptrain.data import DeviceLoader, SyntheticDataset

cpu = backend.get("cpu")


class GraphRuntime:
    """The CPU runtime, with uploads counted and forbidden inside a capture, and a memory
    size that a test can set."""

    def __init__(self, owner, free=None):
        self.owner, self.free, self.uploads = owner, free, 0

    def upload_(self, dst, host):
        if self.owner.tape is not None:
            raise AssertionError("upload_ inside a captured step")
        assert id(dst) in self.owner.device, "upload_ into an array no backend op made"
        self.uploads += 1
        return cpu.runtime.upload_(dst, host)

    def synchronize(self):
        if self.owner.tape is not None:
            raise AssertionError("synchronize inside a captured step")

    def memory_info(self):
        return cpu.runtime.memory_info() if self.free is None else (self.free, 2 * self.free)

    def __getattr__(self, name):
        return getattr(cpu.runtime, name)


class GraphBackend:
    """The CPU backend seen through a recorder: ``capture(step)`` returns ``replay()``."""

    def __init__(self, free=None):
        self.runtime = GraphRuntime(self, free)
        self.tape = None
        self.device = {}  # id -> array made by a backend op: "device memory"
        self.calls = []

    def __getattr__(self, name):
        fn = getattr(cpu, name)
        if name not in OPS:
            return fn

        def op(*args, **kwargs):
            if self.tape is not None and name == "to_numpy":
                raise AssertionError("host read of a device value inside a captured step")
            out = fn(*args, **kwargs)
            self.calls.append(name)
            if self.tape is not None:
                frozen = tuple(self._freeze(a) for a in args)
                self.tape.append((name, fn, frozen, kwargs, out))
            if isinstance(out, np.ndarray):
                self.device[id(out)] = out
            return out
        return op

    def _freeze(self, arg):
        """Host arrays are baked into a graph as they were at capture; device ones are not."""
        if isinstance(arg, np.ndarray) and id(arg) not in self.device:
            return arg.copy()
        return arg

    def capture(self, step):
        self.tape = []
        try:
            outputs = step()
        finally:
            tape, self.tape = self.tape, None

        def replay():
            for _, fn, args, kwargs, out in tape:
                np.copyto(out, fn(*args, **kwargs))
            return outputs
        replay.ops = [name for name, *_ in tape]
        replay.args = [args for _, _, args, _, _ in tape]
        return replay


def toy(n=50, shape=(3, 5, 7), seed=0, images=None):
    """A dataset of odd sizes and several channels, as any dataset offers it."""
    rng = np.random.default_rng(seed)
    if images is None:
        images = rng.integers(0, 256, (n,) + shape, dtype=np.uint8)
    return SimpleNamespace(images=images, labels=rng.integers(0, 10, len(images)),
                           num_classes=10, mean=0.47, std=0.29)


def normalised(data, idx):
    """The reference: pixels to [0, 1], then (x - mean) / std, in float64."""
    return (data.images[idx] / 255.0 - data.mean) / data.std


def both_modes(data, be, batch_size):
    resident = DeviceLoader(data, be, batch_size)
    streaming = DeviceLoader(data, be, batch_size, max_device_bytes=0)
    assert resident.resident and not streaming.resident
    return resident, streaming


def test_properties():
    data = toy()
    loader = DeviceLoader(data, cpu, 8)
    assert (loader.num_images, loader.image_shape, loader.num_classes) == (50, (3, 5, 7), 10)
    assert (loader.mean, loader.std, loader.batch_size) == (0.47, 0.29, 8)
    assert loader.resident and loader.nbytes == 50 * 3 * 5 * 7
    assert "resident" in repr(loader) and "50 images" in repr(loader)


def test_resident_and_streaming_batches_bitwise_equal():
    data = toy()
    resident, streaming = both_modes(data, cpu, 9)
    rng = np.random.default_rng(1)
    for _ in range(5):
        idx = rng.integers(0, 50, 9)  # repeats included
        for loader in (resident, streaming):
            loader.set_batch(idx)
        (xr, yr), (xs, ys) = resident.batch(), streaming.batch()
        assert xr.dtype == np.float32 and xr.shape == (9, 3, 5, 7)
        assert yr.dtype == np.int64 and yr.shape == (9,)
        assert xr.tobytes() == xs.tobytes() and yr.tobytes() == ys.tobytes()
        np.testing.assert_allclose(xr, normalised(data, idx), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(yr, data.labels[idx])


def test_batch_reflects_latest_set_batch():
    data = toy()
    for loader in both_modes(data, cpu, 4):
        loader.set_batch([1, 2, 3, 4])
        loader.set_batch([49, 0, 7, 7])
        x, y = loader.batch()
        np.testing.assert_array_equal(y, data.labels[[49, 0, 7, 7]])
        np.testing.assert_allclose(x, normalised(data, [49, 0, 7, 7]), rtol=1e-5, atol=1e-5)
        # The host array may change at once: the chosen batch does not.
        idx = np.array([5, 6, 7, 8])
        loader.set_batch(idx)
        idx[:] = 0
        np.testing.assert_array_equal(loader.batch()[1], data.labels[[5, 6, 7, 8]])


def test_gather_all_equals_normalised_dataset():
    data = toy(n=23)
    everything = np.arange(23)
    results = []
    for loader in both_modes(data, cpu, 5):  # streaming: chunks of 5, the last one of 3
        x, y = loader.gather(everything)
        assert x.shape == (23, 3, 5, 7) and x.dtype == np.float32 and y.dtype == np.int64
        np.testing.assert_allclose(x, normalised(data, everything), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(y, data.labels)
        assert x.tobytes() == cpu.gather_normalize(data.images, everything, data.mean,
                                                   data.std).tobytes()
        results.append((x, y))
        # Any order, any count, also fewer than a batch or none.
        picks = np.array([22, 0, 5, 5, 11, 3, 17])
        xp, yp = loader.gather(picks)
        assert xp.tobytes() == x[picks].tobytes() and (yp == data.labels[picks]).all()
        assert loader.gather([1])[0].shape == (1, 3, 5, 7)
        x0, y0 = loader.gather(np.array([], np.int64))
        assert x0.shape == (0, 3, 5, 7) and y0.shape == (0,)
    assert results[0][0].tobytes() == results[1][0].tobytes()


def test_gather_leaves_the_training_batch_alone():
    data = toy()
    for loader in both_modes(data, cpu, 4):
        loader.set_batch([10, 11, 12, 13])
        loader.gather(np.arange(50))
        np.testing.assert_array_equal(loader.batch()[1], data.labels[10:14])


def test_bad_indices_are_clear_errors():
    data = toy()
    for loader in both_modes(data, cpu, 4):
        with pytest.raises(ValueError, match=r"DeviceLoader\(.*set_batch: expected 4 indices"):
            loader.set_batch([1, 2, 3])
        with pytest.raises(ValueError, match="expected 4 indices"):
            loader.set_batch(np.zeros((2, 2), np.int64))
        with pytest.raises(ValueError, match=r"indices must lie in \[0, 50\), got values from 0 "
                                             r"to 50"):
            loader.set_batch([0, 1, 2, 50])
        with pytest.raises(ValueError, match=r"in \[0, 50\), got values from -1"):
            loader.set_batch([0, -1, 2, 3])
        with pytest.raises(ValueError, match="integers"):
            loader.set_batch([0.0, 1.0, 2.0, 3.0])
        with pytest.raises(ValueError, match=r"gather: indices must lie in \[0, 50\)"):
            loader.gather(np.arange(51))
        with pytest.raises(RuntimeError, match="call set_batch first"):
            loader.batch()
    with pytest.raises(ValueError, match="batch_size"):
        DeviceLoader(data, cpu, 0)
    with pytest.raises(ValueError, match="uint8"):
        DeviceLoader(toy(images=np.zeros((4, 1, 2, 2), np.float32)), cpu, 2)
    with pytest.raises(ValueError, match="uint8"):
        DeviceLoader(toy(images=np.zeros((4, 2, 2), np.uint8)), cpu, 2)


def test_mode_choice():
    data = toy()
    nbytes = 50 * 3 * 5 * 7
    assert DeviceLoader(data, cpu, 4, max_device_bytes=nbytes).resident
    assert not DeviceLoader(data, cpu, 4, max_device_bytes=nbytes - 1).resident
    # None: resident when the images take at most half the free memory, or it is unknown.
    assert DeviceLoader(data, GraphBackend(free=2 * nbytes), 4).resident
    assert not DeviceLoader(data, GraphBackend(free=2 * nbytes - 2), 4).resident
    assert DeviceLoader(data, GraphBackend(free=0), 4).resident


@pytest.mark.parametrize("streaming", [False, True])
def test_step_built_once_replays_the_new_batch(streaming):
    """The capture contract: a step recorded once, replayed after each set_batch, reads
    the newest batch, into the same output arrays, without host reads or uploads."""
    data = toy()
    be = GraphBackend()
    loader = DeviceLoader(data, be, 6, max_device_bytes=0 if streaming else None)
    assert loader.resident is not streaming
    buffers = set(be.device)  # everything the loader allocated
    first = np.array([3, 1, 4, 1, 5, 9])
    loader.set_batch(first)

    def step():
        x, y = loader.batch()
        return x, y, be.sum(x)  # a downstream op reads the batch on the device

    replay = be.capture(step)
    assert replay.ops == ["gather_normalize", "getitem", "sum"]
    for args in replay.args[:2]:  # batch() reads only the loader's fixed device buffers
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        assert arrays and all(id(a) in buffers for a in arrays)
    rng = np.random.default_rng(2)
    outputs = None
    for _ in range(4):
        idx = rng.integers(0, 50, 6)
        calls, uploads = len(be.calls), be.runtime.uploads
        loader.set_batch(idx)
        assert len(be.calls) == calls  # set_batch: host work and uploads only
        assert be.runtime.uploads == uploads + (2 if streaming else 1)
        x, y, total = replay()
        if outputs is not None:  # the same arrays every replay
            assert all(a is b for a, b in zip(outputs, (x, y, total)))
        outputs = (x, y, total)
        np.testing.assert_array_equal(y, data.labels[idx])
        np.testing.assert_allclose(x, normalised(data, idx), rtol=1e-5, atol=1e-5)
        assert total == cpu.sum(x)


def test_streams_from_a_memory_mapped_cache(tmp_path):
    SyntheticDataset("val", 40, seed=1, cache_dir=str(tmp_path))
    data = SyntheticDataset("val", 40, seed=1, cache_dir=str(tmp_path))
    assert data.from_cache and isinstance(data.images, np.memmap)
    resident, streaming = both_modes(data, cpu, 16)
    idx = np.arange(40)[::-1][:16].copy()
    for loader in (resident, streaming):
        loader.set_batch(idx)
    assert resident.batch()[0].tobytes() == streaming.batch()[0].tobytes()
    assert resident.gather(np.arange(40))[0].tobytes() == \
        streaming.gather(np.arange(40))[0].tobytes()
    assert (resident.image_shape, resident.num_classes) == ((1, 48, 48), 7)


def _laid_out(x, layout):
    left, right, group, channels = layout
    return cpu.to_channels_last(x, group, left, right, channels)


@pytest.mark.parametrize("layout", [(0, 0, 1, 3), (1, 2, 2, 8)])
@pytest.mark.parametrize("data_on", ["auto", "host"])
def test_laid_out_batches_are_the_nchw_ones_laid_out(layout, data_on):
    """With a layout, batch() and gather() (streaming: in chunks, concatenated) give the bits
    of to_channels_last of the loader's NCHW batches, from the one op a captured step runs."""
    data = toy()
    plain = DeviceLoader(data, cpu, 6, data_on=data_on)
    laid = DeviceLoader(data, cpu, 6, data_on=data_on, layout=layout)
    assert laid.layout == layout and plain.layout is None and laid.input_shape == (3, 5, 7)
    idx = np.array([3, 1, 4, 1, 5, 9])
    for loader in (plain, laid):
        loader.set_batch(idx)
    (x, y), (x0, y0) = laid.batch(), plain.batch()
    assert x.shape == laid.batch_shape(6) == (6, 5, (layout[0] + 7 + layout[1]) // layout[2],
                                              layout[3])
    assert x.tobytes() == _laid_out(x0, layout).tobytes() and (y == y0).all()
    picks = np.arange(50)[::-3]  # 17: streaming gathers 6 + 6 + 5
    (xg, yg), (xg0, _) = laid.gather(picks), plain.gather(picks)
    assert xg.shape == laid.batch_shape(17) and (yg == data.labels[picks]).all()
    assert xg.tobytes() == _laid_out(xg0, layout).tobytes()
    be = GraphBackend()
    captured = DeviceLoader(data, be, 6, data_on=data_on, layout=layout)
    captured.set_batch(idx)
    replay = be.capture(captured.batch)
    assert replay.ops == ["gather_normalize", "getitem"]  # the layout in the same pass
    captured.set_batch(idx[::-1])
    assert replay()[0].tobytes() == _laid_out(x0[::-1], layout).tobytes()


@pytest.mark.parametrize("kind", ["crop-flip", "resized-crop"])
@pytest.mark.parametrize("data_on", ["auto", "host"])
def test_augmented_batches_are_laid_out_after_the_augmentation(kind, data_on):
    """An augmentation writes NCHW; with a layout its batch is laid out after it, in a pass
    of its own: to_channels_last of the layout-less loader's batch, and so of gather()."""
    from dptrain.data.augment import ResizedCrop

    data = toy()  # 3x5x7, resampled to 3x6x6: one zero column either side or before
    layout = (1, 1, 2, 8) if kind == "resized-crop" else (1, 0, 2, 8)

    def loader(be, layout=None):
        if kind == "crop-flip":
            options = dict(augment=True, augment_pad=2, augment_seed=5)
        else:
            options = dict(resample=ResizedCrop(be, 6, seed=3))
        return DeviceLoader(data, be, 6, data_on=data_on, layout=layout, **options)

    plain, laid = loader(cpu), loader(cpu, layout)
    assert laid.batch_shape(6) == ((6, 6, 4, 8) if kind == "resized-crop" else (6, 5, 4, 8))
    idx = np.array([7, 3, 3, 0, 39, 12])
    for one in (plain, laid):
        one.set_batch(idx)
    for _ in range(2):  # a new draw each batch
        assert laid.batch()[0].tobytes() == _laid_out(plain.batch()[0], layout).tobytes()
    assert laid.gather(idx)[0].tobytes() == _laid_out(plain.gather(idx)[0], layout).tobytes()
    be = GraphBackend()
    captured = loader(be, layout)
    captured.set_batch(idx)
    ops = {"crop-flip": ["gather_normalize", "augment_crop_flip"],
           "resized-crop": ["augment_resized_crop"]}[kind]
    assert be.capture(captured.batch).ops == ops + ["to_channels_last", "getitem"]


def test_a_layout_that_does_not_fit_the_images_is_refused():
    with pytest.raises(ValueError, match=r"DeviceLoader: layout \(0, 0, 2, 8\) .* does not "
                                         r"lay out 3x5x7 images"):
        DeviceLoader(toy(), cpu, 4, layout=(0, 0, 2, 8))


def _replayed(cu, loader, ref, step, out_x, rng, rows=301, batch=37):
    """`step` (copying loader.batch() out, x into out_x) captured and called 4 times (warm-up,
    capture, replays), each after both loaders took the same random batch: yields the CPU
    loader `ref`'s (x, y) of each, whose x out_x holds bit for bit."""
    loader.set_batch(np.arange(batch))
    run = cu.runtime.capture(step, warmup=1)
    for _ in range(4):
        idx = rng.integers(0, rows, batch)
        loader.set_batch(idx)
        ref.set_batch(idx)
        run()
        cu.runtime.synchronize()
        x, y = ref.batch()
        assert cu.to_numpy(out_x).tobytes() == x.tobytes()
        yield x, y


@pytest.mark.gpu
def test_cuda_loader_matches_cpu_and_replays():
    cu = backend.get("cuda")
    if not hasattr(cu, "runtime"):
        pytest.skip("the CUDA backend has no runtime yet")
    data = toy(n=301, shape=(3, 9, 11))
    ref = DeviceLoader(data, cpu, 37)
    resident, streaming = both_modes(data, cu, 37)
    rng = np.random.default_rng(3)
    for loader in (resident, streaming):
        out_x = cu.zeros((37, 3, 9, 11), np.float32)
        out_y = cu.zeros((37,), np.int64)

        def step(loader=loader, out_x=out_x, out_y=out_y):
            x, y = loader.batch()
            cu.copy_(out_x, x)
            cu.copy_(out_y, y)

        for _, y in _replayed(cu, loader, ref, step, out_x, rng):
            np.testing.assert_array_equal(cu.to_numpy(out_y), y)
        xg, yg = loader.gather(np.arange(301))
        assert cu.to_numpy(xg).tobytes() == ref.gather(np.arange(301))[0].tobytes()
        np.testing.assert_array_equal(cu.to_numpy(yg), data.labels)


@pytest.mark.gpu
@pytest.mark.parametrize("data_on", ["auto", "host"])
def test_cuda_laid_out_loader_matches_cpu_and_replays(data_on):
    """A 16-bit loader laid out for ImageNet's stem on the GPU (one pass, 16-byte stores)
    captured and replayed gives the CPU loader's bits, and so does its gather()."""
    cu = backend.get("cuda")
    data, layout = toy(n=301, shape=(3, 9, 11)), (1, 0, 2, 8)
    ref = DeviceLoader(data, cpu, 37, dtype=np.float16, layout=layout)
    loader = DeviceLoader(data, cu, 37, data_on=data_on, dtype=np.float16, layout=layout)
    out_x = cu.zeros(loader.batch_shape(37), np.float16)

    def step():
        cu.copy_(out_x, loader.batch()[0])

    list(_replayed(cu, loader, ref, step, out_x, np.random.default_rng(3)))
    picks = np.arange(301)[::-1]
    assert cu.to_numpy(loader.gather(picks)[0]).tobytes() == ref.gather(picks)[0].tobytes()
