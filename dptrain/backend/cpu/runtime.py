"""The CPU runtime: the contract of ``dptrain.backend`` (see ``RUNTIME``) where there is one
implicit stream and the host does all the work.

Streams, events and ordering are tokens and no-ops: every op has finished when it returns.
A "captured" step is simply called again. Collectives run synchronously inside the MPI
calls that issue them, so the communication timer sums their host time: all of it is
exposed. Random numbers come from a NumPy generator owned here.
"""
from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from dptrain.backend.runtime import RuntimeBase

PRECISIONS = ("fp32",)


class _Host:
    """The one stream of the CPU: stands in wherever a stream or an event is passed."""

    def __repr__(self):
        return "<host stream>"


class CommTimer:
    """Host clock around each collective: on the CPU every collective is exposed time."""

    def __init__(self):
        self.exposed, self.steps = 0.0, 0

    def issue(self, fn, *args):
        start = time.perf_counter()
        fn(*args)
        self.exposed += time.perf_counter() - start

    def wait_begin(self):
        pass

    def wait_end(self):
        self.steps += 1

    def read(self) -> float:
        value = self.exposed / max(1, self.steps)
        self.exposed, self.steps = 0.0, 0
        return value


class Runtime(RuntimeBase):
    name = "cpu"
    PRECISIONS = PRECISIONS

    def __init__(self):
        self.host = _Host()
        self.precision = "fp32"
        self.rng = np.random.default_rng(0)

    # -- streams and ordering: one implicit stream, everything already done
    def current_stream(self):
        return self.host

    def comm_stream(self):
        return self.host

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream=None):
        return self.host

    def wait(self, event, stream=None):
        pass

    def synchronize(self):
        pass

    # -- timestamps (timelines): the host clock, as every op is done when it returns
    def stamp(self, stream=None):
        return time.perf_counter()

    def stamp_seconds(self, stamps) -> list:
        return [s - stamps[0] for s in stamps] if stamps else []

    def clear_stamps(self):
        pass

    # -- cold start: nothing to compile
    def prebuild(self, dtypes) -> None:
        pass

    def prepare(self, dtypes=None, trace=None) -> dict:
        return {"files": 0, "built": 0, "seconds": 0.0, "workers": 0, "traced": None}

    # -- capture: nothing to record, the step runs again each call
    records_graphs = False

    def capture(self, step, warmup=2):
        return step

    def comm_timer(self) -> CommTimer:
        return CommTimer()

    def upload_(self, dst, host):
        host = np.asarray(host)
        if host.size != dst.size:
            raise ValueError(f"cpu.upload_: {host.size} values do not fit an array of {dst.size}")
        dst.reshape(-1)[...] = host.reshape(-1)
        return dst

    def clone(self, a):
        return np.array(a, copy=True)

    # -- the streaming input path: the host is the device, so a copy is an assignment
    def copy_stream(self):
        return self.host

    def pinned_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def upload_async_(self, dst, host):
        return self.upload_(dst, host)

    def device_copy_(self, dst, src):
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"cpu.device_copy_: {src.dtype} {src.shape} into {dst.dtype} "
                             f"{dst.shape}")
        np.copyto(dst, src)
        return dst

    def host_wait(self, event):
        pass

    def thread_target(self, fn):
        return fn

    # -- precision: NumPy computes in the arrays' own dtype
    @staticmethod
    def mixed_precisions() -> tuple:
        """float16 (NumPy has it; products and reductions run in float32); no bfloat16."""
        return ("fp16",)

    def set_precision(self, name: str) -> None:
        if name not in ("auto",) + PRECISIONS:
            raise ValueError(f"precision {name!r} is not available on the CPU (choose "
                             f"{', '.join(('auto',) + PRECISIONS)})")
        self.precision = "fp32"

    # -- random numbers
    def manual_seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    @property
    def rng_state(self):
        return self.rng.bit_generator.state

    def get_rng_state(self) -> dict:
        return self.rng.bit_generator.state

    def set_rng_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state

    # -- devices and collectives
    def device_count(self) -> int:
        return 1

    def select_device(self, index: int) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        """(available, total) bytes of host memory, where the OS says; else (0, 0)."""
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):
            return 0, 0

    def release_memory(self) -> None:
        pass  # NumPy hands freed arrays back itself

    def communicator(self, mpi_comm):
        return None  # host MPI carries the collectives (dptrain.distributed.MPIComm)


runtime = Runtime()
