"""The streaming input path (dptrain.data.stream, --data-on host): batches gathered ahead by
threads and copied through a ring of slots equal the resident batches bitwise, across epochs,
from a resumed step and with padded batches; errors surface in one line; the threads stop.
Marked gpu: the same on the GPU, through a captured and replayed step."""
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_loader import GraphBackend, toy

from dptrain import backend
from dptrain.data import DeviceLoader, StrideSampler
from dptrain.data.stream import planned_batches
from dptrain.errors import RunStopped

cpu = backend.get("cpu")


def _stream_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dptrain-stream")]


def _walk(loader, sampler, first, last, be=cpu, run=None):
    """(x, y) bytes of every step first .. last - 1, the way the training loop walks them."""
    out = []
    per_epoch = len(sampler)
    for step in range(first, last):
        loader.set_batch(sampler.epoch_batches(step // per_epoch)[step % per_epoch])
        x, y = run() if run is not None else loader.batch()
        be.runtime.synchronize()
        out.append((be.to_numpy(x).tobytes(), be.to_numpy(y).tobytes()))
    return out


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("depth,workers", [(2, 1), (3, 2), (5, 3)])
def test_streamed_batches_equal_resident_ones_across_epochs(drop_last, depth, workers):
    data = toy(n=53)  # 53 = 3 global batches of 16 and a ragged 5: padded without drop_last
    sampler = StrideSampler(53, 8, world_size=2, rank=1, seed=4, drop_last=drop_last)
    last = 3 * len(sampler) + 1  # three epoch boundaries, ending one step into the fourth
    resident = DeviceLoader(data, cpu, 8, data_on="device")
    host = DeviceLoader(data, cpu, 8, data_on="host", prefetch_depth=depth,
                        data_workers=workers)
    assert resident.resident and not host.resident
    assert host.plan(planned_batches(sampler, 0, last)) and host.mode == "streamed"
    want = _walk(resident, sampler, 0, last)
    assert _walk(host, sampler, 0, last) == want
    host.close()
    assert not _stream_threads()


def test_resume_mid_epoch_streams_from_the_checkpoints_step():
    data = toy(n=61)
    sampler = StrideSampler(61, 6, world_size=1, rank=0, seed=9, drop_last=False)
    resident = DeviceLoader(data, cpu, 6)
    full = _walk(resident, sampler, 0, 30)
    host = DeviceLoader(data, cpu, 6, data_on="host")
    host.plan(planned_batches(sampler, 13, 30))  # step 13: inside the second epoch of 11
    assert _walk(host, sampler, 13, 30) == full[13:]
    host.close()


def test_streamed_step_replays_with_fixed_buffers():
    """Through a captured step (GraphBackend): the stream's copy into the fixed staging
    buffer happens in set_batch, outside the step, which reads the same arrays each replay."""
    data = toy(n=40)
    sampler = StrideSampler(40, 6, seed=2)
    be = GraphBackend()
    host = DeviceLoader(data, be, 6, data_on="host", prefetch_depth=2)
    ref = DeviceLoader(data, cpu, 6)
    host.plan(planned_batches(sampler, 0, 12))
    host.set_batch(sampler.epoch_batches(0)[0])
    replay = be.capture(host.batch)
    assert replay.ops == ["gather_normalize", "getitem"]
    got = [(x.tobytes(), y.tobytes()) for x, y in [replay()]]
    got += _walk(host, sampler, 1, 12, run=replay)
    assert got == _walk(ref, sampler, 0, 12)
    host.close()


def test_set_batch_off_the_plan_is_refused():
    data = toy()
    host = DeviceLoader(data, cpu, 4, data_on="host")
    host.plan([np.arange(4), np.arange(4, 8)])
    with pytest.raises(RuntimeError, match="step 1 asked for other indices"):
        host.set_batch([4, 5, 6, 7])
    host.close()


def test_running_past_the_plan_is_an_error_not_a_hang():
    host = DeviceLoader(toy(), cpu, 4, data_on="host")
    host.plan([np.arange(4)])
    host.set_batch(np.arange(4))
    with pytest.raises(RuntimeError, match="no planned batch for step 2"):
        host.set_batch(np.arange(4))
    host.close()
    assert not _stream_threads()


class _FailingImages:
    """A memory map whose reads fail, as a disk error would."""
    filename = "/data/store/images.npy"

    def __init__(self, images, fail_from):
        self.images, self.fail_from, self.reads = images, fail_from, 0
        self.shape, self.dtype, self.ndim = images.shape, images.dtype, images.ndim

    def __len__(self):
        return len(self.images)

    def take(self, indices, axis=0, out=None, mode="raise"):
        self.reads += 1
        if self.reads > self.fail_from:
            raise OSError("[Errno 5] Input/output error")
        return np.take(self.images, indices, axis=axis, out=out, mode=mode)


def test_a_worker_error_surfaces_in_one_line_naming_the_file():
    base = toy(n=40)
    data = toy(n=40, images=_FailingImages(base.images, fail_from=2))
    sampler = StrideSampler(40, 4, seed=1)
    host = DeviceLoader(data, cpu, 4, data_on="host", prefetch_depth=2, data_workers=1)
    host.plan(planned_batches(sampler, 0, 10))
    batches = sampler.epoch_batches(0)
    host.set_batch(batches[0])
    host.set_batch(batches[1])
    with pytest.raises(RunStopped) as err:
        host.set_batch(batches[2])
    text = str(err.value)
    assert "\n" not in text and "/data/store/images.npy" in text and "step 3" in text
    assert "OSError" in text and "Input/output error" in text
    host.close()
    assert not _stream_threads()


def test_a_failing_plan_surfaces_in_one_line():
    def plan():
        yield np.arange(4)
        raise ValueError("epoch 7 is out of range")

    host = DeviceLoader(toy(), cpu, 4, data_on="host")
    host.plan(plan())
    host.set_batch(np.arange(4))
    with pytest.raises(RunStopped, match=r"planning step 2 failed: ValueError: "
                                         r"epoch 7 is out of range$"):
        host.set_batch(np.arange(4))
    host.close()
    assert not _stream_threads()


def test_closing_early_stops_threads_blocked_on_a_full_ring():
    host = DeviceLoader(toy(n=50), cpu, 5, data_on="host", prefetch_depth=2, data_workers=3)
    host.plan(planned_batches(StrideSampler(50, 5), 0, 1000))
    host.set_batch(StrideSampler(50, 5).epoch_batches(0)[0])
    host.close()
    assert not _stream_threads() and host.mode == "staged"


def test_data_on_choices_and_depths_are_checked():
    data = toy()
    with pytest.raises(ValueError, match="data_on must be one of auto, device, host"):
        DeviceLoader(data, cpu, 4, data_on="gpu")
    with pytest.raises(ValueError, match="--prefetch-depth 1: must be an integer >= 2"):
        DeviceLoader(data, cpu, 4, data_on="host", prefetch_depth=1)
    with pytest.raises(ValueError, match="--data-workers 0: must be an integer >= 1"):
        DeviceLoader(data, cpu, 4, data_workers=0)
    with pytest.raises(ValueError, match="--data-on device: the training images take"):
        DeviceLoader(data, GraphBackend(free=100), 4, data_on="device")
    assert not DeviceLoader(data, cpu, 4).plan([np.arange(4)])  # auto, resident: no stream


def test_auto_streams_ahead_when_the_images_do_not_fit():
    loader = DeviceLoader(toy(), GraphBackend(free=100), 4, data_on="auto")
    assert loader.mode == "staged"  # until the loop's plan arrives
    try:
        assert loader.plan([np.arange(4), np.arange(4, 8)]) and loader.mode == "streamed"
    finally:
        loader.close()
    assert loader.mode == "staged"


@pytest.mark.parametrize("argv,fault", [
    (["--data-on", "gpu"], "--data-on"),
    (["--prefetch-depth", "1"], "--prefetch-depth 1"),
    (["--prefetch-depth", "0"], "--prefetch-depth"),
    (["--data-workers", "0"], "--data-workers"),
])
def test_bad_stream_options_exit_2_with_one_line(argv, fault, tmp_path):
    out = subprocess.run([sys.executable, "-m", "dptrain", "train", "--device", "cpu",
                          "--model", "mlp", "--train-images", "64", "--val-images", "16",
                          "--max-steps", "1", "--no-progress", "--cache-dir", str(tmp_path),
                          *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and fault in lines[0], out.stderr


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_weights_equal_with_data_on_host_and_device(device, tmp_path):
    """Training through the stream gives the resident run's weights bit for bit, across an
    epoch boundary, with padded batches and the augmentation on (GPU: the captured step)."""
    from dptrain.run.config import TrainConfig
    from dptrain.run.train import train

    weights, summaries = {}, {}
    for data_on in ("device", "host"):
        cfg = TrainConfig(device=device, model="mlp", dataset="synthetic", train_images=200,
                          val_images=32, epochs=3, max_steps=12, batch_size=24, drop_last=False,
                          augment=True, log_every=3, data_on=data_on, prefetch_depth=2,
                          cache_dir=str(tmp_path / "cache"), save=str(tmp_path / f"{data_on}.npz"),
                          progress=False, seed=3)
        summaries[data_on] = train(cfg, echo=lambda _: None)
        with np.load(tmp_path / f"{data_on}.npz") as w:
            weights[data_on] = {k: w[k] for k in w.files}
    assert summaries["host"]["data_path"] == "streamed"
    assert summaries["device"]["data_path"] == "resident"
    assert summaries["host"]["config"]["data_on"] == "host"
    assert weights["host"].keys() == weights["device"].keys()
    for name, value in weights["device"].items():
        assert np.array_equal(value, weights["host"][name]), name
    assert not _stream_threads()


def test_resume_with_the_other_data_on_continues_the_run_bitwise(tmp_path):
    """A run checkpointed mid-epoch with --data-on device and resumed with --data-on host
    ends with the uninterrupted run's weights: the choice is not part of a run's identity."""
    from dptrain.run.config import TrainConfig
    from dptrain.run.train import train

    said = []

    def run(name, data_on, max_steps, **extra):
        train(TrainConfig(device="cpu", model="mlp", dataset="synthetic", train_images=200,
                          val_images=32, epochs=3, max_steps=max_steps, batch_size=24,
                          drop_last=False, augment=True, lr_schedule="constant",
                          warmup_steps=0, log_every=100, data_on=data_on,
                          cache_dir=str(tmp_path / "cache"), save=str(tmp_path / f"{name}.npz"),
                          progress=False, seed=5, **extra), echo=said.append)
        with np.load(tmp_path / f"{name}.npz") as w:
            return {k: w[k] for k in w.files}

    full = run("full", "device", 14)
    run("part", "device", 11, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=11)
    resumed = run("resumed", "host", 14, checkpoint_dir=str(tmp_path / "ck"), resume="auto")
    assert any("resumed from" in line and "at step 11" in line for line in said), said
    for name, value in full.items():
        assert np.array_equal(value, resumed[name]), name


@pytest.mark.gpu
def test_cuda_streamed_equals_resident_through_a_captured_step():
    cu = backend.get("cuda")
    data = toy(n=301, shape=(3, 9, 11))
    sampler = StrideSampler(301, 37, world_size=2, rank=1, seed=5, drop_last=False)
    last = 2 * len(sampler) + 2
    results = {}
    for data_on in ("device", "host"):
        loader = DeviceLoader(data, cu, 37, data_on=data_on, prefetch_depth=3, data_workers=2,
                              augment=True, augment_seed=7, shard=(1, 2))
        loader.plan(planned_batches(sampler, 0, last))
        out_x = cu.zeros((37, 3, 9, 11), np.float32)
        out_y = cu.zeros((37,), np.int64)

        def step(loader=loader, out_x=out_x, out_y=out_y):
            x, y = loader.batch()
            cu.runtime.device_copy_(out_x, x)
            cu.runtime.device_copy_(out_y, y)

        run = cu.runtime.capture(step, warmup=1)
        results[data_on] = _walk(loader, sampler, 0, last, be=cu,
                                 run=lambda run=run, o=(out_x, out_y): (run(), o)[1])
        loader.close()
    assert results["host"] == results["device"]
    assert not _stream_threads()


@pytest.mark.gpu
def test_cuda_streaming_primitives():
    """pinned_empty, upload_async_ on the copy stream from another thread (thread_target),
    events between the streams, device_copy_ on the compute stream."""
    cu = backend.get("cuda")
    rt = cu.runtime
    host = rt.pinned_empty((5, 3, 7), np.uint8)
    host[...] = np.random.default_rng(0).integers(0, 256, host.shape, dtype=np.uint8)
    slot, fixed = cu.zeros((5, 3, 7), np.uint8), cu.zeros((5, 3, 7), np.uint8)
    events = []

    def copy():
        with rt.on(rt.copy_stream()):
            rt.upload_async_(slot, host)
        events.append(rt.record(rt.copy_stream()))

    thread = threading.Thread(target=rt.thread_target(copy))
    thread.start()
    thread.join()
    rt.host_wait(events[0])
    rt.wait(events[0])
    rt.device_copy_(fixed, slot)
    rt.synchronize()
    assert np.array_equal(cu.to_numpy(fixed), host)
    with pytest.raises(ValueError, match="device_copy_"):
        rt.device_copy_(fixed, cu.zeros((5, 3, 6), np.uint8))
