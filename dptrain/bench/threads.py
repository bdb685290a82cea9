"""The launch-shape sweep: our kernels on 1 .. 32,768 GPU threads, and the workloads it times.

For a total of T threads, every kernel launched through the CUDA backend's grid-stride
helper runs in one block of T threads up to 1,024, then in blocks of 1,024 (T = 2,048 is 2
blocks, ... 32,768 is 32): ``dptrain.backend.cuda.launch.launch_shape`` sets that shape for
the duration of a ``with`` block. GEMM and convolution keep their fixed tiles; kernels whose
lanes cooperate run with whole warps (max(32, T rounded down to a multiple of 32) threads).

The workloads build everything they need from dptrain's public API, so that only this module
follows the model and training-loop interfaces:
  ``inference(device, val, seed)``  the reference CNN (fixed initial weights) over a
                                    validation set, loss and accuracy summed on the device
  ``training(device, ...)``         a few steps of ``dptrain.run.train.train`` (its ``train_s``)
Each returns ``run() -> (seconds, info)``; ``measure`` repeats one, ``sweep`` runs them under
each launch shape. ``scaling/threads.py`` turns the results into tables and plots.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

MAX_BLOCK = 1024
LAUNCH_SHAPE = "dptrain.backend.cuda.launch.launch_shape"


def launch_shape_for(total: int) -> tuple[int, int, int]:
    """(total threads, blocks, threads per block) for a total of ``total`` threads."""
    if total < 1:
        raise ValueError(f"{total}: give a positive number of threads")
    if total > MAX_BLOCK and total % MAX_BLOCK:
        raise ValueError(f"{total}: above {MAX_BLOCK} give a multiple of {MAX_BLOCK} "
                         f"(blocks of {MAX_BLOCK} threads)")
    return total, max(1, total // MAX_BLOCK), min(total, MAX_BLOCK)


def describe_shape(blocks: int, per_block: int) -> str:
    """The call the sweep makes for a shape, as text (for plans and logs)."""
    return f"{LAUNCH_SHAPE}(threads_per_block={per_block}, max_blocks={blocks})"


def launch_override():
    """The CUDA backend's launch-shape context manager; RuntimeError where it has none."""
    try:
        from dptrain.backend.cuda.launch import launch_shape
    except ImportError as e:
        raise RuntimeError(f"this checkout's CUDA backend has no {LAUNCH_SHAPE}: it cannot "
                           f"override launch shapes ({e})") from None
    return launch_shape


def measure(fn, repeats: int, budget_s: float = 2.0):
    """fn() -> (seconds, info); run up to ``repeats`` times while the total is under
    ``budget_s``. Returns (median seconds, info of the first run, runs)."""
    results = [fn()]
    while len(results) < repeats and sum(r[0] for r in results) < budget_s:
        results.append(fn())
    return statistics.median(r[0] for r in results), results[0][1], len(results)


def sweep(shapes, workloads, repeats: int):
    """For each (total, blocks, per_block) of ``shapes``, measure every workload with the
    kernels launched in that shape; yields (shape, [measure(w) for w in workloads]). The
    override is undone on leaving each shape, also on an error."""
    launch_shape = launch_override()
    for shape in shapes:
        _, blocks, per_block = shape
        with launch_shape(threads_per_block=per_block, max_blocks=blocks):
            results = [measure(w, repeats) for w in workloads]
        yield shape, results


# ----------------------------------------------------------------------------- workloads


def inference(device: str, val, seed: int, batch_size: int = 1000):
    """A function timing inference over dataset ``val`` on ``device``: the reference CNN with
    the initial weights of ``seed`` (the same every call), batches of ``batch_size``, loss and
    correct counts summed on the device and read once at the end (that read ends the timing).
    Returns run() -> (seconds, {"val_loss", "val_accuracy"})."""
    import dptrain
    import dptrain.engine.functional as F
    from dptrain import backend
    from dptrain.engine.autograd import Tensor, no_grad
    from dptrain.nn import build_model

    be = backend.get(device)
    dptrain.manual_seed(seed)
    model = build_model("cnn", val.image_shape, val.num_classes).to(device)
    model.eval()
    images, labels = be.asarray(val.images), be.asarray(val.labels)
    n = int(labels.shape[0])
    batches = [be.asarray(np.arange(start, min(start + batch_size, n), dtype=np.int64))
               for start in range(0, n, batch_size)]
    sums = be.zeros((2,), np.float32)  # loss * count, correct
    loss_sum, correct = sums[0:1].reshape(()), sums[1:2].reshape(())

    def run():
        start = time.perf_counter()
        be.fill_(sums, 0.0)
        with no_grad():
            for idx in batches:
                x = be.gather_normalize(images, idx, val.mean, val.std)
                y = be.getitem(labels, idx)
                logits = model(Tensor(x))
                loss = F.cross_entropy(logits, Tensor(y)).data
                be.add_(loss_sum, be.scale(loss, float(idx.shape[0])))
                be.add_(correct, be.count_correct(logits.data, y))
        total_loss, total_correct = be.to_numpy(sums).tolist()
        return time.perf_counter() - start, {"val_loss": total_loss / n,
                                             "val_accuracy": total_correct / n}
    return run


def training(device: str, *, steps: int, batch_size: int, train_images: int, val_images: int,
             seed: int = 0, cache_dir: str | None = None, cuda_graph: bool = False):
    """A function running ``steps`` training steps of ``batch_size`` with
    ``dptrain.run.train.train`` on ``device`` (synthetic data, one epoch, progress off). Eager
    steps unless ``cuda_graph``, so every timed step runs the same way. ``val_images``: the
    validation set train() evaluates at its end (not timed; keep it small).
    Returns run() -> (train_s, {"train_loss"})."""
    from dptrain.run.config import TrainConfig
    from dptrain.run.train import train

    options = {}
    if "cuda_graph" in TrainConfig.__dataclass_fields__:
        options["cuda_graph"] = cuda_graph

    def run():
        cfg = TrainConfig(device=device, train_images=train_images, val_images=val_images,
                          epochs=1, max_steps=steps, batch_size=batch_size, log_every=steps,
                          progress=False, seed=seed, cache_dir=cache_dir, **options)
        summary = train(cfg, echo=lambda *_: None)
        return summary["train_s"], {"train_loss": summary["train_loss"]}
    return run
