"""The CUDA runtime: the contract of ``dptrain.backend`` (see ``RUNTIME``) on CuPy streams.

* Streams: ops launch on CuPy's current stream; ``comm_stream()`` is one non-blocking stream
  per process for collectives; ``on(stream)`` makes a stream current; events order streams.
* ``capture(step)`` runs a step eagerly for a few calls, then records it once as a CUDA graph
  (allocations from a memory pool private to the graph) and replays that graph, each call
  ordered after the caller's stream and the caller's stream after it.
* ``comm_timer()`` times the compute stream's wait for communication with two CUDA events.
* Precision of the matrix kernels: "tf32" (compute capability >= 8.0) or "fp32"; the GEMM and
  convolution launchers read ``runtime.precision`` and keep it in their plan keys.
* ``prepare()`` compiles the kernels ahead of the first step (loader.Builds): every
  kernel file's, or those a trace of the model launches (launch.recording), the step's own
  (loader.STEP_KERNELS, loader.STEP_FILES), each built from the moment it is known;
  ``prebuild()`` starts the step's own before the model exists.
* Random numbers: ``rng_state`` is a device uint64 array [seed, offset] that the dropout
  kernels read and advance on the device, so a replayed graph draws fresh numbers. It is
  created on first use, on the device current then (after ``select_device``); until then
  ``manual_seed`` and ``set_rng_state`` only set its host copy.
"""
from __future__ import annotations

import ctypes

import cupy
import numpy as np

from dptrain.backend.bfloat16 import BFLOAT16
from dptrain.backend.runtime import RuntimeBase

PRECISIONS = ("tf32", "fp32")


def _order(waiter, signaller):
    event = cupy.cuda.Event(disable_timing=True)
    event.record(signaller)
    waiter.wait_event(event)


class CapturedStep:
    """``run()``: step() eagerly for the first `warmup` calls, then a CUDA graph recorded once
    and replayed; see Runtime.capture. Keep it alive as long as the graph is used: it owns
    the graph's memory pool."""

    def __init__(self, step, warmup: int):
        self.step, self.warmup = step, int(warmup)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()
        self.graph, self.calls = None, 0

    def __call__(self):
        caller = cupy.cuda.get_current_stream()
        _order(self.stream, caller)  # after what the caller issued (inputs, metric resets)
        with self.stream:
            if self.calls < self.warmup:
                self.step()
            else:
                if self.graph is None:
                    self._capture()
                self.graph.launch(self.stream)
        self.calls += 1
        _order(caller, self.stream)  # later work on the caller's stream sees this step

    def _capture(self):
        self.stream.synchronize()
        # the eager warm-up's freed blocks back to the device: the graph's own pool allocates
        # the step's memory again, so holding both would need twice the step's memory
        cupy.get_default_memory_pool().free_all_blocks()
        with cupy.cuda.using_allocator(self.pool.malloc):
            self.stream.begin_capture()
            try:
                self.step()
            except BaseException:
                self.stream.end_capture()
                raise
            self.graph = self.stream.end_capture()


class CommTimer:
    """Two timing events on the compute stream bracket its wait for communication; read()
    gives the latest step's seconds between them, or None where they were not both recorded
    (the step ran as a graph replay: events recorded at capture cannot be read back)."""

    def __init__(self):
        self.events = {"begin": cupy.cuda.Event(), "end": cupy.cuda.Event()}
        self.marked = set()

    def issue(self, fn, *args):
        fn(*args)

    def _mark(self, name):
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            self.marked.clear()
            return
        self.events[name].record(stream)
        self.marked.add(name)

    def wait_begin(self):
        self._mark("begin")

    def wait_end(self):
        self._mark("end")

    def read(self):
        if self.marked != set(self.events):
            return None
        self.events["end"].synchronize()
        return cupy.cuda.get_elapsed_time(self.events["begin"], self.events["end"]) / 1e3


