"""Batch normalisation layers (PyTorch's names, defaults and state_dict entries)."""
from __future__ import annotations

import numpy as np

from dptrain.engine import functional as F
from dptrain.engine.autograd import Tensor
from dptrain.nn import fusion
from dptrain.nn.module import Module, Parameter


class BatchNorm2d(Module):
    """Normalise each channel of NCHW input: batch statistics in training (updating the
    running estimates on the device), the running estimates in eval. A 16-bit input (mixed
    precision) keeps fp32 statistics, parameters and arithmetic; its output is 16-bit.

    Parameters ``weight`` (ones) and ``bias`` (zeros); buffers ``running_mean`` (zeros),
    ``running_var`` (ones) and ``num_batches_tracked`` (int64), as torch.nn.BatchNorm2d.
    ``comm``: None for per-rank statistics; a communicator (``sync_batch_norm``) makes the
    statistics those of all its ranks' batches (sync-BN). ``channels_last`` (an attribute,
    False by default; see nn.Conv2d): the input is (N, H, W, C)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm2d: momentum must be in [0, 1], got {momentum}")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter(np.ones(num_features, np.float32))
        self.bias = Parameter(np.zeros(num_features, np.float32))
        self.register_buffer("running_mean", Tensor(np.zeros(num_features, np.float32)))
        self.register_buffer("running_var", Tensor(np.ones(num_features, np.float32)))
        self.register_buffer("num_batches_tracked", Tensor(np.zeros((), np.int64)))
        self.comm = None
        self.channels_last = False

    def forward(self, x, residual=None, relu=False, batch_stats=None, pool=None):
        """bn(x); with ``residual`` and ``relu``, relu(bn(x) + residual): the layers that
        follow a batch norm in a residual block, in the same pass (nn.fusion; separate ops
        when ``DPTRAIN_FUSE=0``). ``batch_stats``: x's batch statistics from the convolution
        that made it (nn.fusion.conv_batch_norm). ``pool``: a MaxPool2d after relu(bn(x)),
        run in the same pass where it may (channels-last, no residual, no pre-hooks of its
        own), else called after."""
        if x.ndim != 4:
            raise ValueError(f"BatchNorm2d expects 4-D input, got shape {x.shape}")
        running = (self.running_mean, self.running_var, self.num_batches_tracked)
        fused = fusion.enabled()
        joined = (fused and pool is not None and relu and residual is None
                  and self.channels_last and pool.channels_last and not pool._pre_hooks)
        y = F.batch_norm(x, self.weight, self.bias, running, self.training, self.momentum,
                         self.eps, comm=self.comm, residual=residual if fused else None,
                         relu=relu and fused, channels_last=self.channels_last,
                         batch_stats=batch_stats, pool=pool.args if joined else None)
        if not fused:
            y = y if residual is None else y + residual
            y = F.relu(y) if relu else y
        return y if pool is None or joined else pool(y)


class BatchNorm1d(BatchNorm2d):
    """Normalise each feature of (N, C) input, or each channel of (N, C, L), as
    torch.nn.BatchNorm1d (the same parameters, buffers and defaults). It runs BatchNorm2d's
    kernels on the input viewed as (N, C, 1, 1) or (N, C, L, 1): per channel the statistics
    are over the same N or N*L values, so the view is exact. Sync-BN makes it sync too."""

    def forward(self, x):
        if x.ndim not in (2, 3):
            raise ValueError(f"BatchNorm1d expects (N, C) or (N, C, L) input, got shape "
                             f"{x.shape}")
        if x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm1d({self.num_features}) got {x.shape[1]} features "
                             f"(input shape {x.shape})")
        shape = x.shape
        y = super().forward(F.reshape(x, *shape[:2], shape[2] if x.ndim == 3 else 1, 1))
        return F.reshape(y, *shape)


def sync_batch_norm(model: Module, comm) -> int:
    """Make every BatchNorm2d (and BatchNorm1d) of `model` all-reduce its batch statistics
    over `comm`'s ranks (inside the step, on the current stream); returns how many layers it
    changed."""
    layers = [m for m in model.modules() if isinstance(m, BatchNorm2d)]
    for layer in layers:
        layer.comm = comm
    return len(layers)
