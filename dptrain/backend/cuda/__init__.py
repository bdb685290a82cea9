"""The CUDA backend: launchers of our kernels (kernels/*.cu), one function per op of the
contract (``dptrain.backend.OPS``), each marked ``@op`` where it is defined, and ``runtime``,
the runtime half of the contract.

Same signatures and results as the CPU backend. CuPy supplies memory (its pool), streams and
NVRTC; every op's arithmetic runs in our kernels. One launcher module per kernel family, each
beside its .cu file and headed by that layer's conventions:

    arrays.py       creation, host transfers, copy_, astype
    attention.py    attention.cu: layer norm, GELU, masked softmax, fused attention
    elementwise.py  elementwise.cu: maps, broadcasting binaries, activations, fill_
    transpose.py    transpose.cu: copies through strides, getitem, concatenate, broadcast_to
    reduce.py       reduce.cu: sum, max, their gradients, bias_grad, count_correct
    softmax.py      softmax.cu: softmax, log_softmax, cross-entropy
    pool.py         pool.cu: max and average pooling
    optim.py        optim.cu: SGD and AdamW over flat buffers
    data.py         data.cu: gather_normalize, augment_crop_flip, augment_resized_crop,
                    resize_center_crop, dropout_mask
    gemm.py         gemm.cu, gemm_wgmma.cu, gemm_thin.cu: matmul (and the plans conv2d shares)
    conv/           conv2d*.cu: implicit-GEMM and direct convolutions, one planner per file
    norm.py         norm.cu: batch normalisation (statistics, forward, running estimates, backward)
    guard.py        guard.cu: the non-finite check and fp16 loss scaling
    launch.py       the one way to check arguments and launch; loader.py compiles the .cu files
    runtime.py      streams, capture, timing, uploads, precision, RNG state, devices
    nccl.py         the NCCL communicator

Each launcher checks its preconditions, casts scalars to the kernel parameter's type and
launches on the current stream; nothing waits for the device except to_numpy and
host-to-device asarray/copy_, so a training step can be captured as a CUDA graph. Notes on the
design and measurements: NOTES.md beside this file.
"""
from dptrain.backend import registry as _registry
from dptrain.backend.cuda import (  # noqa: F401  (importing them registers their ops)
    arrays, attention, conv, data, elementwise, gemm, guard, norm, optim, pool, reduce,
    softmax, transpose,
)
from dptrain.backend.cuda.gemm import matmul_kernel  # noqa: F401
from dptrain.backend.cuda.launch import launch_shape  # noqa: F401
from dptrain.backend.cuda.runtime import runtime  # noqa: F401

name = "cuda"
globals().update(_registry.table(name))