class Clock:
    """Timestamps the device writes itself (kernels/clock.cu) into fixed slots of one buffer,
    so stamps taken inside a captured step are rewritten by every replay and can be read
    after it. ``clear()`` reuses the slots from the first (call it between eager steps, never
    once a graph holds slots)."""

    CAPACITY = 1 << 14

    def __init__(self):
        self.stamps = cupy.zeros(self.CAPACITY, dtype=np.uint64)
        self.used = 0

    def clear(self):
        self.used = 0

    def stamp(self, stream) -> int:
        from dptrain.backend.cuda import launch

        if self.used == self.CAPACITY:
            raise RuntimeError(f"cuda clock: more than {self.CAPACITY} stamps without clear()")
        slot, self.used = self.used, self.used + 1
        with stream:
            launch.kernel("clock.cu", "clock_stamp_kernel")((1,), (1,),
                                                             (self.stamps, np.int32(slot)))
        return slot

    def seconds(self, slots) -> list:
        cupy.cuda.runtime.deviceSynchronize()
        ns = self.stamps[: self.used].get().astype(np.int64)
        return [float(ns[s] - ns[slots[0]]) / 1e9 for s in slots]


def _families(dtypes) -> tuple:
    """The kernel families (loader.PARTS) of arrays of `dtypes`."""
    from dptrain.backend.cuda import loader

    names = {"bfloat16" if np.dtype(d) == BFLOAT16 else np.dtype(d).name for d in dtypes}
    return tuple(loader.FAMILY_OF_DTYPE[n] for n in names)


