"""dptrain: data-parallel training of convolutional networks on our own CUDA kernels.

    import dptrain as dp
    from dptrain import functional as F
    x = dp.tensor(array, requires_grad=True)

    world = dp.dist.init()                            # data parallel: see dp.DataParallel
    ddp = dp.DataParallel(model, "adamw", lr=1e-3)
    step = ddp.compile(lambda batch: F.mse_loss(ddp(batch[0]), batch[1]))

The packages, lowest first (each imports only those below it; tests/test_architecture.py
checks):
    backend/      the device, chosen once: NumPy reference or our CUDA kernels, and the runtime
    engine/       Tensor, reverse-mode autodiff, one Function per op, the functional API, RNG
    nn/           Module, layers and models
    distributed/  the world, flat parameters, the gradient exchange, launchers, watchdog
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
           "functional", "DataParallel", "ArrayDataset", "launch"]

# The packages a script uses, loaded on first use (``import dptrain`` stays light).
_SUBPACKAGES = ("backend", "nn", "distributed", "optim", "data", "checkpoints", "run")


def __getattr__(name):
    if name == "DataParallel":
        from dptrain.run.parallel import DataParallel

        return DataParallel
    if name == "launch":
        from dptrain.run.script import launch

        return launch
    if name == "ArrayDataset":
        from dptrain.data.arrays import ArrayDataset

        return ArrayDataset
    if name in _SUBPACKAGES or name == "dist":  # dp.dist: distributed, as torch's dist
        import importlib

        return importlib.import_module(f"dptrain.{'distributed' if name == 'dist' else name}")
    raise AttributeError(f"module 'dptrain' has no attribute {name!r}")
