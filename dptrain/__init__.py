"""dptrain: data-parallel training of convolutional networks on our own CUDA kernels.

    import dptrain as dp
    import dptrain.functional as F
    x = dp.tensor(array, requires_grad=True)
"""
from dptrain import functional  # noqa: F401  (binds the Tensor operators and methods)
from dptrain.autograd import Tensor, is_grad_enabled, no_grad, tensor
from dptrain.functional import concatenate
from dptrain.random import manual_seed

__version__ = "0.1.0"
__all__ = ["Tensor", "tensor", "no_grad", "is_grad_enabled", "concatenate", "manual_seed"]
