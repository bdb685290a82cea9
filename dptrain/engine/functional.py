"""The functional API (``import dptrain.engine.functional as F``) and the Tensor methods built on it.

Arguments follow PyTorch: NCHW activations, conv weight (C_out, C_in, kH, kW),
linear weight (out, in), y = x W^T + b.
"""
from __future__ import annotations

import contextlib

import numpy as np

from dptrain.engine import losses, ops, transformer_ops
from dptrain.engine.autograd import LaidOut, Tensor, as_tensor
from dptrain.backend.bfloat16 import BFLOAT16
from dptrain.backend.input_layout import InputLayout, as_layout as _as_layout  # noqa: F401 (F.)
from dptrain.errors import BadArgument


def _pair(value, name):
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) for v in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return int(pair[0]), int(pair[1])


def _check_nchw(x: Tensor, op: str):
    if x.ndim != 4:
        raise ValueError(f"{op} expects a 4-D NCHW input, got shape {x.shape}")


# ----------------------------------------------------------------------------- layers


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return _linear(x, w, b)


def linear_relu(x: Tensor, w: Tensor, b: Tensor | None = None, *, workspace=None) -> Tensor:
    """relu(linear(x, w, b)) in one op (what nn.Sequential runs for a Linear then a ReLU)."""
    return _linear(x, w, b, relu=True, workspace=workspace)


def _linear(x, w, b, **params):
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features, weight expects {w.shape[1]}")
    return ops.Linear.apply(*((x, w) if b is None else (x, w, b)), **params)


def conv2d(x: Tensor, w: Tensor, b: Tensor | None = None, stride=1, padding=0, *,
           workspace=None, channels_last=False, batch_stats=False):
    """Convolution; `workspace` (``x.be.new_workspace()``) lets the backend reuse memory and
    work between calls without changing any result (``nn.Conv2d`` keeps one across steps).
    `channels_last`: x and the result are (N, H, W, C) (the weight stays (C_out, C_in, kH,
    kW)), which the GPU's convolution kernels read and write without copies.
    `batch_stats` (b None): returns (y, (mean, var)), the output's per-channel batch mean and
    biased variance as constant arrays for ``batch_norm(y, ..., batch_stats=)``: the GPU sums
    them in the convolution's epilogue, sparing batch norm a pass over y."""
    if batch_stats and b is not None:
        raise ValueError("conv2d: batch_stats needs a bias-free convolution (b=None)")
    _check_nchw(x, "conv2d")
    c = x.shape[3] if channels_last else x.shape[1]
    if c != w.shape[1]:
        raise ValueError(f"conv2d: input has {c} channels, weight expects {w.shape[1]}")
    stride, padding = _pair(stride, "stride"), _pair(padding, "padding")
    args = (x, w) if b is None else (x, w, b)
    stats = [] if batch_stats else None
    y = ops.Conv2d.apply(*args, stride=stride, padding=padding, workspace=workspace,
                         channels_last=bool(channels_last), stats_out=stats)
    return (y, tuple(stats)) if batch_stats else y


def _pool_args(x, kernel_size, stride, padding, op):
    _check_nchw(x, op)
    kernel = _pair(kernel_size, "kernel_size")
    stride = kernel if stride is None else _pair(stride, "stride")
    padding = _pair(padding, "padding")
    if any(p * 2 > k for p, k in zip(padding, kernel)):
        raise ValueError(f"{op}: padding {padding} must be at most half the kernel {kernel}")
    return dict(kernel=kernel, stride=stride, padding=padding)


def max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, *, workspace=None,
               channels_last=False) -> Tensor:
    """Max-pooling; `workspace` and `channels_last` as in conv2d."""
    args = _pool_args(x, kernel_size, stride, padding, "max_pool2d")
    return ops.MaxPool2d.apply(x, **args, workspace=workspace, channels_last=bool(channels_last))


def relu_max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, *, workspace=None,
                    channels_last=False) -> Tensor:
    """max_pool2d(relu(x)) in one op (what nn.Sequential runs for a ReLU then a MaxPool2d)."""
    args = _pool_args(x, kernel_size, stride, padding, "relu_max_pool2d")
    return ops.ReLUMaxPool2d.apply(x, **args, workspace=workspace,
                                   channels_last=bool(channels_last))


