"""A short training run on random uint8 images, eager or captured as a graph, for the tests
that check a captured step replays bit for bit like the eager one; and a loader's batch
captured and replayed, for the tests of augmentation drawn on the device."""
from types import SimpleNamespace

import numpy as np

import dptrain as dp
from dptrain.run import amp
from dptrain import backend
from dptrain import distributed as dist
from dptrain.data import DeviceLoader
from dptrain.distributed.flat import FlatParameters
from dptrain.run.nonfinite import NonFiniteGuard
from dptrain.optim import AdamW
from dptrain.distributed.reducer import Reducer
from dptrain.run.step import CAPTURE_WARMUP, TrainStep


def train_steps(device, build, image_shape, classes, graph, steps, seed, images=96, batch=32,
                optimizer=lambda flat: AdamW(flat, lr=1e-2), precision="fp32", laid_out=False):
    """(model, snapshots): `build()`'s model after `steps` steps of `optimizer` on batches of
    `batch` of `images` random images (the same for the same seed), with a host copy of the
    flat parameters after every step; precision "fp16" trains in mixed precision, with the
    loss scaler and the non-finite guard of a real run, and "fp16"/"bf16" with the
    parameters' 16-bit shadow unless DPTRAIN_SHADOW=0 (dptrain.run.amp.shadow_dtype).
    `laid_out`: the loader writes the batches as `train` does, in the activation dtype and
    laid out as the model's input_layout says (NCHW where it says None)."""
    be = backend.get(device)
    dp.manual_seed(seed)
    model = build().to(device)
    flat = FlatParameters(model.parameters(), shadow_dtype=amp.shadow_dtype(precision))
    opt = optimizer(flat)
    reducer = Reducer(flat, dist.World(comm=dist.LocalComm(be)), model)
    rng = np.random.default_rng(seed)
    data = SimpleNamespace(images=rng.integers(0, 256, (images, *image_shape), dtype=np.uint8),
                           labels=rng.integers(0, classes, images), mean=0.5, std=0.25,
                           num_classes=classes, image_shape=tuple(image_shape))
    dtype, guard = amp.compute_dtype(precision), None
    if laid_out:
        loader = DeviceLoader(data, be, batch, dtype=dtype,
                              layout=model.input_layout(image_shape, dtype, be))
    else:
        loader = DeviceLoader(data, be, batch)
    if precision in amp.LOSS_SCALED:
        guard = NonFiniteGuard(opt, dist.LocalComm(be), 0, amp.LossScaler(be))
    step_fn = TrainStep(model, opt, reducer, loader, guard, dtype)
    run = be.runtime.capture(step_fn, warmup=CAPTURE_WARMUP) if graph else step_fn
    snapshots = []
    for _ in range(steps):
        opt.begin_step()
        loader.set_batch(rng.permutation(images)[:batch])
        run()
        snapshots.append(be.to_numpy(flat.data).copy())
    return model, snapshots


def replayed_batches(cuda, loader, host, idx, shape, calls=5):
    """`loader`'s (a CUDA DeviceLoader's) batch of indices `idx` copied into a fixed (shape)
    float32 buffer, that step captured as a graph and run `calls` times (one eager call, the
    capture and its launch, then replays): the host copies of each, in order. `host`, a CPU
    loader, is set to the same indices, so its batch() calls give what each should be."""
    out = cuda.empty(shape, np.float32)
    loader.set_batch(idx)
    host.set_batch(idx)

    def step():
        cuda.copy_(out, loader.batch()[0])

    run = cuda.runtime.capture(step, warmup=1)
    seen = []
    for _ in range(calls):
        run()
        seen.append(cuda.to_numpy(out))
    cuda.runtime.synchronize()
    return seen
