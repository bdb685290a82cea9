"""Backends: the one place that knows which device an array lives on.

A backend is a module of plain functions over raw arrays (NumPy for ``cpu``,
CuPy arrays filled by our own kernels for ``cuda``). Ops, layers and optimizers
call ``be.<name>(...)`` on the backend of their inputs and never branch on the
device. ``OPS`` lists every function a backend must provide; ``tests/test_backend_api.py``
checks each backend against it.

Conventions shared by all backends:
  * Functions return new contiguous arrays unless named ``*_`` (in place).
  * Arrays expose ``.shape``, ``.dtype``, ``.size``, ``.ndim`` and ``.reshape``;
    nothing else of the array API is used outside a backend.
  * Scalars that change from step to step (learning rate, loss scale) live in
    small device arrays, so a captured CUDA graph reads the current value.
  * Layouts follow PyTorch: NCHW activations, conv weight (C_out, C_in, kH, kW),
    linear weight (out, in).
"""
from __future__ import annotations

import importlib

OPS = (
    # arrays
    "asarray", "to_numpy", "empty", "zeros", "full", "copy", "copy_", "fill_",
    "set_scalar_", "transpose", "getitem", "getitem_backward", "concatenate",
    "broadcast_to", "sum_to_shape", "astype",
    # elementwise (NumPy broadcasting)
    "add", "sub", "mul", "div", "neg", "pow_scalar", "pow_scalar_backward",
    "exp", "log", "sqrt", "relu", "relu_backward", "sigmoid", "sigmoid_backward",
    "tanh", "tanh_backward", "add_", "scale",
    # reductions
    "sum", "max", "max_backward",
    # matrix products
    "matmul", "bias_add", "bias_grad",
    # convolution and pooling
    "conv2d_forward", "conv2d_backward_data", "conv2d_backward_weight",
    "max_pool2d_forward", "max_pool2d_backward",
    "avg_pool2d_forward", "avg_pool2d_backward",
    # softmax family
    "softmax", "softmax_backward", "log_softmax", "log_softmax_backward",
    "cross_entropy_forward", "cross_entropy_backward", "count_correct",
    # randomness
    "manual_seed", "dropout_mask",
    # optimizers (flat buffers, in place)
    "sgd_step_", "adamw_step_",
    # data
    "gather_normalize",
)

DEVICES = ("cpu", "cuda")
_loaded: dict[str, object] = {}
default_seed = 0  # set by dptrain.manual_seed; a backend loaded later starts from it


def get(device: str):
    """The backend module for ``device`` ("cpu" or "cuda"), imported once."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device not in _loaded:
        module = importlib.import_module(f"dptrain.backend.{device}")
        module.manual_seed(default_seed)
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
