"""What our kernels are measured against, for ``dptrain.bench`` only: cuBLAS (through CuPy's
matmul), CuPy's own elementwise kernels, float64 products as the accuracy reference, timing
with CUDA events, and the names of the GPUs. Nothing in training uses this module."""
from __future__ import annotations

import statistics

import cupy
import numpy as np
from cupy._core import _routines_linalg as _linalg


def time_ms(fn, warmup=3, repeat=20, budget_s=0.3) -> float:
    """Median of CUDA-event times of fn() on the current stream, after warm-up; stops early
    once `budget_s` of timed work has run (at least 3 repeats)."""
    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
        if i >= 2 and sum(times) > budget_s * 1e3:
            break
    return statistics.median(times)


class EventSpans:
    """Device time of spans of work on the current stream, for per-op profiles: ``begin()``
    and ``end(name)`` record a CUDA event pair around the launches in between; ``read()``
    waits for the device and returns [(name, milliseconds)] in issue order. No host sync
    until read()."""

    def __init__(self):
        self.pairs, self.open = [], None

    def begin(self):
        self.open = cupy.cuda.Event()
        self.open.record()

    def end(self, name):
        stop = cupy.cuda.Event()
        stop.record()
        self.pairs.append((name, self.open, stop))
        self.open = None

    def read(self) -> list:
        if not self.pairs:
            return []
        self.pairs[-1][2].synchronize()
        return [(name, cupy.cuda.get_elapsed_time(a, b)) for name, a, b in self.pairs]


def cublas_precision(precision: str) -> None:
    """Make cuBLAS (cublas_matmul) use TF32 tensor cores ("tf32") or plain fp32."""
    kind = _linalg.COMPUTE_TYPE_TF32 if precision == "tf32" else _linalg.COMPUTE_TYPE_FP32
    cupy._core.set_compute_type(np.float32, kind)


def cublas_matmul(a, b, trans_a=False, trans_b=False):
    return cupy.matmul(a.T if trans_a else a, b.T if trans_b else b)


def matmul64(a, b, trans_a=False, trans_b=False):
    """The float64 product: the reference our float32 results are compared with."""
    return cublas_matmul(a.astype(cupy.float64), b.astype(cupy.float64), trans_a, trans_b)


def rel_error(got, want64) -> float:
    """||got - want|| / ||want|| with `want64` a float64 device array."""
    diff = got.astype(cupy.float64) - want64
    return float(cupy.linalg.norm(diff) / cupy.linalg.norm(want64))


# CuPy's own elementwise kernels, the reference for ours
def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def pow_scalar(a, p):
    return a ** a.dtype.type(p)


def transpose2d(a):
    return cupy.ascontiguousarray(a.T)


def device_names() -> list[str]:
    names = []
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


def library_version() -> str:
    return f"cupy {cupy.__version__}"
