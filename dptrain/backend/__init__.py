"""Backends: the one place that knows which device an array lives on.

A backend has two halves, with the same names on every device:

* **Array ops** (``OPS``, registered with ``@op`` where they are defined,
  dptrain.backend.registry): plain functions over raw arrays (NumPy for ``cpu``, CuPy arrays
  filled by our own kernels for ``cuda``). Ops, layers and optimizers call ``be.<name>(...)``
  on the backend of their inputs and never branch on the device.
* **The runtime** (``be.runtime``, the names in ``RUNTIME``): streams and the ordering between
  them, capture and replay of a whole step, a communication timer, uploads from the host, the
  precision policy, the random-number state and the communicator. The CPU runtime implements
  each call trivially (one implicit stream, a step is "replayed" by calling it, collectives
  over MPI), so the reducer and the training loop read the same on both devices.

Nothing outside ``dptrain/backend/`` imports CuPy or asks which device it runs on.
The backend imports no other package of dptrain: it is the lowest layer.

Conventions shared by all backends:
  * Functions return new contiguous arrays unless named ``*_`` (in place).
  * Arrays expose ``.shape``, ``.dtype``, ``.size``, ``.ndim`` and ``.reshape``;
    nothing else of the array API is used outside a backend.
  * Scalars that change from step to step (learning rate, loss scale, the random offset)
    live in small device arrays, so a captured CUDA graph reads the current value.
  * Layouts follow PyTorch: NCHW activations, conv weight (C_out, C_in, kH, kW),
    linear weight (out, in).
  * Augmentation draws come from a counter-based hash (splitmix64 of seed, step counter and
    image index) over a small uint64 device array [seed, counter] that the caller owns and
    ``augment_crop_flip`` / ``augment_resized_crop`` advance themselves, so both backends
    draw the same crops and flips.
  * No op keeps state between calls: where reusing work or memory pays (the CPU's im2col
    columns, from a convolution's forward to its weight gradient), the caller owns a
    ``new_workspace()`` object and passes it as ``workspace=`` (conv2d_*, max_pool2d_*,
    relu_backward take it; a backend with nothing to reuse ignores it); any call order gives
    the same results. Likewise ``max_pool2d_backward(..., window=(kernel, stride, padding))``
    may use the forward's window (the GPU's kernel for windows that tile the input); idx
    alone defines the result. Its ``gb=`` is a second part of the gradient: gy + gb pooled
    back, the add's bits (the GPU reads both parts in its pass).
  * ``add_(dst, src)`` accumulates a 16-bit src of dst's shape into a float32 dst, the cast
    folded into the add (a mixed-precision parameter's gradient, ``ops.CastParameter``).
  * ``conv2d_backward_data(..., spread_later=True)`` may return a ``Spread``
    (dptrain.backend.spread: a strided shortcut's product, its zeros not written) instead of
    an array; ``batch_norm_backward_reduce_joined`` takes one as ``gb``, ``.total()`` gives
    the array.

The runtime (``be.runtime``), with the CPU's trivial meaning in brackets:
  ``current_stream()``, ``comm_stream()``   the stream ops launch on now; the one collectives
                                             use [one object standing for the host]
  ``on(stream)``                            context: launches inside go to ``stream`` [no-op]
  ``record(stream=None) -> event``          an event marking the work issued so far on
                                             ``stream`` (default: the current one) [a token]
  ``wait(event, stream=None)``              ``stream`` waits for ``event`` [no-op]
  ``order(waiter, signaller)``              ``waiter`` waits for all work issued so far on
                                             ``signaller`` [no-op]
  ``synchronize()``                         the host waits for all issued work [no-op]
  ``stamp(stream=None) -> stamp``           a timestamp of the work issued so far on
                                             ``stream``, also inside a captured step (a
                                             slot the device's clock writes) [the host clock]
  ``stamp_seconds(stamps) -> [float]``      seconds from the first stamp to each, as the
                                             latest run wrote them (waits) [differences]
  ``clear_stamps()``                        reuse the stamps' slots (between eager steps)
  ``prepare(dtypes=None, trace=None)``      build the kernels for arrays of `dtypes`
                                             (default: all) ahead of the first step
                                             (compiled in parallel, or loaded from the
                                             on-disk cache): all, or those `trace()` (the
                                             model run at the step's shapes) launches, as
                                             recorded without launching, and the step's
                                             own; {"files", "built", "seconds", "traced",
                                             ...}; others build on first use [nothing]
  ``prebuild(dtypes)``                      start building the step's own kernels for
                                             `dtypes` in the background, before the model
                                             is known; the next prepare() takes them over
                                             [nothing]
  ``capture(step, warmup=2) -> run``        ``run()`` calls ``step()`` eagerly ``warmup``
                                             times, then records it once as a CUDA graph and
                                             replays that; ``step`` takes no arguments, its
                                             inputs reach it through device buffers written
                                             before each call [run() calls step()];
  ``records_graphs``                        True where capture records a graph [False]
  ``comm_timer() -> timer``                 ``timer.issue(fn, *args)`` issues a collective;
                                             ``timer.wait_begin()``/``wait_end()`` bracket the
                                             compute stream's wait for communication;
                                             ``timer.read()`` -> exposed seconds per step
                                             (GPU: the latest eager step; None under graph
                                             replay, where events cannot be read back) [the
                                             host clock around every collective, mean per
                                             step since the last read]
  ``upload_(dst, host)``                    copy a host array into device array ``dst`` (same
                                             size), asynchronously on the current stream; the
                                             host array may be reused at once [a copy]
  ``clone(a) -> copy``                      a copy of device array ``a`` by the copy engine,
                                             no kernel (real inside a kernel recording) [a
                                             copy]
  ``copy_stream()``                         the stream host-to-device copies use, so they
                                             overlap the compute stream [the host]
  ``pinned_empty(shape, dtype)``            a host array in page-locked memory [np.empty]
  ``upload_async_(dst, host)``              copy a ``pinned_empty`` array into ``dst`` on the
                                             current stream, unstaged: ``host`` must not
                                             change until an event recorded after it is done
                                             [a copy]
  ``device_copy_(dst, src)``                device to device, same shape and dtype, on the
                                             current stream by the copy engine [a copy]
  ``host_wait(event)``                      the host waits for ``event`` [no-op]
  ``thread_target(fn) -> fn``               ``fn`` made to run in another thread on this
                                             thread's device [fn itself]
  ``PRECISIONS``, ``precision``,            the precision policy: which arithmetic the matrix
  ``set_precision(name)``,                  ops (matmul, conv2d) use; ``set_precision("auto")``
  ``precision_scope(name)``                 picks the device's best [fp32 only]
  ``mixed_precisions()``                    the 16-bit activation types its kernels run
                                             ("bf16", "fp16" on GPUs of compute capability
                                             >= 8.0) [("fp16",): NumPy has no bfloat16]
  ``manual_seed(seed)``, ``rng_state``,     random numbers (dropout): a Philox key and counter
  ``get_rng_state()``, ``set_rng_state(s)`` offset held in a device array that the drawing
                                             kernels advance themselves, so a replayed graph
                                             draws fresh numbers each step; get/set move it as
                                             host data (CUDA: uint64 [seed, offset]) [a NumPy
                                             generator's state]
  ``device_count()``, ``select_device(i)``  GPUs visible; make GPU i this process's [1; no-op]
  ``memory_info() -> (free, total)``        bytes of device memory [the host's RAM]
  ``release_memory()``                      hand the memory cached for freed arrays back to
                                             the device (another library in the process may
                                             need it) [no-op]
  ``communicator(mpi_comm)``                the collectives object for arrays of this backend
                                             over the ranks of ``mpi_comm`` (NCCL), or None
                                             when host MPI carries them [None]
"""
from __future__ import annotations

