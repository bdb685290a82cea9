"""ResNet-18, -34 and -50 with torchvision's module names and weight layouts, so weights move
both ways.

``resnet18`` (basic blocks [2, 2, 2, 2]), ``resnet34`` (basic blocks [3, 4, 6, 3]) and
``resnet50`` (bottleneck blocks [3, 4, 6, 3], torchvision's v1.5: the stride on the 3x3),
each ``(image_shape, num_classes)``. Stages of 64-128-256-512 channels (times 4 at the
bottlenecks' outputs); each stage after the first halves the resolution with a stride-2
convolution and a 1x1 stride-2 projection shortcut (conv + BN, torchvision's
``downsample.0`` / ``.1``), as does the first bottleneck stage's widening at stride 1.
Stem: for images up to 64 px a 3x3 stride-1 convolution without max-pool (the CIFAR-style
small-image stem); above, ImageNet's 7x7 stride-2 convolution and 3x3 stride-2 max-pool.
The state_dict names are torchvision's (``conv1.weight``, ``bn1.running_mean``,
``layer1.0.conv1.weight``, ..., ``layer2.0.downsample.0.weight``, ``fc.weight``); only
``conv1``'s shape depends on the stem and the input channels.

Activations are channels-last inside where the backend's convolutions read and write that
layout as it lies (``channels_last="auto"``, the default: the GPU's wgmma kernels, 16-bit,
TF32 or fp32 as 3xTF32, as PyTorch's ``memory_format=torch.channels_last``): the stem's
convolution lays the NCHW input out (N, H, W, C) in one pass, every convolution, batch norm
and pooling works on that layout, and the global pooling hands (N, C) features to ``fc``.
Elsewhere (the CPU, GPUs without wgmma) a channels-last convolution would copy its
activations to NCHW and back, so "auto" keeps NCHW, decided at each forward from the input's
dtype and the backend (``conv2d_channels_last_native``). ``True`` or ``False`` fixes the
layout. Weights, state_dict and results (to rounding) are those of the NCHW network either
way. Where it runs channels-last, ``input_layout(image_shape, dtype, be)`` names the stem's
layout of its input, so a loader may write its batches so in the pass that normalises them
and mark them (``F.laid_out``); the stem then skips its own pass (the same bits).
"""
from __future__ import annotations

import math

import numpy as np

from dptrain.engine import functional as F
from dptrain.nn.fusion import conv_batch_norm
from dptrain.nn.layers import Conv2d, Linear, MaxPool2d, Sequential
from dptrain.nn.module import Module, Parameter
from dptrain.nn.norm import BatchNorm2d
from dptrain.nn.pooling import AdaptiveAvgPool2d
from dptrain.engine.rng import init_rng

SMALL_IMAGE_MAX = 64  # inputs up to this many pixels a side get the 3x3 stem, no max-pool


def _conv(in_channels, out_channels, kernel, stride=1, padding=0):
    """A bias-free convolution with torchvision's ResNet init: kaiming normal, fan_out, ReLU."""
    conv = Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding, bias=False)
    std = math.sqrt(2.0 / (out_channels * kernel * kernel))
    conv.weight = Parameter((init_rng().standard_normal(conv.weight.shape) * std)
                            .astype(np.float32))
    return conv


class _Block(Module):
    """What both blocks share: a chain of convolution + batch norm pairs (``conv1``/``bn1``,
    ``conv2``/``bn2``, ...) with a ReLU after each, the last adding the shortcut before its
    ReLU: x itself, or ``downsample`` (1x1 conv + BN) where the stride or the channel count
    changes. The ReLUs and the addition run inside the batch norms' passes (BatchNorm2d's
    ``residual`` and ``relu``), so a block has no ReLU module of its own. A subclass builds
    its pairs, then calls ``_shortcut``."""

    expansion = 1  # the block's output channels over its `channels`
    depth = 2  # convolution + batch norm pairs

    def _shortcut(self, in_channels, out_channels, stride):
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = Sequential(_conv(in_channels, out_channels, 1, stride),
                                         BatchNorm2d(out_channels))

    def forward(self, x):
        # each convolution hands its batch norm the batch statistics (nn.fusion)
        out = conv_batch_norm(self.conv1, self.bn1, x, relu=True)  # relu(bn1(.)) in one pass
        shortcut = x if self.downsample is None else conv_batch_norm(*self.downsample, x)
        for i in range(2, self.depth):
            out = conv_batch_norm(getattr(self, f"conv{i}"), getattr(self, f"bn{i}"), out,
                                  relu=True)
        last = self.depth
        # relu(bn(.) + shortcut) in one pass: the addition's gradient reaches both paths
        return conv_batch_norm(getattr(self, f"conv{last}"), getattr(self, f"bn{last}"), out,
                               residual=shortcut, relu=True)


