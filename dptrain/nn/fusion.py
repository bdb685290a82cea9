"""Layer fusion inside ``nn.Sequential``: a layer followed by one it has a fused op with runs as
that op (``layer.fused_with(next)`` returns the fused call, or None).

Today ReLU followed by MaxPool2d runs as ``F.relu_max_pool2d``: one pass forward and the
pool's backward alone, with the same values and gradients as the two layers. The layers stay
in the Sequential as they are, so parameter names, state dicts and the PyTorch twin do not
change. A layer with forward pre-hooks is never fused (its hook must run on its own input).

Outside a Sequential a model asks for a fused call itself: ResNet's blocks call
``bn(x, residual=..., relu=True)`` (BatchNorm2d runs relu(bn(x) + residual) in one pass).

``DPTRAIN_FUSE=0`` in the environment turns all of it off (to measure what it gives).
"""
from __future__ import annotations

import os

FUSE_ENV = "DPTRAIN_FUSE"


def enabled() -> bool:
    return os.environ.get(FUSE_ENV, "1") != "0"


def plan(layers) -> list:
    """The calls that run `layers` in order: each layer itself, or one fused call for a pair."""
    layers, steps, i = list(layers), [], 0
    fuse = enabled()
    while i < len(layers):
        layer = layers[i]
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        fused = None
        if fuse and nxt is not None and not layer._pre_hooks and not nxt._pre_hooks:
            fused = getattr(layer, "fused_with", lambda _: None)(nxt)
        steps.append(fused or layer)
        i += 2 if fused else 1
    return steps
