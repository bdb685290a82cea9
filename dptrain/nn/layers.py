"""Layers with PyTorch's shapes, names and default initialisation."""
from __future__ import annotations

import math

import numpy as np

from dptrain.engine import functional as F
from dptrain.engine.autograd import Tensor
from dptrain.engine.rng import init_rng
from dptrain.nn import fusion
from dptrain.nn.module import Module, Parameter


def _uniform(shape, bound):
    return init_rng().uniform(-bound, bound, size=shape).astype(np.float32)


def _init_weight_and_bias(module, weight_shape, fan_in, bias):
    # PyTorch's default: kaiming_uniform(a=sqrt(5)) gives a bound of 1/sqrt(fan_in),
    # and the bias is uniform in the same range.
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    module.weight = Parameter(_uniform(weight_shape, bound))
    module.bias = Parameter(_uniform((weight_shape[0],), bound)) if bias else None


def in_dtype_of(x, *params):
    """The parameters in the dtype of 16-bit activations x (mixed precision: the layer computes
    in 16 bits while the parameters, their gradients and the optimizer stay fp32); as they are
    for any other x."""
    if x.dtype.itemsize != 2:
        return params
    return tuple(None if p is None else F.cast_parameter(p, x.dtype) for p in params)


class _Workspace:
    """A layer's workspace (``be.new_workspace()``) for the backend of its inputs, made on
    first use and kept across steps, so the backend's scratch memory outlives each call."""

    def __init__(self):
        self.be = self.workspace = None

    def __call__(self, x):
        if x.be is not self.be:
            self.be, self.workspace = x.be, x.be.new_workspace()
        return self.workspace


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        _init_weight_and_bias(self, (out_features, in_features), in_features, bias)

    def forward(self, x):
        return F.linear(x, *in_dtype_of(x, self.weight, self.bias))

    def fused_with(self, following):
        """Linear then ReLU as one op (nn.fusion), or None for any other layer."""
        if type(following) is not ReLU:
            return None
        return lambda x: F.linear_relu(x, *in_dtype_of(x, self.weight, self.bias),
                                       workspace=following.workspace(x))