class BasicBlock(_Block):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)): two 3x3 convolutions, the first
    with the block's stride (torchvision's BasicBlock)."""

    def __init__(self, in_channels, channels, stride=1):
        super().__init__()
        self.conv1 = _conv(in_channels, channels, 3, stride, 1)
        self.bn1 = BatchNorm2d(channels)
        self.conv2 = _conv(channels, channels, 3, 1, 1)
        self.bn2 = BatchNorm2d(channels)
        self._shortcut(in_channels, channels, stride)


class Bottleneck(_Block):
    """relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x)): 1x1 down to
    `channels`, 3x3 with the block's stride (torchvision's v1.5 layout: the stride on the
    3x3, not the first 1x1), 1x1 up to 4 x `channels`."""

    expansion = 4
    depth = 3

    def __init__(self, in_channels, channels, stride=1):
        super().__init__()
        out = channels * self.expansion
        self.conv1 = _conv(in_channels, channels, 1)
        self.bn1 = BatchNorm2d(channels)
        self.conv2 = _conv(channels, channels, 3, stride, 1)
        self.bn2 = BatchNorm2d(channels)
        self.conv3 = _conv(channels, out, 1)
        self.bn3 = BatchNorm2d(out)
        self._shortcut(in_channels, out, stride)


class ResNet(Module):
    """The stem, stages ``layer1``.. of `block` (their counts in `blocks`, their widths in
    `widths`; a stage's output is width x ``block.expansion`` channels), global average pool
    and ``fc``. `name` is the builder's, for errors."""

    def __init__(self, image_shape, num_classes, blocks=(2, 2, 2, 2),
                 widths=(64, 128, 256, 512), channels_last="auto", block=BasicBlock,
                 name="resnet18"):
        super().__init__()
        if channels_last not in (True, False, "auto"):
            raise ValueError(f"{name}: channels_last must be True, False or 'auto', got "
                             f"{channels_last!r}")
        channels, height, width = image_shape
        self.small_stem = max(height, width) <= SMALL_IMAGE_MAX
        if self.small_stem:
            self.conv1 = _conv(channels, widths[0], 3, 1, 1)
        else:
            self.conv1 = _conv(channels, widths[0], 7, 2, 3)
        self.conv1.nchw_input = True  # the stem lays the input out channels-last itself
        self.bn1 = BatchNorm2d(widths[0])
        self.maxpool = None if self.small_stem else MaxPool2d(3, 2, 1)
        in_channels = widths[0]
        for stage, (count, width) in enumerate(zip(blocks, widths)):
            stride = 1 if stage == 0 else 2
            out = width * block.expansion
            layers = [block(in_channels, width, stride)]
            layers += [block(out, width) for _ in range(count - 1)]
            setattr(self, f"layer{stage + 1}", Sequential(*layers))
            in_channels = out
        self.block, self.blocks = block, tuple(blocks)  # the layout, for the PyTorch twin
        self.avgpool = AdaptiveAvgPool2d(1)
        self.fc = Linear(in_channels, num_classes)
        self.channels_last = channels_last

    def layout(self, x) -> bool:
        """Whether this forward of x runs channels-last (see the module docstring)."""
        return self.runs_channels_last(x.be, x.dtype)

    def runs_channels_last(self, be, dtype) -> bool:
        """Whether a forward of `dtype` activations on backend `be` runs channels-last."""
        if self.channels_last == "auto":
            return bool(be.conv2d_channels_last_native(np.dtype(dtype)))
        return self.channels_last

    def input_layout(self, image_shape, dtype, be):
        """The stem's layout of its NCHW input (Conv2d.input_layout) where a forward of
        `dtype` activations on `be` runs channels-last, else None. Sets the layers' layout as
        that forward does."""
        self._set_channels_last(self.runs_channels_last(be, dtype))
        return self.conv1.input_layout(image_shape, dtype, be)

    def forward(self, x):
        self._set_channels_last(self.layout(x))
        x = conv_batch_norm(self.conv1, self.bn1, x, relu=True, pool=self.maxpool)
        for stage in range(len(self.blocks)):
            x = getattr(self, f"layer{stage + 1}")(x)
        return self.fc(F.flatten(self.avgpool(x), 1))

    def _set_channels_last(self, cl: bool):
        for m in self.modules():  # the spatial layers (fc sees the pooled (N, C) alike)
            if isinstance(m, (Conv2d, BatchNorm2d, MaxPool2d, AdaptiveAvgPool2d)):
                m.channels_last = cl


def _build(name, block, blocks, image_shape, num_classes, widths, channels_last):
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise ValueError(f"{name}: image shape must be (C, H, W), got {tuple(image_shape)}")
    return ResNet(tuple(int(v) for v in image_shape), num_classes, blocks, tuple(widths),
                  channels_last, block, name)


def resnet18(image_shape=(3, 32, 32), num_classes=10, widths=(64, 128, 256, 512),
             channels_last="auto"):
    """ResNet-18 (torchvision's names and layouts): basic blocks [2, 2, 2, 2]; `widths`
    other than the default are for quick tests only; ``channels_last``: "auto"
    (channels-last activations where the backend's convolutions run them without copies),
    True or False."""
    return _build("resnet18", BasicBlock, (2, 2, 2, 2), image_shape, num_classes, widths,
                  channels_last)


def resnet34(image_shape=(3, 32, 32), num_classes=10, widths=(64, 128, 256, 512),
             channels_last="auto"):
    """ResNet-34 (torchvision's names and layouts): basic blocks [3, 4, 6, 3]; options as
    resnet18's."""
    return _build("resnet34", BasicBlock, (3, 4, 6, 3), image_shape, num_classes, widths,
                  channels_last)


def resnet50(image_shape=(3, 32, 32), num_classes=10, widths=(64, 128, 256, 512),
             channels_last="auto"):
    """ResNet-50 (torchvision's names and layouts, v1.5: the stride on the bottleneck's 3x3):
    bottleneck blocks [3, 4, 6, 3] of 256-512-1024-2048 output channels; options as
    resnet18's (`widths` are the bottlenecks' inner widths)."""
    return _build("resnet50", Bottleneck, (3, 4, 6, 3), image_shape, num_classes, widths,
                  channels_last)
