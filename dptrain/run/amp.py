"""Mixed precision (``--precision bf16`` / ``fp16``): 16-bit activations, fp32 weights, and
for fp16 loss scaling.

The policy lives where the work already happens:
  * the training step casts each batch to the 16-bit type, and a layer fed 16-bit
    activations takes its weight and bias in that type (``nn.layers``), so every activation
    and its gradient is 16-bit and the matrix products run on 16-bit tensor cores with fp32
    accumulation;
  * the parameters, their gradients (the 16-bit gradient is added into the fp32 one), the
    gradient exchange and the optimizer stay fp32: the flat buffers are the master weights;
  * in training those 16-bit weights are a shadow of the flat buffer (``shadow_dtype``,
    dptrain.distributed.flat): each rank casts the shard it updated, the all-gather moves the 16-bit
    shards (half the bytes of fp32) and the layers read them without a cast of their own;
    the bits are those of casting every weight in every forward, which eager use outside
    training (no shadow) still does;
  * the logits go back to fp32 for the loss and the metrics.

bfloat16 keeps fp32's exponent range (8 exponent bits, 7 mantissa bits): it needs no loss
scaling. NumPy has no bfloat16, so it is stored as uint16 (dptrain.backend.bfloat16) and only
the GPU computes on it.

Loss scaling (``LossScaler``, fp16 only): fp16 represents nothing below 6e-8, so small gradients
would flush to zero. The backward starts from S, the loss scale (a device scalar), instead of 1,
and the gradient shard is divided by S before the update. A step whose 16-bit gradients
overflowed (a NaN or inf in the averaged gradient: the flag is all-reduced, so every rank
agrees) is skipped on the device and halves S; ``interval`` good steps in a row double it (the
scheme of Micikevicius et al., "Mixed Precision Training", 2018). Nothing reaches the host
inside the step: ``read()`` reports the overflows at the loop's metric reads.
"""
from __future__ import annotations

import numpy as np

from dptrain import switches
from dptrain.engine.autograd import Tensor
from dptrain.backend.bfloat16 import BFLOAT16
from dptrain.errors import NonFiniteError

# --precision -> activation dtype; the others keep fp32 activations
COMPUTE_DTYPES = {"fp16": np.dtype(np.float16), "bf16": BFLOAT16}
LOSS_SCALED = ("fp16",)  # precisions whose gradients need the loss scaler
INIT_SCALE, INTERVAL = 2.0**16, 2000
MIN_SCALE = 2.0**-24  # below this even a gradient of 1 underflows fp16: the run diverged

# Layers with 16-bit kernels of their own (batch and layer norm with float32 statistics and
# parameters; attention's softmax, GELU and dropout computing in float32 on 16-bit data).
LAYERS_16BIT = frozenset({"Conv2d", "Linear", "ReLU", "MaxPool2d", "AvgPool2d", "Flatten",
                          "AdaptiveAvgPool2d", "BatchNorm1d", "BatchNorm2d", "LayerNorm", "GELU",
                          "Dropout"})


def compute_dtype(precision: str) -> np.dtype:
    """The activation dtype of `precision`: float16 for fp16, bfloat16 (uint16 storage) for
    bf16, float32 for the others."""
    return COMPUTE_DTYPES.get(precision, np.dtype(np.float32))


def shadow_dtype(precision: str):
    """The dtype of the parameters' 16-bit shadow in training at `precision`
    (dptrain.distributed.flat), or None: fp32 activations need none, and DPTRAIN_SHADOW=0
    turns it off (each layer then casts its fp32 weights every forward and the all-gather
    moves fp32: the same results, for comparison)."""
    if precision not in COMPUTE_DTYPES or not switches.on("SHADOW"):
        return None
    return COMPUTE_DTYPES[precision]