import importlib

RUNTIME = (
    "current_stream", "comm_stream", "on", "record", "wait", "order", "synchronize",
    "stamp", "stamp_seconds", "clear_stamps", "prebuild", "prepare", "capture", "records_graphs", "comm_timer", "upload_",
    "clone", "copy_stream", "pinned_empty", "upload_async_", "device_copy_", "host_wait",
    "thread_target", "PRECISIONS", "precision", "set_precision", "precision_scope",
    "mixed_precisions",
    "manual_seed", "rng_state", "get_rng_state", "set_rng_state",
    "device_count", "select_device", "memory_info", "release_memory", "communicator",
)

DEVICES = ("cpu", "cuda")
_loaded: dict[str, object] = {}
default_seed = 0  # set by dptrain.manual_seed; a backend loaded later starts from it


def __getattr__(name):
    # OPS, the contract: the ops the NumPy reference registers (dptrain.backend.registry).
    # Computed on first use, so importing this package loads no backend.
    if name == "OPS":
        return get("cpu").OPS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(device: str):
    """The backend module for ``device`` ("cpu" or "cuda"), imported once."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device not in _loaded:
        module = importlib.import_module(f"dptrain.backend.{device}")
        module.runtime.manual_seed(default_seed)
        _loaded[device] = module
    return _loaded[device]


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_device(requested: str) -> str:
    """Map --device auto|cpu|cuda to a concrete device, with a clear error for cuda without a GPU."""
    if requested == "auto":
        return "cuda" if cuda_available() else "cpu"
    if requested == "cuda" and not cuda_available():
        raise RuntimeError("--device cuda: no usable GPU (CuPy missing or no CUDA device visible)")
    if requested not in DEVICES:
        raise ValueError(f"unknown device {requested!r}; choose auto, cpu or cuda")
    return requested


def device_of(array) -> str:
    """'cuda' for CuPy arrays, 'cpu' for anything else (NumPy arrays, lists, scalars)."""
    return "cuda" if type(array).__module__.startswith("cupy") else "cpu"
