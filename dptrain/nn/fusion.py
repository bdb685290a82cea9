"""Layer fusion inside ``nn.Sequential``: a layer followed by one it has a fused op with runs as
that op (``layer.fused_with(next)`` returns the fused call, or None).

Today ReLU followed by MaxPool2d runs as ``F.relu_max_pool2d``: one pass forward and the
pool's backward alone, with the same values and gradients as the two layers; Linear followed
by ReLU runs as ``F.linear_relu``: the bias and the ReLU in the GEMM's epilogue. The layers
stay in the Sequential as they are, so parameter names, state dicts and the PyTorch twin do
not change. The first layer's forward pre-hooks run before the fused call (the reducer's wait
for a Linear's parameters); a second layer with pre-hooks is never fused (its hooks must run
between the two).

Outside a Sequential a model asks for a fused call itself: ResNet's blocks call
``bn(x, residual=..., relu=True)`` (BatchNorm2d runs relu(bn(x) + residual) in one pass), and
``conv_batch_norm(conv, bn, x)``, where the convolution hands the batch norm its output's
batch statistics (the GPU sums them in the convolution's epilogue); ImageNet's stem passes
its max-pool too, which a channels-last batch norm runs in its own pass (the max-pool of
relu(bn(x)), the batch norm's output never stored).

``DPTRAIN_FUSE=0`` in the environment turns all of it off (to measure what it gives).
"""
from __future__ import annotations

from dptrain import switches


def enabled() -> bool:
    return switches.on("FUSE")


def plan(layers) -> list:
    """The calls that run `layers` in order: each layer itself, or one fused call for a pair."""
    layers, steps, i = list(layers), [], 0
    fuse = enabled()
    while i < len(layers):
        layer = layers[i]
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        fused = None
        if fuse and nxt is not None and not nxt._pre_hooks:
            fused = getattr(layer, "fused_with", lambda _: None)(nxt)
        if fused and layer._pre_hooks:
            fused = _after_hooks(layer, fused)
        steps.append(fused or layer)
        i += 2 if fused else 1
    return steps


def _after_hooks(layer, call):
    """`call` preceded by `layer`'s forward pre-hooks, as calling the layer would run them."""
    def run(x):
        for hook in layer._pre_hooks:
            hook(layer)
        return call(x)
    return run


def conv_batch_norm(conv, bn, x, residual=None, relu=False, pool=None):
    """bn(conv(x), residual=residual, relu=relu), both modules called (their hooks run), then
    `pool` (a MaxPool2d, which the batch norm may run in its own pass: BatchNorm2d.forward).
    In training with per-rank statistics and a bias-free convolution, the convolution also
    returns its output's batch statistics, which the batch norm then uses instead of a pass
    of its own over the activations (the same values to rounding: the GPU sums each tile in
    the convolution's epilogue)."""
    if enabled() and bn.training and bn.comm is None and conv.bias is None:
        y, stats = conv(x, batch_stats=True)
        return bn(y, residual=residual, relu=relu, batch_stats=stats, pool=pool)
    return bn(conv(x), residual=residual, relu=relu, pool=pool)
