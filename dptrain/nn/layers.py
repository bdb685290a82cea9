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
    (a channels-last model's first convolution: ResNet's stem), unless it arrives laid out
    already, marked so (F.laid_out; ``input_layout`` says which layout). Any other
    convolution refuses a marked input."""

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
        marked = F.layout_of(x)
        if marked is not None and not self._lays_out_input():
            raise ValueError(f"Conv2d: its input is laid out {tuple(marked)} (F.laid_out), but "
                             f"this convolution reads its input as it comes (only a "
                             f"channels-last one with nchw_input reads a laid-out one)")
        weight, bias = in_dtype_of(x, self.weight, self.bias)
        stride, padding = self.stride, self.padding
        if self.channels_last:
            x, weight, stride, padding = native_layout(x, weight, stride, padding,
                                                       self.nchw_input)
        return F.conv2d(x, weight, bias, stride, padding, workspace=self.workspace(x),
                        channels_last=self.channels_last, batch_stats=batch_stats)

    def input_layout(self, image_shape, dtype, be):
        """The layout (nn.layers.input_layout) this convolution lays its NCHW input of images
        (C, H, W) `image_shape` out in, as `dtype` activations on backend `be`, where it lays
        its input out (channels_last and nchw_input); None where it reads it as it comes."""
        if not self._lays_out_input():
            return None
        if image_shape[0] != self.weight.shape[1]:
            raise ValueError(f"Conv2d.input_layout: images {tuple(image_shape)} for a "
                             f"convolution of {self.weight.shape[1]} input channels")
        return input_layout(be, image_shape[-1], self.weight.shape, self.stride, self.padding,
                            np.dtype(dtype))

    def _lays_out_input(self) -> bool:
        return self.channels_last and self.nchw_input


def native_layout(x, weight, stride, padding, nchw):
    """(x, weight, stride, padding) of the same convolution as the backend's native
    channels-last kernels take it. x is (N, H, W, C), or NCHW where `nchw`, then laid out
    channels-last here in one pass (F.to_channels_last) in the layout input_layout gives,
    or already so laid out and marked (F.laid_out; a ValueError naming both layouts where the
    mark names another). The input and the weight gain the zero channels the backend asks
    (``conv2d_channels_last_pad``: ImageNet's 3-channel stem runs with 8), which change no
    result; x may already carry them. A stride-2 convolution of an NCHW input so padded runs
    over pairs of columns (column_pairs): ResNet-18's step at 3x224x224, batch 128, fp16, 6.72
    -> 6.31 ms on an H200."""
    be, dtype = x.be, x.dtype
    if nchw:
        x, layout = _input_laid_out(x, weight.shape, stride, padding)
        if layout.group == 2:
            weight, stride, padding = paired_weight(weight, stride, padding)
    c, kh, kw = weight.shape[1:]
    pad = be.conv2d_channels_last_pad(c, kh, kw, dtype)
    if not nchw and pad and x.shape[-1] == c:
        x = F.pad_zeros(x, -1, pad)
    return x, F.pad_zeros(weight, 1, pad) if pad else weight, stride, padding


def _input_laid_out(x, weight_shape, stride, padding):
    """(x channels-last, its InputLayout) for a convolution's NCHW input x: laid out here in
    one pass, or as it comes where marked laid out in the layout this convolution reads."""
    marked = F.layout_of(x)
    if marked is None:
        layout = input_layout(x.be, x.shape[-1], weight_shape, stride, padding, x.dtype)
        return F.to_channels_last(x, layout.columns, layout.group, layout.channels), layout
    width = marked.group * x.shape[2] - marked.left - marked.right  # the images' columns
    layout = input_layout(x.be, width, weight_shape, stride, padding, x.dtype)
    if marked != layout:
        raise ValueError(f"Conv2d: its input is laid out {tuple(marked)} (left, right, group, "
                         f"channels; F.laid_out), but this convolution reads {x.dtype} "
                         f"images {width} columns wide laid out {tuple(layout)}")
    return Tensor(x.data), layout  # the mark read: the ops take the array as it is


def input_layout(be, width, weight_shape, stride, padding, dtype) -> F.InputLayout:
    """The layout native_layout lays an NCHW input `width` columns wide out in for a
    convolution of weight_shape (C_out, C, kH, kW), stride and padding, run channels-last in
    `dtype` on backend `be`: zero channels up to what the backend asks
    (``conv2d_channels_last_pad``), and pairs of columns where it pads and the stride is 2 wide
    (column_pairs). A loader that writes its batches so saves the model that pass."""
    c, kh, kw = weight_shape[1:]
    if be.conv2d_channels_last_pad(c, kh, kw, dtype):
        columns = paired_columns(width, kw, stride, padding)
        if columns is not None:
            taps = -(-kw // 2)
            return F.InputLayout(*columns, 2,
                                 2 * c + be.conv2d_channels_last_pad(2 * c, kh, taps, dtype))
    return F.InputLayout(0, 0, 1, c + be.conv2d_channels_last_pad(c, kh, kw, dtype))


def column_pairs(width, weight, stride, padding):
    """The same convolution of an input `width` columns wide over pairs of columns, where its
    horizontal stride is 2: (columns, weight, stride, padding) with the input given
    columns = (L, R) zero columns before and after and laid out in pairs (F.to_channels_last
    with group 2), pair u holding columns 2u - L and 2u + 1 - L; the weight's taps paired
    alike, (C_out, 2C, KH, ceil(KW / 2)) with the missing tap zero; stride (sh, 1), padding
    (ph, (pw - L) / 2). ImageNet's stem (7x7/2 over 3 channels, padded to 8 on the GPU) then
    sums K = 7 * 4 * 8 = 224 products an output where it summed 7 * 7 * 8 = 392. None where
    it would give more output columns."""
    columns = paired_columns(width, weight.shape[3], stride, padding)
    if columns is None:
        return None
    return (columns, *paired_weight(weight, stride, padding))


def paired_columns(width, kw, stride, padding):
    """column_pairs' zero columns (L, R) for an input `width` columns wide and a filter kw
    wide, or None where it runs no pairs (a stride not 2 wide, or more output columns)."""
    (_, sw), (_, pw) = F._pair(stride, "stride"), F._pair(padding, "padding")
    if sw != 2:
        return None
    left = pw % 2  # so that column pairs start on an even padded column
    taps, half = -(-kw // 2), (pw - left) // 2
    short = (width + 2 * pw - kw) // 2 - ((width + left + 1) // 2 + 2 * half - taps)  # outputs
    if short < 0:
        return None
    return left, (width + left) % 2 + 2 * short  # zero columns to even pairs, the last outputs


def paired_weight(weight, stride, padding):
    """column_pairs' (weight, stride, padding): the taps paired, the stride and padding of
    the pairs."""
    (sh, _), (ph, pw) = F._pair(stride, "stride"), F._pair(padding, "padding")
    m, c, kh, kw = weight.shape
    taps, half = -(-kw // 2), (pw - pw % 2) // 2
    if 2 * taps > kw:
        weight = F.pad_zeros(weight, 3, 2 * taps - kw)
    weight = F.transpose(F.reshape(weight, m, c, kh, taps, 2), 0, 4, 1, 2, 3)
    return F.reshape(weight, m, 2 * c, kh, taps), (sh, 1), (ph, half)


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
