"""The NumPy backend: the reference every other backend is tested against.

The array ops (one function per name in ``dptrain.backend.OPS``) live in ``ops``, ``conv``
(convolution and pooling) and ``norm`` (batch normalisation); ``workspace`` holds the memory
and work that a caller lets ops reuse between calls (``new_workspace()``); ``runtime`` is
the trivial runtime of a device that is the host itself. No op keeps state of its own
between calls.
"""
from dptrain.backend.cpu.ops import *  # noqa: F401,F403 - the array ops, by name
from dptrain.backend.cpu.ops import name  # noqa: F401
from dptrain.backend.cpu.conv import (  # noqa: F401
    avg_pool2d_backward,
    avg_pool2d_forward,
    conv2d_backward_data,
    conv2d_backward_weight,
    conv2d_forward,
    max_pool2d_backward,
    max_pool2d_forward,
    relu_max_pool2d_forward,
)
from dptrain.backend.cpu.attention import (  # noqa: F401
    gelu,
    gelu_backward,
    layer_norm_backward,
    layer_norm_forward,
    masked_softmax,
    masked_softmax_backward,
)
from dptrain.backend.cpu.norm import (  # noqa: F401
    batch_norm_backward_data,
    batch_norm_backward_reduce,
    batch_norm_forward,
    batch_norm_mean,
    batch_norm_update_,
    batch_norm_var,
)
from dptrain.backend.cpu.workspace import Workspace, new_workspace  # noqa: F401
from dptrain.backend.cpu.runtime import runtime  # noqa: F401
