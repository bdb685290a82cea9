"""A gradient not yet written: zero but at the pixels a stride reaches.

The backward-data of a strided 1x1 convolution (a ResNet shortcut) is a product at the
pixels the filter read, (s*i - p, t*j - q), with zeros at every other pixel of x's grid: 3/4
of the array at stride 2. ``conv2d_backward_data(..., spread_later=True)`` may hand it back
as a ``Spread`` instead of writing those zeros. An op that reads it where it lies does so
(``batch_norm_backward_reduce_joined``'s ``gb``: the channels-last kernel adds the product at
those pixels, and 0 elsewhere); anything else takes ``total()``, the array the spread would
have stored, with the same bits. Autodiff keeps a Spread apart only as one part of a
gradient that arrives in parts (``dptrain.engine.autograd.GradSum``).
"""
from __future__ import annotations

import functools
import math


class Spread:
    """`dense` (N, Hi, Wi, C) at the pixels (s*i - p, t*j - q) of the channels-last grid
    `grid` (N, H, W, C), zeros elsewhere; `store()` writes that array (grid-shaped), once for
    a Spread and all its reshapes. It reads as an array of `shape` (the grid's, or a reshape
    of it with the same elements)."""

    def __init__(self, dense, grid, stride, padding, store, shape=None):
        self.dense, self.grid = dense, tuple(grid)
        self.stride, self.padding = tuple(stride), tuple(padding)
        self.shape = self.grid if shape is None else tuple(shape)
        self._store = functools.cache(store)  # (a reshape's: cached already, called once)

    @property
    def dtype(self):
        return self.dense.dtype

    @property
    def size(self):
        return math.prod(self.grid)

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if math.prod(shape) != self.size:
            raise ValueError(f"Spread.reshape: {self.shape} has {self.size} elements, "
                             f"{shape} {math.prod(shape)}")
        return Spread(self.dense, self.grid, self.stride, self.padding, self._store, shape)

    def total(self, be=None):
        """The array itself (`be`: GradSum.total's signature; the store knows its device)."""
        return self._store().reshape(self.shape)