def avg_pool2d(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    return ops.AvgPool2d.apply(x, **_pool_args(x, kernel_size, stride, padding, "avg_pool2d"))


def relu(x: Tensor, *, workspace=None) -> Tensor:
    return ops.ReLU.apply(x, workspace=workspace)


def sigmoid(x: Tensor) -> Tensor:
    return ops.Sigmoid.apply(x)


def tanh(x: Tensor) -> Tensor:
    return ops.Tanh.apply(x)


def _on_last_axis(fn, x: Tensor, axis: int) -> Tensor:
    """Apply a last-axis op along `axis` by moving that axis last and back."""
    axis = axis % x.ndim
    if axis == x.ndim - 1:
        return fn.apply(x)
    perm = tuple(i for i in range(x.ndim) if i != axis) + (axis,)
    return transpose(fn.apply(transpose(x, *perm)), *np.argsort(perm))


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    return _on_last_axis(ops.Softmax, x, axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    return _on_last_axis(ops.LogSoftmax, x, axis)


_label_watch: list | None = None  # (labels array, classes) seen, while watching_labels


@contextlib.contextmanager
def watching_labels():
    """Within it, cross_entropy checks its labels' range on the host (a synchronisation: for a
    step's first, eager call) and lists (labels array, classes) in the list it yields."""
    global _label_watch
    outer, _label_watch = _label_watch, []
    try:
        yield _label_watch
    finally:
        _label_watch = outer


def check_labels(labels, classes: int, where: str = "labels") -> None:
    """BadArgument naming the first label of `labels` (host integers) outside [0, classes)."""
    low, high = labels.min(), labels.max()
    if low < 0 or high >= classes:
        bad = int(low) if low < 0 else int(high)
        hint = (" (the model has fewer outputs than the data has classes?)" if bad >= classes
                else "")
        raise BadArgument(f"{where}: label {bad} is out of range for {classes} classes (the "
                          f"model's outputs; class ids run from 0 to {classes - 1}){hint}")


def cross_entropy(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean over the batch of -log softmax(logits)[label]; labels are integer class ids.
    ``label_smoothing`` s in [0, 1): against (1 - s) one-hot + s / C, as PyTorch's. 16-bit
    logits give a float32 loss, computed in float32 (as PyTorch's autocast does), and a
    16-bit gradient."""
    if logits.ndim != 2:
        raise ValueError(f"cross_entropy expects (N, C) logits, got shape {logits.shape}")
    if not isinstance(labels, Tensor):
        labels = Tensor(logits.be.asarray(np.asarray(labels, dtype=np.int64)))
    if labels.dtype.kind not in "iu" or labels.shape != logits.shape[:1]:
        raise BadArgument(
            f"cross_entropy expects integer labels of shape {logits.shape[:1]}, "
            f"got {labels.dtype} {labels.shape}"
            + (" (class ids: convert with .astype(np.int64))" if labels.dtype.kind == "f" else "")
        )
    if _label_watch is not None:
        check_labels(labels.be.to_numpy(labels.data), logits.shape[1])
        _label_watch.append((labels.data, logits.shape[1]))
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1), got "
                         f"{label_smoothing}")
    if label_smoothing:
        if logits.dtype.itemsize < 4:  # composed of float ops: in float32
            logits = cast(logits, np.float32)
        return losses.smoothed_cross_entropy(logits, labels, float(label_smoothing))
    return ops.CrossEntropy.apply(logits, labels)


def count_correct(logits: Tensor, labels: Tensor) -> Tensor:
    """The rows whose arg-max is their label, as a float32 0-d Tensor on the device (no host
    synchronisation, no gradient): a step metric, summed over ranks with reduce="sum"."""
    labels = labels if isinstance(labels, Tensor) else Tensor(logits.be.asarray(labels))
    return Tensor(logits.be.count_correct(logits.data, labels.data))


def accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    """The fraction of rows whose arg-max is their label (count_correct / rows), a 0-d
    Tensor on the device: a step metric, averaged over ranks by default."""
    hits = count_correct(logits, labels)
    return Tensor(logits.be.scale(hits.data, 1.0 / logits.shape[0]))


mse_loss = losses.mse_loss
binary_cross_entropy_with_logits = losses.binary_cross_entropy_with_logits


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    return ops.Dropout.apply(x, p=p)


# ----------------------------------------------------------------------------- tensor algebra


def add(a, b):
    return ops.Add.apply(*_both(a, b))


def sub(a, b):
    return ops.Sub.apply(*_both(a, b))


def mul(a, b):
    return ops.Mul.apply(*_both(a, b))


def div(a, b):
    return ops.Div.apply(*_both(a, b))


def _both(a, b):
    like = a if isinstance(a, Tensor) else b
    return as_tensor(a, like), as_tensor(b, like)


def matmul(a: Tensor, b: Tensor, *, trans_a: bool = False, trans_b: bool = False) -> Tensor:
    """a @ b over the last two axes (either operand transposed first); batch axes broadcast."""
    if trans_a or trans_b:
        return ops.MatMul.apply(a, b, trans_a=trans_a, trans_b=trans_b)
    return ops.MatMul.apply(a, b)


def power(x: Tensor, p) -> Tensor:
    if isinstance(p, Tensor) or not np.isscalar(p):
        raise TypeError("Tensor ** supports a scalar exponent only")
    return ops.PowScalar.apply(x, p=float(p))


def sum(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return ops.Sum.apply(x, axis=_axis(axis), keepdims=keepdims)


def mean(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    return ops.Mean.apply(x, axis=_axis(axis), keepdims=keepdims)


def max(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return ops.Max.apply(x, axis=_axis(axis), keepdims=keepdims)


def _axis(axis):
    return tuple(axis) if isinstance(axis, (list, tuple)) else axis


def reshape(x: Tensor, *shape) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return ops.Reshape.apply(x, shape=tuple(int(s) for s in shape))


def cast(x: Tensor, dtype) -> Tensor:
    """x in float dtype `dtype` (x itself when it has it); the gradient flows back in x's.
    bfloat16 is ``dptrain.backend.bfloat16.BFLOAT16`` (uint16 storage, GPU only)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if not (_is_float(dtype) and _is_float(x.dtype)):
        raise TypeError(f"cast: float to float only, got {x.dtype} to {dtype}")
    if type(x) is LaidOut:  # its layout was chosen for its dtype: write it in the other
        raise TypeError(f"cast: x is laid out for a stem in {x.dtype} (laid_out), the model "
                        f"reads {dtype}: lay the batch out in {dtype} instead")
    return ops.Cast.apply(x, dtype=dtype)


def cast_parameter(p: Tensor, dtype) -> Tensor:
    """cast(p, dtype) for a parameter: the gradient returns in `dtype` and the leaf adds it
    into its own .grad with the cast folded in (one kernel instead of two per parameter).
    A parameter whose 16-bit shadow (kept current by training, dptrain.distributed.flat) has `dtype`
    gives that shadow instead of a fresh cast: the same bits, no kernel."""
    dtype = np.dtype(dtype)
    if p.dtype == dtype or p._ctx is not None or not p.requires_grad:
        return cast(p, dtype)
    if not (_is_float(dtype) and _is_float(p.dtype)):
        raise TypeError(f"cast_parameter: float to float only, got {p.dtype} to {dtype}")
    shadow = getattr(p, "shadow", None)
    if shadow is not None and shadow.dtype != dtype:
        shadow = None
    return ops.CastParameter.apply(p, dtype=dtype, shadow=shadow)


def _is_float(dtype) -> bool:
    return dtype.kind == "f" or dtype == BFLOAT16


def transpose(x: Tensor, *axes) -> Tensor:
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    axes = tuple(int(a) for a in axes) if axes else tuple(reversed(range(x.ndim)))
    return ops.Transpose.apply(x, axes=axes)


def flatten(x: Tensor, start_axis: int = 1) -> Tensor:
    start_axis %= x.ndim
    return reshape(x, *x.shape[:start_axis], -1)


def getitem(x: Tensor, index) -> Tensor:
    if isinstance(index, Tensor):
        index = index.data
    return ops.GetItem.apply(x, index=index)


def concatenate(tensors, axis: int = 0) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("concatenate needs at least one tensor")
    return ops.Concatenate.apply(*tensors, axis=axis)


def pad_zeros(x: Tensor, axis: int, count: int) -> Tensor:
    """x with `count` zeros appended along `axis` (their gradient is dropped)."""
    shape = list(x.shape)
    shape[axis] = count
    return concatenate([x, Tensor(x.be.zeros(tuple(shape), x.dtype))], axis)


# ----------------------------------------------------------------------------- transformer


def broadcast_to(x: Tensor, shape) -> Tensor:
    """x broadcast to `shape` (NumPy's rules), e.g. a class token repeated over the batch."""
    return transformer_ops.BroadcastTo.apply(x, shape=tuple(int(s) for s in shape))


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Layer norm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias."""
    if weight.shape != x.shape[-1:] or bias.shape != x.shape[-1:]:
        raise ValueError(f"layer_norm: weight {weight.shape} and bias {bias.shape} must be "
                         f"({x.shape[-1]},) for input {x.shape}")
    return transformer_ops.LayerNorm.apply(x, weight, bias, eps=float(eps))


def gelu(x: Tensor) -> Tensor:
    """The exact GELU, x * Phi(x) (PyTorch's default, approximate='none')."""
    return transformer_ops.GELU.apply(x)


def _lengths(key_lengths):
    return key_lengths.data if isinstance(key_lengths, Tensor) else key_lengths


def masked_softmax(x: Tensor, causal: bool = False, key_lengths=None,
                   scale: float = 1.0) -> Tensor:
    """softmax(scale * x) over the last axis (keys) of x (B, ..., Tq, Tk); `causal` masks key
    j > query i, `key_lengths` (B,) ints keep keys j < key_lengths[b]. Masked keys get 0; a
    row with no key left is all zeros. Flags, not a mask tensor."""
    return transformer_ops.MaskedSoftmax.apply(x, causal=bool(causal), scale=float(scale),
                                               key_lengths=_lengths(key_lengths))


def _attention_dropout(dropout_p, training) -> float:
    """The dropout probability attention applies: dropout_p in training, else 0."""
    p = float(dropout_p) if training else 0.0
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {dropout_p}")
    return p


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                                 key_lengths=None, scale: float | None = None,
                                 dropout_p: float = 0.0, training: bool = True,
                                 fused: bool = True) -> Tensor:
    """softmax(q k^T * scale, masked) v over the last two axes; q (..., Tq, E), k (..., Tk, E),
    v (..., Tk, Ev); scale defaults to 1/sqrt(E); dropout on the attention weights. With
    `fused`, (B, H, T, E) operands the backend runs as one op (attention_supported) take
    transformer_ops.Attention: the weights never leave the kernel; else matmul,
    masked_softmax, dropout and matmul."""
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"scaled_dot_product_attention: q {q.shape}, k {k.shape} and v "
                         f"{v.shape} do not fit")
    scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else scale
    p = _attention_dropout(dropout_p, training)
    if fused and q.be.attention_supported(q.shape, k.shape, v.shape, q.dtype):
        return transformer_ops.Attention.apply(q, k, v, scale=float(scale),
                                               causal=bool(causal),
                                               key_lengths=_lengths(key_lengths), dropout_p=p)
    weights = masked_softmax(matmul(q, k, trans_b=True), causal, key_lengths, scale)
    return matmul(dropout(weights, dropout_p, training), v)


def self_attention(qkv: Tensor, heads: int, causal: bool = False, key_lengths=None,
                   scale: float | None = None, dropout_p: float = 0.0, training: bool = True,
                   fused: bool = True) -> Tensor:
    """Multi-head self-attention from one packed projection qkv (B, T, 3 * D), laid out
    (B, T, 3, heads, E) as PyTorch's in_proj (queries, keys, values): per head
    scaled_dot_product_attention, the heads' outputs as (B, T, D). With `fused` and a shape the
    backend runs as one op, transformer_ops.SelfAttention reads the heads where they lie in
    qkv and writes the output and qkv's gradient in place: no transpose is copied either
    way."""
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * heads):
        raise ValueError(f"self_attention: expected (batch, tokens, 3 * heads * E) with "
                         f"heads {heads}, got {qkv.shape}")
    b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    e = d // heads
    scale = 1.0 / float(np.sqrt(e)) if scale is None else scale
    p = _attention_dropout(dropout_p, training)
    heads_shape = (b, heads, t, e)
    if fused and qkv.be.attention_supported(heads_shape, heads_shape, heads_shape, qkv.dtype):
        return transformer_ops.SelfAttention.apply(
            qkv, heads=int(heads), scale=float(scale), causal=bool(causal),
            key_lengths=_lengths(key_lengths), dropout_p=p)
    qkv = qkv.reshape(b, t, 3, heads, e).transpose(2, 0, 3, 1, 4)  # (3, B, H, T, E)
    out = scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], causal, key_lengths, scale,
                                       dropout_p, training, fused=False)
    return out.transpose(0, 2, 1, 3).reshape(b, t, d)