class Runtime(RuntimeBase):
    name = "cuda"
    PRECISIONS = PRECISIONS

    def __init__(self):
        self._comm = None
        self._copy = None
        self._precision = None  # None: "auto", decided on first use on the current device
        self._host_rng = np.zeros(2, dtype=np.uint64)  # [seed, offset] until on the device
        self._rng = None
        self._clock = None

    # -- streams and ordering
    def current_stream(self):
        return cupy.cuda.get_current_stream()

    def comm_stream(self):
        if self._comm is None:
            # Default priority: the highest (the graph's nodes keeping it) was 0.3-2.2% slower
            # at 2 and 4 x H200 (CNN and ResNet-18, bf16; BENCHMARKS.md).
            self._comm = cupy.cuda.Stream(non_blocking=True)
        return self._comm

    def on(self, stream):
        """``with runtime.on(stream):`` launches inside go to `stream`."""
        return stream

    def record(self, stream=None):
        event = cupy.cuda.Event(disable_timing=True)
        event.record(cupy.cuda.get_current_stream() if stream is None else stream)
        return event

    def wait(self, event, stream=None):
        (cupy.cuda.get_current_stream() if stream is None else stream).wait_event(event)

    def synchronize(self):
        cupy.cuda.runtime.deviceSynchronize()

    # -- timestamps (timelines): the device's clock, written on the stream the work runs on
    def stamp(self, stream=None):
        if self._clock is None:
            self._clock = Clock()
        return self._clock.stamp(cupy.cuda.get_current_stream() if stream is None else stream)

    def stamp_seconds(self, stamps) -> list:
        """Seconds from the first stamp to each, as the latest run of the work wrote them (a
        replayed graph's stamps are rewritten at each replay); waits for the device."""
        return self._clock.seconds(stamps) if stamps else []

    def clear_stamps(self):
        if self._clock is not None:
            self._clock.clear()

    # -- cold start
    def prepare(self, dtypes=None, trace=None) -> dict:
        """Build the kernels for arrays of `dtypes` (default: every dtype) before the first
        step, in parallel threads (NVRTC, or CuPy's disk cache when warm): of every kernel
        file this GPU runs, or, given `trace` (a callable running the model as the step
        will, on arrays of the step's shapes), only the kernels `trace()` launches, recorded
        without launching them, and the step's own (loader.traced_units), in modules of
        those kernels alone, their builds started as they become known (loader.Builds).
        {"files", "built", "seconds", "workers", "slowest", "traced" (kernels recorded, or
        None: every kernel built)}."""
        from dptrain.backend.cuda import launch, loader

        families = loader.PARTS if dtypes is None else _families(dtypes)
        # Builds start before and during the trace: the step's own kernels first (or since
        # prebuild()), then each heavy main loop the moment the trace records it; the rest
        # once it is done.
        building = loader.take()
        if trace is None:
            building.submit(loader.every_unit(families))
            return {**building.wait(), "traced": None}
        building.submit(loader.step_units(families))

        def started(filename, name):
            unit = loader.alone(filename, name)
            if unit is not None:
                building.submit([unit])

        try:
            with launch.recording(started) as recorded:
                trace()
        except Exception:  # noqa: BLE001 - a model the trace cannot run: build them all
            building.submit(loader.every_unit(families))
            return {**building.wait(), "traced": None}
        building.submit(loader.traced_units(recorded, families))
        return {**building.wait(), "traced": len(recorded)}

    def prebuild(self, dtypes) -> None:
        """Start building the step's own kernels for arrays of `dtypes` in background
        threads (loader.begin), before the model is known; the next prepare() takes them
        over. On the first rank of a host only (prepare builds for its host)."""
        from dptrain.backend.cuda import loader

        loader.begin(_families(dtypes))

    # -- capture and replay of a step
    records_graphs = True

    def capture(self, step, warmup=2) -> CapturedStep:
        self.rng_state  # noqa: B018 - on the device before any capture: uploads cannot be captured
        return CapturedStep(step, warmup)

    def comm_timer(self) -> CommTimer:
        return CommTimer()

    def upload_(self, dst, host):
        """dst[...] = host, asynchronously on the current stream; `host` (any shape of dst's
        size, cast to dst's dtype) is staged before this returns, so it may be reused."""
        if not isinstance(dst, cupy.ndarray) or not dst.flags.c_contiguous:
            raise ValueError("cuda.upload_: dst must be a C-contiguous CuPy array")
        host = np.ascontiguousarray(np.asarray(host, dtype=dst.dtype))
        if host.size != dst.size:
            raise ValueError(f"cuda.upload_: {host.size} values do not fit an array of {dst.size}")
        if dst.size:
            dst.set(host.reshape(dst.shape), stream=cupy.cuda.get_current_stream())
        return dst

    def clone(self, a):
        """A copy of `a` by cudaMemcpyAsync on the current stream: no kernel, so it is real
        inside launch.recording() (CuPy's own copy would compile a kernel of its own)."""
        if not a.flags.c_contiguous:
            return a.copy()
        out = cupy.empty_like(a)
        if a.nbytes:
            out.data.copy_from_device_async(a.data, a.nbytes, cupy.cuda.get_current_stream())
        return out

    # -- the streaming input path (dptrain.data.stream): pinned host rows, a copy stream
    def copy_stream(self):
        """One non-blocking stream per process for host-to-device copies, so a batch's upload
        overlaps the step running on the compute stream."""
        if self._copy is None:
            self._copy = cupy.cuda.Stream(non_blocking=True)
        return self._copy

    def pinned_empty(self, shape, dtype):
        """A NumPy array in page-locked host memory (CuPy's pinned pool): the copy engine reads
        it directly, so an upload from it is truly asynchronous. Allocate before any capture."""
        dtype, count = np.dtype(dtype), int(np.prod(shape))
        memory = cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
        return np.frombuffer(memory, dtype, count).reshape(shape)  # the array keeps it alive

    def upload_async_(self, dst, host):
        """dst[...] = host by cudaMemcpyAsync on the current stream, with no staging copy:
        `host` (a ``pinned_empty`` array of dst's dtype and size) must stay unchanged until
        an event recorded after this call has completed (``host_wait``)."""
        if not isinstance(dst, cupy.ndarray) or not dst.flags.c_contiguous:
            raise ValueError("cuda.upload_async_: dst must be a C-contiguous CuPy array")
        if host.dtype != dst.dtype or host.size != dst.size or not host.flags.c_contiguous:
            raise ValueError(f"cuda.upload_async_: a contiguous {host.dtype} host array of "
                             f"{host.size} values does not fit {dst.dtype} x {dst.size}")
        if dst.nbytes:
            dst.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), dst.nbytes,
                                          cupy.cuda.get_current_stream())
        return dst

    def device_copy_(self, dst, src):
        """dst[...] = src, device to device by the copy engine on the current stream."""
        if src.shape != dst.shape or src.dtype != dst.dtype or not (
                src.flags.c_contiguous and dst.flags.c_contiguous):
            raise ValueError(f"cuda.device_copy_: {src.dtype} {src.shape} into {dst.dtype} "
                             f"{dst.shape} (both C-contiguous, same shape and dtype)")
        if dst.nbytes:
            dst.data.copy_from_device_async(src.data, dst.nbytes, cupy.cuda.get_current_stream())
        return dst

    def host_wait(self, event):
        """The host waits for `event` (from ``record``)."""
        event.synchronize()

    def thread_target(self, fn):
        """`fn`, wrapped to run in another thread on this thread's GPU (the CUDA runtime's
        current device is per thread, and a new thread starts on GPU 0)."""
        device = cupy.cuda.runtime.getDevice()

        def run(*args, **kwargs):
            cupy.cuda.runtime.setDevice(device)
            return fn(*args, **kwargs)
        return run

    # -- precision of matmul and conv2d
    @staticmethod
    def _capability() -> int:
        return int(cupy.cuda.Device().compute_capability)

    @property
    def precision(self) -> str:
        if self._precision is None:
            self._precision = "tf32" if self._capability() >= 80 else "fp32"
        return self._precision

    @precision.setter
    def precision(self, name: str) -> None:
        self.set_precision(name)

    def mixed_precisions(self) -> tuple:
        """The 16-bit activation types this GPU's kernels run (their m16n8k16 tensor-core
        products need compute capability >= 8.0)."""
        return ("bf16", "fp16") if self._capability() >= 80 else ()

    def set_precision(self, name: str) -> None:
        """Use `name` ("tf32", "fp32", or "auto": tf32 where the GPU has it) from now on."""
        if name == "auto":
            self._precision = None
            return
        if name not in PRECISIONS:
            raise ValueError(f"precision must be one of auto, {', '.join(PRECISIONS)}; got {name!r}")
        if name == "tf32" and self._capability() < 80:
            raise ValueError("tf32 needs a GPU of compute capability >= 8.0")
        self._precision = name

    # -- random numbers: [seed, Philox counter offset] on the device
    @property
    def rng_state(self):
        """The device uint64 array [seed, offset] the dropout kernels read and advance."""
        if self._rng is None:
            state = cupy.empty(2, dtype=np.uint64)
            state.set(self._host_rng, stream=cupy.cuda.get_current_stream())
            self._rng = state
        return self._rng

    def manual_seed(self, seed: int) -> None:
        self.set_rng_state(np.array([int(seed) % 2**64, 0], dtype=np.uint64))

    def get_rng_state(self) -> np.ndarray:
        """[seed, offset] as a host uint64 array (waits for the draws issued so far)."""
        if self._rng is None:
            return self._host_rng.copy()
        return self._rng.get(stream=cupy.cuda.get_current_stream())

    def set_rng_state(self, state) -> None:
        state = np.asarray(state, dtype=np.uint64).reshape(-1)
        if state.size != 2:
            raise ValueError(f"cuda.set_rng_state: expected [seed, offset], got {state.size} values")
        self._host_rng = state.copy()
        if self._rng is not None:
            self._rng.set(self._host_rng, stream=cupy.cuda.get_current_stream())

    # -- devices and collectives
    def device_count(self) -> int:
        return cupy.cuda.runtime.getDeviceCount()

    def select_device(self, index: int) -> None:
        count = self.device_count()
        if not 0 <= index < count:
            raise RuntimeError(f"no GPU {index}: this host has {count}; start at most {count} "
                               f"ranks per host")
        if self._rng is not None and self._rng.device.id != index:
            self._host_rng, self._rng = self._rng.get(), None  # recreated on the new device
        self._comm = self._copy = None
        cupy.cuda.Device(index).use()

    def memory_info(self) -> tuple[int, int]:
        free, total = cupy.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def release_memory(self) -> None:
        cupy.get_default_memory_pool().free_all_blocks()

    def communicator(self, mpi_comm):
        """An NCCL communicator over the ranks of `mpi_comm` (rank 0 makes the unique id,
        MPI carries it); its collectives run on the current stream."""
        from dptrain.backend.cuda.nccl import NCCLComm

        return NCCLComm(mpi_comm)


runtime = Runtime()