class Conv2d(Module):
    """torch.nn.Conv2d's parameters and layouts. ``channels_last`` (an attribute, False by
    default; a model whose activations are channels-last throughout sets it, as ResNet
    does): the input and output are (N, H, W, C), the weight is (C_out, C_in, kH, kW) all
    the same. ``nchw_input`` (with it; False by default): the input still arrives NCHW and
    is laid out here, in the one pass that also adds what the backend's native kernels ask
    (a channels-last model's first convolution: ResNet's stem)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True):
        super().__init__()
        kh, kw = F._pair(kernel_size, "kernel_size")
        self.stride, self.padding = stride, padding
        _init_weight_and_bias(
            self, (out_channels, in_channels, kh, kw), in_channels * kh * kw, bias
        )
        self.workspace = _Workspace()
        self.channels_last = self.nchw_input = False

    def forward(self, x, batch_stats=False):
        """conv(x); with `batch_stats` (no bias), (conv(x), its batch statistics): see
        F.conv2d and nn.fusion.conv_batch_norm."""
        weight, bias = in_dtype_of(x, self.weight, self.bias)
        stride, padding = self.stride, self.padding
        if self.channels_last:
            x, weight, stride, padding = native_layout(x, weight, stride, padding,
                                                       self.nchw_input)
        return F.conv2d(x, weight, bias, stride, padding, workspace=self.workspace(x),
                        channels_last=self.channels_last, batch_stats=batch_stats)


def native_layout(x, weight, stride, padding, nchw):
    """(x, weight, stride, padding) of the same convolution as the backend's native
    channels-last kernels take it. x is (N, H, W, C), or NCHW where `nchw`, then laid out
    channels-last here in one pass (F.to_channels_last). The input and the weight gain the
    zero channels the backend asks (``conv2d_channels_last_pad``: ImageNet's 3-channel stem
    runs with 8), which change no result; x may already carry them. A stride-2 convolution
    of an NCHW input so padded runs over pairs of columns (column_pairs): ResNet-18's step at
    3x224x224, batch 128, fp16, 6.72 -> 6.31 ms on an H200."""
    be, dtype = x.be, x.dtype
    columns, group = (0, 0), 1
    if nchw and be.conv2d_channels_last_pad(*weight.shape[1:], dtype):
        pairs = column_pairs(x.shape[-1], weight, stride, padding)
        if pairs is not None:
            (columns, weight, stride, padding), group = pairs, 2
    c, kh, kw = weight.shape[1:]
    pad = be.conv2d_channels_last_pad(c, kh, kw, dtype)
    if nchw:
        x = F.to_channels_last(x, columns, group, c + pad)
    elif pad and x.shape[-1] == c:
        x = F.pad_zeros(x, -1, pad)
    return x, F.pad_zeros(weight, 1, pad) if pad else weight, stride, padding


def column_pairs(width, weight, stride, padding):
    """The same convolution of an input `width` columns wide over pairs of columns, where its
    horizontal stride is 2: (columns, weight, stride, padding) with the input given
    columns = (L, R) zero columns before and after and laid out in pairs (F.to_channels_last
    with group 2), pair u holding columns 2u - L and 2u + 1 - L; the weight's taps paired
    alike, (C_out, 2C, KH, ceil(KW / 2)) with the missing tap zero; stride (sh, 1), padding
    (ph, (pw - L) / 2). ImageNet's stem (7x7/2 over 3 channels, padded to 8 on the GPU) then
    sums K = 7 * 4 * 8 = 224 products an output where it summed 7 * 7 * 8 = 392. None where
    it would give more output columns."""
    (sh, sw), (ph, pw) = F._pair(stride, "stride"), F._pair(padding, "padding")
    m, c, kh, kw = weight.shape
    if sw != 2:
        return None
    left = pw % 2  # so that column pairs start on an even padded column
    taps, half = -(-kw // 2), (pw - left) // 2
    short = (width + 2 * pw - kw) // 2 - ((width + left + 1) // 2 + 2 * half - taps)  # outputs
    if short < 0:
        return None
    right = (width + left) % 2 + 2 * short  # zero columns to even pairs, and the last outputs
    if 2 * taps > kw:
        weight = F.pad_zeros(weight, 3, 2 * taps - kw)
    weight = F.transpose(F.reshape(weight, m, c, kh, taps, 2), 0, 4, 1, 2, 3)
    return (left, right), F.reshape(weight, m, 2 * c, kh, taps), (sh, 1), (ph, half)


class MaxPool2d(Module):
    """Max-pooling; ``channels_last`` as in Conv2d."""

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.args = (kernel_size, stride, padding)
        self.workspace = _Workspace()
        self.channels_last = False

    def forward(self, x):
        return F.max_pool2d(x, *self.args, workspace=self.workspace(x),
                            channels_last=self.channels_last)


class AvgPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.args = (kernel_size, stride, padding)

    def forward(self, x):
        return F.avg_pool2d(x, *self.args)


class ReLU(Module):
    def __init__(self):
        super().__init__()
        self.workspace = _Workspace()

    def forward(self, x):
        return F.relu(x, workspace=self.workspace(x))

    def fused_with(self, following):
        """ReLU then max-pooling as one op (nn.fusion), or None for any other layer."""
        if type(following) is not MaxPool2d:
            return None
        return lambda x: F.relu_max_pool2d(x, *following.args,
                                           workspace=following.workspace(x),
                                           channels_last=following.channels_last)


class Identity(Module):
    """Returns its input; any constructor arguments are ignored (as PyTorch's)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x


class Sigmoid(Module):
    def forward(self, x):
        return F.sigmoid(x)


class Tanh(Module):
    def forward(self, x):
        return F.tanh(x)


class Flatten(Module):
    def __init__(self, start_axis: int = 1):
        super().__init__()
        self.start_axis = start_axis

    def forward(self, x):
        return F.flatten(x, self.start_axis)


class Dropout(Module):
    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)


class Sequential(Module):
    """Layers applied in order; named "0", "1", ... as in PyTorch."""

    def __init__(self, *layers):
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self):
        return len(self._modules)

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def forward(self, x):
        for step in self._steps():
            x = step(x)
        return x

    def _steps(self):
        """The layers as nn.fusion plans them, kept until the layers or the switch change."""
        key = (tuple(map(id, self._modules.values())), fusion.enabled(),
               tuple(len(m._pre_hooks) for m in self._modules.values()))
        if getattr(self, "_plan_key", None) != key:
            object.__setattr__(self, "_plan", fusion.plan(self._modules.values()))
            object.__setattr__(self, "_plan_key", key)
        return self._plan