# ----------------------------------------------------------------------------- normalisation, global pooling


def batch_norm(x: Tensor, weight: Tensor, bias: Tensor, running=None, training: bool = True,
               momentum: float = 0.1, eps: float = 1e-5, comm=None, residual: Tensor = None,
               relu: bool = False, channels_last: bool = False, batch_stats=None,
               pool=None) -> Tensor:
    """Batch normalisation over axis 1 (the last axis where `channels_last`). ``running``:
    (mean, var, num_batches_tracked) Tensors, updated in place in training and used in eval;
    ``comm``: all-reduce the batch statistics over its ranks (sync-BN). ``residual`` (x's
    shape and dtype) is added and ``relu`` applied in the same pass: relu(bn(x) + residual).
    ``batch_stats``: x's (mean, var) as ``conv2d(..., batch_stats=True)`` returned them,
    used instead of computing them (training with per-rank statistics only). ``pool``
    (kernel, stride, padding; channels-last 4-D x with relu, no residual): the max-pool of
    relu(bn(x)) in the same pass, as max_pool2d(..., channels_last=True) of the result would
    give. See ops.BatchNorm."""
    if batch_stats is not None and (not training or (comm is not None and comm.size > 1)):
        raise ValueError("batch_norm: batch_stats are for training with per-rank statistics "
                         "(not eval, not sync-BN)")
    axis = -1 if channels_last else 1
    if x.ndim < 2 or weight.shape != (x.shape[axis],) or bias.shape != (x.shape[axis],):
        raise ValueError(f"batch_norm: input {x.shape} needs a channel axis {axis} and weight "
                         f"and bias of its size, got {weight.shape}, {bias.shape}")
    if not training and running is None:
        raise ValueError("batch_norm: eval mode needs the running estimates")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"batch_norm: the residual must match the input, {x.dtype} "
                         f"{x.shape}; got {residual.dtype} {residual.shape}")
    if pool is not None:
        if not (channels_last and x.ndim == 4 and relu and residual is None):
            raise ValueError("batch_norm: pool needs channels-last 4-D input, relu and no "
                             "residual")
        pool = (x.shape, *_pool_args(x, *pool, "batch_norm").values())
    shape = x.shape
    if channels_last and x.ndim > 2:  # (..., C) is a batch of rows: the (rows, C) case
        x, residual = (None if t is None else reshape(t, -1, shape[-1]) for t in (x, residual))
    inputs = (x, weight, bias) + (() if residual is None else (residual,))
    arrays = None if running is None else tuple(t.data for t in running)
    y = ops.BatchNorm.apply(*inputs, running=arrays, training=training, momentum=momentum,
                            eps=eps, comm=comm, relu=relu, stats=batch_stats, pool=pool)
    return y if pool is not None or y.shape == shape else reshape(y, shape)


