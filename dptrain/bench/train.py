"""`python -m dptrain bench train`: training-step throughput of the reference CNN, ours next
to PyTorch's on the same device, inputs and batch, in the same run.

Both sides run the same step (forward, cross-entropy, backward, SGD with momentum) on
data already on the device (ours also gathers and normalises its uint8 batch), eagerly
and, on a GPU, replayed as a captured CUDA graph; we time `--steps` steps after `--warmup` steps and report the
median over `--repeats` timed runs. PyTorch is optional: without it only our figures print.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np


def _ours(device, batch, image_shape, classes, steps, warmup, repeats, graph=False, seed=0):
    """Our training step (TrainStep: gather, forward, backward, SGD) on uint8 images held on
    the device, eagerly or replayed as a captured CUDA graph."""
    from types import SimpleNamespace

    import dptrain as dp
    from dptrain import backend, dist, nn
    from dptrain.data import DeviceLoader
    from dptrain.flat import FlatParameters
    from dptrain.optim import SGD
    from dptrain.reducer import Reducer
    from dptrain.train import TrainStep

    be = backend.get(device)
    dp.manual_seed(seed)
    model = nn.cnn(image_shape, classes).to(device)
    flat = FlatParameters(model.parameters())
    opt = SGD(flat, lr=0.01, momentum=0.9)
    reducer = Reducer(flat, dist.World(comm=dist.LocalComm(be)))
    rng = np.random.default_rng(seed)
    data = SimpleNamespace(images=rng.integers(0, 256, (batch, *image_shape), dtype=np.uint8),
                           labels=rng.integers(0, classes, batch), mean=0.5, std=0.25,
                           num_classes=classes, image_shape=image_shape)
    loader = DeviceLoader(data, be, batch)
    step_fn = TrainStep(model, opt, reducer, loader)
    run = be.runtime.capture(step_fn) if graph else step_fn
    indices = np.arange(batch, dtype=np.int64)

    def step():
        opt.begin_step()
        loader.set_batch(indices)
        run()

    def sync():
        be.runtime.synchronize()

    return _time(step, sync, steps, warmup, repeats)


def _torch(device, batch, image_shape, classes, steps, warmup, repeats, graph=False, seed=0):
    import torch
    import torch.nn as tnn

    dev = device  # the same names in PyTorch
    torch.manual_seed(seed)
    c, h, w = image_shape
    model = tnn.Sequential(
        tnn.Conv2d(c, 32, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
        tnn.Conv2d(32, 64, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
        tnn.Conv2d(64, 128, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
        tnn.Flatten(), tnn.Linear(128 * (h // 8) * (w // 8), 256), tnn.ReLU(),
        tnn.Linear(256, classes)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, c, h, w, device=dev)
    y = torch.randint(0, classes, (batch,), device=dev)

    def eager():
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def sync():
        if x.is_cuda:
            torch.cuda.synchronize()

    step = eager
    if graph:  # whole-step capture, as in PyTorch's CUDA-graph recipe
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            eager()
        step = g.replay
    return _time(step, sync, steps, warmup, repeats), torch.__version__, torch.get_num_threads()


def _time(step, sync, steps, warmup, repeats):
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dptrain bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--batch-size", type=int, nargs="+", default=[64])
    p.add_argument("--steps", type=int, default=10, help="steps per timed run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--json", default=None, help="append results to this JSON-lines file")
    args = p.parse_args(argv)

    from dptrain import backend

    device = backend.resolve_device(args.device)
    shape, classes = (1, 48, 48), 7
    modes = ["eager", "graph"] if backend.get(device).runtime.records_graphs else ["eager"]
    print(f"reference CNN training step, 48x48x1, {device}, {platform.node()}")
    print(f"{'batch':>6} {'mode':>6} {'ours ms':>9} {'ours img/s':>11} {'torch ms':>9} "
          f"{'torch img/s':>12} {'ours/torch':>10}")
    for batch in args.batch_size:
        for mode in modes:
            timing = (args.steps, args.warmup, args.repeats, mode == "graph")
            ours = _ours(device, batch, shape, classes, *timing)
            record = {"device": device, "batch": batch, "mode": mode, "ours_ms": ours * 1e3,
                      "ours_images_per_s": batch / ours, "date": time.strftime("%Y-%m-%d")}
            torch_text = f"{'-':>9} {'-':>12} {'-':>10}"
            if not args.no_torch:
                try:
                    theirs, version, threads = _torch(device, batch, shape, classes, *timing)
                    record.update(torch_ms=theirs * 1e3, torch_images_per_s=batch / theirs,
                                  torch_version=version, torch_threads=threads)
                    torch_text = (f"{theirs * 1e3:9.2f} {batch / theirs:12.0f} "
                                  f"{theirs / ours:10.2f}")
                except ImportError:
                    torch_text = f"{'(no torch)':>9}"
            print(f"{batch:6d} {mode:>6} {ours * 1e3:9.2f} {batch / ours:11.0f} {torch_text}")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
