"""The layout of a network's input as its stem convolution reads it channels-last.

An NCHW batch (N, C, H, W) laid out as ``to_channels_last`` lays it out: ``left`` and
``right`` zero columns around each row, ``group`` neighbouring columns a pixel (2: pairs, for
a stride-2 convolution run over them) and zero channels up to ``channels``; the result is
(N, H, (left + W + right) / group, channels). One value names it for every party that must
agree on it: the backends' ``gather_normalize(..., layout=)``, which writes it from uint8
images in one pass, the loader that asks for it, the model that says which one it reads
(``Module.input_layout``) and the mark on the input Tensor (``F.laid_out``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class InputLayout(NamedTuple):
    """to_channels_last's arguments: zero columns before and after each row, columns a
    pixel, channels a pixel."""

    left: int
    right: int
    group: int
    channels: int

    @property
    def columns(self) -> tuple:
        return (self.left, self.right)


def as_layout(where: str, layout) -> InputLayout:
    """`layout` (4 integers: left, right, group, channels) as an InputLayout; a ValueError
    naming `where` otherwise."""
    values = tuple(layout) if isinstance(layout, (tuple, list)) else ()
    if len(values) != 4 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                   for v in values):
        raise ValueError(f"{where}: layout must be 4 integers (left, right, group, channels), "
                         f"got {layout!r}")
    return InputLayout(*map(int, values))


def checked(where: str, layout, image_shape) -> InputLayout:
    """as_layout(where, layout), where it lays out images (C, H, W) of `image_shape`; a
    ValueError naming `where` and the layout otherwise."""
    layout = as_layout(where, layout)
    if len(image_shape) != 3:
        raise ValueError(f"{where}: layout {tuple(layout)} needs images (C, H, W), got "
                         f"{tuple(image_shape)}")
    c, _, w = image_shape
    left, right, group, channels = layout
    if min(left, right) < 0 or group < 1 or (left + w + right) % group or channels < group * c:
        raise ValueError(f"{where}: layout {tuple(layout)} (left, right, group, channels) does "
                         f"not lay out {'x'.join(map(str, image_shape))} images: columns >= 0, "
                         f"left + {w} + right in whole groups, channels >= group * {c}")
    return layout