def adaptive_avg_pool2d(x: Tensor, output_size=1, *, channels_last=False) -> Tensor:
    """Global average pooling (output_size 1 only): the mean over H and W, as (N, C, 1, 1),
    or (N, 1, 1, C) for channels-last x (N, H, W, C)."""
    _check_nchw(x, "adaptive_avg_pool2d")
    if _pair(output_size, "output_size") != (1, 1):
        raise ValueError(f"adaptive_avg_pool2d: only output_size 1 is supported, "
                         f"got {output_size!r}")
    return mean(x, axis=(1, 2) if channels_last else (2, 3), keepdims=True)


def to_channels_last(x: Tensor, columns=(0, 0), group: int = 1, channels=None) -> Tensor:
    """NCHW x as (N, H, W, C): a reshape where C is 1 (the same bytes), else a copy. Laid out
    as a convolution's native kernels read it, in the same one pass: `columns` (left, right)
    zero columns around each row, `group` neighbouring columns a pixel (2: pairs, as
    nn.layers.column_pairs runs a stride-2 convolution) and zero channels up to `channels`:
    (N, H, (left + W + right) / group, channels), slot g * C + c of pixel u holding column
    group * u + g - left."""
    _check_nchw(x, "to_channels_last")
    n, c, h, w = x.shape
    left, right = (int(k) for k in columns)
    channels = group * c if channels is None else int(channels)
    if (left, right, group, channels) == (0, 0, 1, c) and c == 1:
        return reshape(x, n, h, w, c)
    if min(left, right) < 0 or group < 1 or (left + w + right) % group or channels < group * c:
        raise ValueError(f"to_channels_last: columns {columns} around {w} in groups of {group} "
                         f"with {channels} channels for {c}: no such layout")
    return ops.ToChannelsLast.apply(x, group=group, left=left, right=right, channels=channels)


