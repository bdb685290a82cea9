"""dptrain: data-parallel training of convolutional networks on our own CUDA kernels.

    import dptrain as dp
    from dptrain import functional as F
    x = dp.tensor(array, requires_grad=True)

The packages, lowest first (each imports only those below it; tests/test_architecture.py
checks):
    backend/      the device, chosen once: NumPy reference or our CUDA kernels, and the runtime
    engine/       Tensor, reverse-mode autodiff, one Function per op, the functional API, RNG
    nn/           Module, layers and models
    dist/         the world, flat parameters, the gradient exchange, launchers, watchdog
    optim/        optimizers over the flat buffers (ZeRO-1 shards), learning-rate schedules
    data/         datasets and formats, cache, stride-sharded sampler, device loader
    checkpoints/  model weights files and exact-resume checkpoints
    run/          one training run: config, loop, step, mixed precision, metrics
    cli/          the commands of `python -m dptrain`
    bench/        benchmarks (imported by no other package)
"""
from dptrain.engine import functional  # binds the Tensor operators and methods
from dptrain.engine.autograd import Tensor, is_grad_enabled, no_grad, tensor
from dptrain.engine.functional import concatenate
from dptrain.engine.rng import manual_seed

__version__ = "0.1.0"
__all__ = ["Tensor", "tensor", "no_grad", "is_grad_enabled", "concatenate", "manual_seed",
           "functional"]