def check_runtime(precision: str, runtime) -> None:
    """ValueError where the backend's `runtime` cannot run mixed precision `precision`."""
    offered = runtime.mixed_precisions()
    if precision in COMPUTE_DTYPES and precision not in offered:
        why = (" (bf16 needs a GPU of compute capability >= 8.0: NumPy has no bfloat16)"
               if precision == "bf16" else "")
        raise ValueError(f"--precision {precision} is not available here{why}; this device "
                         f"runs {', '.join(offered) or 'no 16-bit precision'} besides "
                         f"{', '.join(runtime.PRECISIONS)}")


def resolve(precision: str, runtime, model) -> str:
    """What --precision auto means for `model` on the backend's `runtime`: bf16 where the
    runtime and every layer of the model have it (the fastest precision that keeps the fp32
    run's accuracy: README, "Precision"), else the runtime's own matrix precision. Other
    names stay as they are."""
    if precision != "auto":
        return precision
    if "bf16" in runtime.mixed_precisions() and _without_16bit_path(model) is None:
        return "bf16"
    return runtime.precision


def _without_16bit_path(model):
    """(name, kind) of the first layer whose kind is not in LAYERS_16BIT, or None."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not module._modules and kind not in LAYERS_16BIT:  # layers; containers only route
            return name, kind
    return None


def check_model(model, precision: str) -> None:
    """ValueError naming the first layer without a 16-bit path, when `precision` needs one."""
    missing = _without_16bit_path(model) if precision in COMPUTE_DTYPES else None
    if missing is not None:
        name, kind = missing
        where = f"layer {name!r} ({kind})" if name else kind
        raise ValueError(f"--precision {precision}: {where} has no 16-bit path yet "
                         f"(use --precision tf32 or fp32)")


def supports(model_name: str, image_shape=(1, 48, 48)) -> bool:
    """True when model `model_name` has a 16-bit path (every layer in LAYERS_16BIT)."""
    from dptrain.nn import build_model

    return _without_16bit_path(build_model(model_name, image_shape, 10)) is None


class LossScaler:
    """The dynamic loss scale as a device array ``state`` = [scale, good steps, overflows]:
    the non-finite guard (dptrain.run.nonfinite) unscales the gradient by it and updates it
    each step (halved on an overflow, doubled after ``interval`` good steps in a row)."""

    def __init__(self, be, init_scale: float = INIT_SCALE, interval: int = INTERVAL):
        if not init_scale > 0 or interval < 1:
            raise ValueError(f"loss scale must be > 0 and its interval >= 1, got {init_scale} "
                             f"and {interval}")
        self.be, self.interval = be, int(interval)
        self.state = be.asarray(np.array([init_scale, 0, 0], np.float32))
        self.scale = self.state[0:1]
        self.overflows = 0  # host total, updated at reads

    def seed(self) -> Tensor:
        """What the backward starts from: the scale, as a 0-d fp32 tensor."""
        return Tensor(self.scale.reshape(()))

    def read(self, step: int) -> tuple[float, int]:
        """Host side (synchronises): (the scale now, overflows since the last read). Raises
        NonFiniteError once the scale fell below MIN_SCALE."""
        scale, _, overflows = (float(v) for v in self.be.to_numpy(self.state))
        if overflows:
            self.be.fill_(self.state[2:3], 0.0)
        self.overflows += int(overflows)
        if scale < MIN_SCALE:
            raise NonFiniteError(f"fp16 gradients overflowed at every loss scale down to "
                                 f"{scale:g} by step {step}; stopped (the run diverged: try a "
                                 f"lower --lr or --precision tf32)")
        return scale, int(overflows)

    # -- checkpoints: the scale and its good-step count
    def state_dict(self) -> list[float]:
        return [float(v) for v in self.be.to_numpy(self.state)[:2]]

    def load_state_dict(self, values) -> None:
        scale, good = (float(v) for v in values)
        self.be.runtime.upload_(self.state, np.array([scale, good, 0], np.float32))