def to_channels_first(x: Tensor) -> Tensor:
    """Channels-last x (N, H, W, C) as NCHW (a copy)."""
    _check_nchw(x, "to_channels_first")
    return transpose(x, (0, 3, 1, 2))


def laid_out(x: Tensor, layout) -> Tensor:
    """x, a network's input batch already laid out as to_channels_last(images, layout.columns,
    layout.group, layout.channels) would lay its NCHW images out (a loader's
    ``gather_normalize(..., layout=)``), marked so: the model's first convolution then reads it
    as it is, after checking it reads that layout, and any other op refuses it (LaidOut). The
    layout: an InputLayout or (left, right, group, channels); None gives x itself (NCHW)."""
    if layout is None:
        return x
    layout = _as_layout("laid_out", layout)
    if x.ndim != 4 or x.shape[3] != layout.channels:
        raise ValueError(f"laid_out: x {x.shape} is not (N, H, W', channels) with the "
                         f"{layout.channels} channels of layout {tuple(layout)}")
    if x.requires_grad or x._ctx is not None:
        raise ValueError("laid_out: marks a network's input batch; x requires grad or was "
                         "computed by an op")
    return LaidOut(x.data, layout)


def layout_of(x: Tensor):
    """The InputLayout x is marked laid out in (laid_out), or None for any other tensor."""
    return x.layout if type(x) is LaidOut else None


# ----------------------------------------------------------------------------- Tensor methods

_METHODS = {
    "__add__": add,
    "__radd__": lambda a, b: add(b, a),
    "__sub__": sub,
    "__rsub__": lambda a, b: sub(b, a),
    "__mul__": mul,
    "__rmul__": lambda a, b: mul(b, a),
    "__truediv__": div,
    "__rtruediv__": lambda a, b: div(b, a),
    "__matmul__": matmul,
    "__pow__": power,
    "__neg__": lambda x: ops.Neg.apply(x),
    "__getitem__": getitem,
    "sum": sum,
    "mean": mean,
    "max": max,
    "exp": lambda x: ops.Exp.apply(x),
    "log": lambda x: ops.Log.apply(x),
    "sqrt": lambda x: ops.Sqrt.apply(x),
    "relu": relu,
    "sigmoid": sigmoid,
    "tanh": tanh,
    "reshape": reshape,
    "transpose": transpose,
    "flatten": flatten,
    "T": property(lambda x: transpose(x)),
}
for _name, _fn in _METHODS.items():
    setattr(Tensor, _name, _fn)
