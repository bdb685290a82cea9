"""The CUDA backend: launchers of our kernels (kernels/*.cu), one function per name in
``dptrain.backend.OPS``, and ``runtime``, the runtime half of the contract.

Same signatures and results as the CPU backend. CuPy supplies memory (its pool), streams and
NVRTC; every op's arithmetic runs in our kernels. One launcher module per kernel family, each
beside its .cu file and headed by that layer's conventions:

    arrays.py       creation, host transfers, copy_, astype
    attention.py    attention.cu: layer norm, GELU, attention's masked softmax
    elementwise.py  elementwise.cu: maps, broadcasting binaries, activations, fill_
    transpose.py    transpose.cu: copies through strides, getitem, concatenate, broadcast_to
    reduce.py       reduce.cu: sum, max, their gradients, bias_grad, count_correct
    softmax.py      softmax.cu: softmax, log_softmax, cross-entropy
    pool.py         pool.cu: max and average pooling
    optim.py        optim.cu: SGD and AdamW over flat buffers
    data.py         data.cu: gather_normalize, augment_crop_flip, dropout_mask
    gemm.py         gemm.cu, gemm_wgmma.cu: matmul (and the plans conv2d shares)
    conv2d.py       conv2d.cu: implicit-GEMM convolutions
    norm.py         norm.cu: batch normalisation (statistics, forward, running estimates, backward)
    launch.py       the one way to check arguments and launch; loader.py compiles the .cu files
    runtime.py      streams, capture, timing, uploads, precision, RNG state, devices
    nccl.py         the NCCL communicator

Each launcher checks its preconditions, casts scalars to the kernel parameter's type and
launches on the current stream; nothing waits for the device except to_numpy and
host-to-device asarray/copy_, so a training step can be captured as a CUDA graph. Notes on the
design and measurements: NOTES.md beside this file.
"""
from dptrain.backend.cuda.arrays import (  # noqa: F401
    asarray, astype, copy_, empty, full, set_scalar_, to_numpy, zeros,
)
from dptrain.backend.cuda.attention import (  # noqa: F401
    gelu, gelu_backward, layer_norm_backward, layer_norm_forward, masked_softmax,
    masked_softmax_backward,
)
from dptrain.backend.cuda.conv2d import (  # noqa: F401
    conv2d_backward_data, conv2d_backward_weight, conv2d_forward,
)
from dptrain.backend.cuda.data import (  # noqa: F401
    augment_crop_flip, dropout_mask, gather_normalize,
)
from dptrain.backend.cuda.elementwise import (  # noqa: F401
    add, add_, bias_add, div, exp, fill_, log, mul, neg, pow_scalar, pow_scalar_backward, relu,
    relu_backward, scale, sigmoid, sigmoid_backward, sqrt, sub, tanh, tanh_backward,
)
from dptrain.backend.cuda.gemm import matmul, matmul_kernel  # noqa: F401
from dptrain.backend.cuda.guard import (  # noqa: F401
    loss_scale_update_,
    nonfinite_flag_,
    unscale_,
)
from dptrain.backend.cuda.launch import launch_shape  # noqa: F401
from dptrain.backend.cuda.norm import (  # noqa: F401
    batch_norm_backward_data, batch_norm_backward_reduce, batch_norm_forward, batch_norm_mean,
    batch_norm_update_, batch_norm_var,
)
from dptrain.backend.cuda.optim import adamw_step_, sgd_step_  # noqa: F401
from dptrain.backend.cuda.pool import (  # noqa: F401
    avg_pool2d_backward, avg_pool2d_forward, max_pool2d_backward, max_pool2d_forward,
    relu_max_pool2d_forward,
)
from dptrain.backend.cuda.reduce import (  # noqa: F401
    bias_grad, count_correct, max, max_backward, sum, sum_to_shape,
)
from dptrain.backend.cuda.runtime import runtime  # noqa: F401
from dptrain.backend.cuda.softmax import (  # noqa: F401
    cross_entropy_backward, cross_entropy_forward, log_softmax, log_softmax_backward, softmax,
    softmax_backward,
)
from dptrain.backend.cuda.transpose import (  # noqa: F401
    broadcast_to, concatenate, copy, getitem, getitem_backward, transpose,
)

name = "cuda"


def new_workspace():
    """No reusable work between calls here (the convolutions gather in place): None."""
    return None
