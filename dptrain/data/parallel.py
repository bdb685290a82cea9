"""Render a dataset's images over forked worker processes.

Any dataset whose rows can be made independently (a generator that is a pure function of
the index, a decoder of independent files) passes a ``render(indices, progress=None)``
function returning uint8 rows; ``render_parallel`` splits the indices into spans, and
forked workers write their rows straight into one shared anonymous mapping, so no image
is pickled. The function reaches the workers by inheritance through ``fork`` (it need
not be picklable).

Forking a process that already runs threads (MPI progress threads, CUDA) is unsafe with
some transports: ``auto_workers`` keeps to one process there and for small sets, and
large sets are best generated beforehand into the cache (``datasets/make_synthetic.py``).
"""
from __future__ import annotations

import math
import mmap
import multiprocessing
import os
import sys

import numpy as np

# Below this many rows a pool does not pay for its start-up.
PARALLEL_MIN_ROWS = 100_000

_job = None  # (render, indices, output) inherited by forked workers


def default_workers() -> int:
    """CPUs this process may run on (respects MPI/taskset binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def mpi_initialized() -> bool:
    """Whether this process runs MPI (or the Slurm rendezvous, whose threads hold sockets):
    forking after MPI_Init is unsafe with some transports, so large sets there are best
    generated beforehand."""
    rendezvous = sys.modules.get("dptrain.distributed.rendezvous")
    if rendezvous is not None and rendezvous.connected:
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Is_initialized())


def auto_workers(n: int) -> int:
    """Workers for ``n`` rows: parallel only where it pays for the fork, and is safe."""
    return 1 if n < PARALLEL_MIN_ROWS or mpi_initialized() else default_workers()


def _work(span):
    render, idx, out = _job
    start, stop = span
    out[start:stop] = render(idx[start:stop])
    return stop - start


def render_parallel(render, indices: np.ndarray, image_shape, workers: int | None = None,
                    progress=None, chunk: int = 8192) -> np.ndarray:
    """``render(indices)`` computed in spans of ``chunk`` rows over forked workers.

    Returns uint8 (len(indices), *image_shape), row j being row j of
    ``render(indices, progress)`` run in this process, which is what one worker, small
    counts, or a platform without fork get. ``progress(done, total)`` is called as spans
    complete."""
    global _job
    n = len(indices)
    workers = default_workers() if workers is None else int(workers)
    if workers <= 1 or n <= chunk or "fork" not in multiprocessing.get_all_start_methods():
        return render(indices, progress)
    image_shape = tuple(image_shape)
    shared = mmap.mmap(-1, n * math.prod(image_shape))  # MAP_SHARED: the children write here
    images = np.frombuffer(shared, np.uint8).reshape((n,) + image_shape)
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    _job = (render, indices, images)
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(spans))) as pool:
            done = 0
            for count in pool.imap_unordered(_work, spans):
                done += count
                if progress is not None:
                    progress(done, n)
    finally:
        _job = None
    return images
