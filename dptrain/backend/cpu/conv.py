"""Convolution and pooling on the CPU: im2col and GEMMs, col2im, strided max and average.

The ops that take ``workspace=`` (see ``workspace.py``) draw their large temporaries from it
when one is given, and a convolution's forward leaves its im2col columns there for the
weight gradient of the same input. Results never alias workspace memory. Why each piece is
shaped the way it is, with measurements, is in NOTES.md.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from dptrain.backend.cpu.ops import _gemm, add
from dptrain.backend.cpu.precision import fp32_math
from dptrain.backend.cpu.workspace import checked, scratch
from dptrain.backend.registry import op

# ----------------------------------------------------------------------------- convolution


def _out_size(n, k, s, p):
    return (n + 2 * p - k) // s + 1


def _windows(x, kh, kw, stride, padding, pad_value=0.0):
    """View of shape (N, C, Ho, Wo, kh, kw): the receptive field of each output pixel."""
    (sh, sw), (ph, pw) = stride, padding
    if ph or pw:
        n, c, h, w = x.shape
        xp = np.full((n, c, h + 2 * ph, w + 2 * pw), pad_value, dtype=x.dtype)  # np.pad is slower
        xp[:, :, ph : ph + h, pw : pw + w] = x
        x = xp
    ho = (x.shape[2] - kh) // sh + 1
    wo = (x.shape[3] - kw) // sw + 1
    win = sliding_window_view(x, (kh, kw), axis=(2, 3))
    return win[:, :, : (ho - 1) * sh + 1 : sh, : (wo - 1) * sw + 1 : sw]


def _offsets(kh, kw, sh, sw, ho, wo):
    """Slices that pick, for kernel offset (i, j), that element of every window."""
    for i in range(kh):
        for j in range(kw):
            yield i, j, (slice(i, i + (ho - 1) * sh + 1, sh), slice(j, j + (wo - 1) * sw + 1, sw))


def _im2col(x, kh, kw, stride, padding, workspace, name):
    """x's receptive fields as a (C*kh*kw, N*Ho*Wo) matrix, one column per output pixel, in
    the workspace's scratch array `name` (or a fresh array); returns it and (Ho, Wo)."""
    win = _windows(x, kh, kw, stride, padding)
    n, c, ho, wo = win.shape[:4]
    out = scratch(workspace, name, (c * kh * kw, n * ho * wo), x.dtype)
    np.copyto(out.reshape(c, kh, kw, n, ho, wo), win.transpose(1, 4, 5, 0, 2, 3))
    return out, (ho, wo)


def _cols_key(kh, kw, stride, padding):
    """What, besides the input itself, an im2col matrix depends on."""
    return kh, kw, tuple(stride), tuple(padding)


# Below this many im2col rows (C_in*kh*kw) a conv GEMM is bound by writing its output, so it
# runs as one GEMM per image, whose output is NCHW already. Above it one large GEMM is faster
# (and hands work to OpenBLAS's threads once, not N times), even with the transposing copy
# its (C_out, N*Ho*Wo) output needs.
_PER_IMAGE_K = 64


def _per_image(cols, n):
    """(N, K, Ho*Wo) strided view of the (K, N*Ho*Wo) im2col matrix: one matrix per image."""
    return cols.reshape(cols.shape[0], n, -1).transpose(1, 0, 2)


def _nchw(a, channels_last):
    """An NCHW view of activation `a`: itself, or the (N, H, W, C) array's view."""
    return a.transpose(0, 3, 1, 2) if channels_last else a


def _layout(y, channels_last):
    """The NCHW result y in the caller's layout: itself, or a channels-last copy."""
    return np.ascontiguousarray(y.transpose(0, 2, 3, 1)) if channels_last else y


@op
def conv2d_channels_last_native(dtype) -> bool:
    """Whether the convolutions read and write channels-last activations of `dtype` as they
    lie. Never here: they compute through NCHW views and copy their results back."""
    return False


@op
def conv2d_channels_last_pad(channels, kh, kw, dtype) -> int:
    """Zero input channels a channels-last convolution of `channels` inputs and a kh x kw
    filter should gain to run on native kernels: none here."""
    return 0


@op
def to_channels_last(x, group=1, left=0, right=0, channels=None):
    """NCHW x laid out channels-last as a convolution's native kernels read it: `left` and
    `right` zero columns around each row, `group` neighbouring columns a pixel (2: pairs, for
    a stride-2 convolution run over them) and zero channels up to `channels` (group * C when
    None). out (N, H, (left + W + right) / group, channels), out[n, h, u, g * C + c] =
    x[n, c, h, group * u + g - left], zero outside x."""
    n, c, h, w = x.shape
    cols = np.zeros((n, h, left + w + right, c), x.dtype)
    cols[:, :, left:left + w] = x.transpose(0, 2, 3, 1)
    out = np.zeros((n, h, cols.shape[2] // group, group * c if channels is None else channels),
                   x.dtype)
    out[..., :group * c] = cols.reshape(n, h, -1, group * c)
    return out


@op
def conv2d_weight_operands(weights):
    """An object whose refresh() reorders the convolution weights among `weights` into the
    operands the backend's kernels read, all in one launch, and whose ready() context has
    the convolutions take them (the weights unchanged inside), or None where the backend
    reorders nothing ahead: here, where the convolutions read a weight as it lies."""
    return None


@op(fp32_math=True)
def conv2d_forward(x, w, b, stride, padding, *, channels_last=False, workspace=None):
    """Cross-correlation of NCHW x with w (C_out, C_in, kH, kW), plus b (or None); x and the
    result are (N, H, W, C) where `channels_last` (computed through NCHW views).

    With a workspace, the im2col matrix of x stays there for conv2d_backward_weight of x.
    """
    workspace = checked(workspace)
    y = _forward(_nchw(x, channels_last), w, b, stride, padding, workspace, x)
    return _layout(y, channels_last)


@op
def conv2d_forward_stats(x, w, stride, padding, *, channels_last=False, workspace=None):
    """(y, mean, var): the bias-free conv2d_forward y and batch_norm_stats of it per output
    channel (over the batch and the pixels): a convolution feeding a batch norm in training.
    Here the two ops as they are (the GPU sums the statistics in the convolution's epilogue)."""
    from dptrain.backend import cpu  # the ops as the package offers them (16-bit in fp32)
    y = cpu.conv2d_forward(x, w, None, stride, padding, channels_last=channels_last,
                           workspace=workspace)
    return (y, *cpu.batch_norm_stats(y.reshape(-1, y.shape[-1]) if channels_last else y))


def _forward(x, w, b, stride, padding, workspace, source):
    """conv2d_forward of NCHW x (a view of `source`, which tags the kept columns)."""
    n = x.shape[0]
    cout, _, kh, kw = w.shape
    cols, (ho, wo) = _im2col(x, kh, kw, stride, padding, workspace, "cols")
    if workspace is not None:
        workspace.remember("cols", source, _cols_key(kh, kw, stride, padding))
    w2 = w.reshape(cout, -1)
    if cols.shape[0] < _PER_IMAGE_K:
        y = np.matmul(w2, _per_image(cols, n))
        if b is not None:
            y += b.reshape(cout, 1)
        return y.reshape(n, cout, ho, wo)
    y_cf = np.matmul(w2, cols, out=scratch(workspace, "y", (cout, cols.shape[1]), x.dtype))
    # (C_out, N, Ho, Wo) to NCHW in one pass, adding the bias on the way.
    y_cf = y_cf.reshape(cout, n, ho, wo).transpose(1, 0, 2, 3)
    y = np.empty((n, cout, ho, wo), dtype=x.dtype)
    if b is None:
        np.copyto(y, y_cf)
    else:
        np.add(y_cf, b.reshape(cout, 1, 1), out=y)
    return y


def _channels_first(gy, workspace, source):
    """gy (N, C, Ho, Wo) as the (C, N*Ho*Wo) matrix that matches _im2col's columns.

    Backward-data builds it; with a workspace, the backward-weight call that follows on the
    same gy (`source`: gy itself, or the channels-last array gy views) finds it there.
    """
    if workspace is not None:
        g = workspace.recall("gy_channels_first", source, None)
        if g is not None:
            return g
    n, c = gy.shape[:2]
    g = scratch(workspace, "gy_channels_first", (c, gy.size // c), gy.dtype)
    np.copyto(g.reshape(c, n, -1), gy.reshape(n, c, -1).transpose(1, 0, 2))
    if workspace is not None:
        workspace.remember("gy_channels_first", source, None)
    return g


@op(fp32_math=True)
def conv2d_backward_data(gy, w, x_shape, stride, padding, *, channels_last=False,
                         workspace=None, spread_later=False):
    """Gradient of conv2d_forward with respect to x, of shape x_shape (gy and x (N, H, W, C)
    where `channels_last`). `spread_later` is the GPU's (a Spread where it would spread a
    smaller product); the CPU always returns the array."""
    workspace = checked(workspace)
    n, c, h, wd = (x_shape[0], x_shape[3], x_shape[1], x_shape[2]) if channels_last else x_shape
    gx = _backward_data(_nchw(gy, channels_last), w, (n, c, h, wd), stride, padding, workspace,
                        gy)  # an NCHW view: one copy to either layout
    return np.ascontiguousarray(_layout(gx, channels_last))


def _backward_data(gy, w, x_shape, stride, padding, workspace, source):
    n, c, h, wd = x_shape
    cout, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, padding
    ho, wo = gy.shape[2:]
    g = _channels_first(gy, workspace, source)
    dcols = scratch(workspace, "dcols", (c * kh * kw, g.shape[1]), gy.dtype)
    np.matmul(w.reshape(cout, -1).T, g, out=dcols)
    dcols = dcols.reshape(c, kh, kw, n, ho, wo)
    # col2im, channels first like dcols so each slab adds without a transpose.
    dxp = np.zeros((c, n, h + 2 * ph, wd + 2 * pw), dtype=gy.dtype)
    for i, j, (rows, cols) in _offsets(kh, kw, sh, sw, ho, wo):
        dxp[:, :, rows, cols] += dcols[:, i, j]
    return dxp[:, :, ph : ph + h, pw : pw + wd].transpose(1, 0, 2, 3)


@op
def conv2d_backward_weight(x, gy, w_shape, stride, padding, *, channels_last=False,
                           workspace=None, add_to=None):
    """Gradient of conv2d_forward with respect to w, of shape w_shape (x and gy (N, H, W, C)
    where `channels_last`); where `add_to` is given (w_shape, gy's dtype or float32), added
    into it as add_ would add it, and add_to returned. The gradient itself is fp32_math's
    (float16 operands multiplied in float32, rounded once), before any add.

    Reuses the im2col matrix that conv2d_forward left in the workspace only if it is that of
    this very x (and kernel, stride, padding); otherwise builds it again.
    """
    gw = fp32_math(_weight_gradient)(x, gy, w_shape, stride, padding, channels_last,
                                     workspace)
    if add_to is None:
        return gw
    np.add(add_to, gw, out=add_to)
    return add_to


def _weight_gradient(x, gy, w_shape, stride, padding, channels_last, workspace):
    workspace = checked(workspace)
    x_source, gy_source = x, gy
    x, gy = _nchw(x, channels_last), _nchw(gy, channels_last)
    _, _, kh, kw = w_shape
    cols = None
    if workspace is not None:
        cols = workspace.recall("cols", x_source, _cols_key(kh, kw, stride, padding))
    if cols is None:  # a different name, so the forward's columns of another input survive
        cols, _ = _im2col(x, kh, kw, stride, padding, workspace, "cols_again")
    if cols.shape[0] < _PER_IMAGE_K:  # per image, straight from NCHW gy, summed over the batch
        n, cout = gy.shape[:2]
        per_image = _per_image(cols, n).transpose(0, 2, 1)
        return np.matmul(gy.reshape(n, cout, -1), per_image).sum(axis=0).reshape(w_shape)
    dw = _gemm(_channels_first(gy, workspace, gy_source), cols.T)
    return np.ascontiguousarray(dw).reshape(w_shape)


# ----------------------------------------------------------------------------- pooling


@op
def max_pool2d_forward(x, kernel, stride, padding, *, workspace=None, channels_last=False):
    """Returns (y, idx): idx is the flat h*W+w position in x of each window's maximum (int32).

    Ties go to the first maximum in window order (rows, then columns), as np.argmax picks.
    `channels_last`: x, y and idx are (N, H, W, C) (through NCHW copies: the reference).
    """
    if channels_last:
        y, idx = max_pool2d_forward(np.ascontiguousarray(_nchw(x, True)), kernel, stride,
                                    padding, workspace=workspace)
        return _layout(y, True), _layout(idx, True)
    workspace = checked(workspace)
    if tuple(kernel) == (2, 2) and tuple(stride) == (2, 2) and tuple(padding) == (0, 0):
        return _max_pool_2x2(x, workspace)
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    n, c, h, w = x.shape
    ho, wo = _out_size(h, kh, sh, ph), _out_size(w, kw, sw, pw)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf) if ph or pw else x
    # Running max over the kH*kW window offsets; an offset becomes the argmax only when it is
    # strictly greater than everything before it, so ties keep the earliest. Offsets grow, so
    # the argmax is the largest offset that raised the max (np.maximum, not a masked write:
    # NumPy's boolean-mask assignment is several times slower).
    offsets = _offsets(kh, kw, sh, sw, ho, wo)
    _, _, (rows, cols) = next(offsets)
    y = xp[:, :, rows, cols].copy()
    arg = np.zeros((n, c, ho, wo), dtype=np.int32)
    for i, j, (rows, cols) in offsets:
        v = xp[:, :, rows, cols]
        np.maximum(arg, (v > y) * np.int32(i * kw + j), out=arg)
        np.maximum(y, v, out=y)
    r = np.arange(ho, dtype=np.int32).reshape(ho, 1) * sh + arg // kw - ph
    q = np.arange(wo, dtype=np.int32).reshape(1, wo) * sw + arg % kw - pw
    return y, r * w + q


def _max_pool_2x2(x, workspace):
    """max_pool2d_forward for the common 2x2 window, stride 2, no padding."""
    n, c, h, w = x.shape
    ho, wo = h // 2, w // 2
    x = x[:, :, : 2 * ho, : 2 * wo]  # an odd last row/column belongs to no window
    # Max of each row's pair first, then of the window's two rows: the pair views merge
    # into long strided loops, and a strict '>' at both steps keeps ties on the first
    # element in row-major window order.
    left, right = x[..., 0::2], x[..., 1::2]
    row_max = np.maximum(left, right, out=scratch(workspace, "pool_row_max", left.shape, x.dtype))
    row_right = np.greater(right, left,
                           out=scratch(workspace, "pool_row_right", left.shape, np.bool_))
    top, bottom = row_max[:, :, 0::2], row_max[:, :, 1::2]
    y = np.maximum(top, bottom)
    lower = np.greater(bottom, top, out=scratch(workspace, "pool_lower", y.shape, np.bool_))
    # The winning row's column bit, lower ? b : a, as a ^ (lower & (a ^ b)): np.where is
    # several times slower on bools.
    a, b = row_right[:, :, 0::2], row_right[:, :, 1::2]
    col = np.bitwise_xor(a, b, out=scratch(workspace, "pool_col", y.shape, np.bool_))
    col &= lower
    col ^= a
    idx = np.multiply(lower, np.int32(w), out=np.empty(y.shape, dtype=np.int32))
    idx += col
    idx += 2 * w * np.arange(ho, dtype=np.int32).reshape(ho, 1)  # the window's top-left...
    idx += np.arange(0, 2 * wo, 2, dtype=np.int32)  # ...element
    return y, idx


@op
def batch_norm_relu_max_pool2d(x, mean, var, weight, bias, eps, kernel, stride, padding):
    """max_pool2d_forward(relu(batch_norm_forward(x, ...)), ...) of channels-last x (N, H,
    W, C): (y, idx). Here the two ops as they are (the GPU never stores the batch norm)."""
    from dptrain.backend import cpu  # the ops as the package offers them (16-bit in fp32)
    c = x.shape[-1]
    z = cpu.batch_norm_forward(x.reshape(-1, c), mean, var, weight, bias, eps, relu=True)
    return max_pool2d_forward(z.reshape(x.shape), kernel, stride, padding, channels_last=True)


@op
def relu_max_pool2d_forward(x, kernel, stride, padding, *, workspace=None, channels_last=False):
    """max_pool2d_forward(relu(x)), with idx = -1 where the window's maximum is not > 0:
    relu's gradient is zero there, and max_pool2d_backward skips idx < 0."""
    y, idx = max_pool2d_forward(np.maximum(x, x.dtype.type(0)), kernel, stride, padding,
                                workspace=workspace, channels_last=channels_last)
    idx[~(y > 0)] = -1
    return y, idx


@op
def max_pool2d_backward(gy, idx, x_shape, *, window=None, workspace=None, channels_last=False,
                        gb=None):
    """Gradient of max_pool2d_forward: gy added at each window's argmax idx (none where
    idx < 0, as relu_max_pool2d_forward marks windows whose gradient is zero). `window`
    (the forward's kernel, stride, padding) is not needed here: idx says it all.
    `channels_last`: gy, idx and x_shape are (N, H, W, C). `gb`: a second part of the
    gradient, gy + gb (add's rounding) pooled back."""
    if gb is not None:
        if gb.shape != gy.shape:
            raise ValueError(f"cpu.max_pool2d_backward: gb {gb.shape} is not gy's shape "
                             f"{gy.shape}")
        if gb.dtype != gy.dtype:
            raise TypeError(f"cpu.max_pool2d_backward: gb's dtype {gb.dtype} is not gy's "
                            f"{gy.dtype}")
        gy = add(gy, gb)
    if channels_last:
        n, h, w, c = x_shape
        dx = max_pool2d_backward(_nchw(gy, True), _nchw(idx, True), (n, c, h, w),
                                 window=window, workspace=workspace)
        return _layout(dx, True)
    workspace = checked(workspace)
    n, c, h, w = x_shape
    planes = np.arange(0, n * c * h * w, h * w, dtype=np.int64).reshape(n, c, 1, 1)
    dx = np.zeros(n * c * h * w, dtype=gy.dtype)
    flat = np.add(planes, idx, out=scratch(workspace, "pool_flat_idx", idx.shape, np.int64))
    flat, g = flat.ravel(), gy.ravel()
    if idx.size and idx.min() < 0:
        keep = idx.ravel() >= 0
        flat, g = flat[keep], g[keep]
    # add.at accumulates where overlapping windows pick the same element; it stays in
    # gy's dtype (bincount would go through float64).
    np.add.at(dx, flat, g)
    return dx.reshape(x_shape)


@op(fp32_math=True)
def avg_pool2d_forward(x, kernel, stride, padding):
    """Average over each window, padding counted in the divisor (PyTorch's default)."""
    kh, kw = kernel
    win = _windows(x, kh, kw, stride, padding)
    return np.ascontiguousarray(win.mean(axis=(4, 5), dtype=x.dtype))


@op(fp32_math=True)
def avg_pool2d_backward(gy, x_shape, kernel, stride, padding):
    n, c, h, w = x_shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho, wo = gy.shape[2:]
    g = gy / gy.dtype.type(kh * kw)
    dxp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=gy.dtype)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + (ho - 1) * sh + 1 : sh, j : j + (wo - 1) * sw + 1 : sw] += g
    return np.ascontiguousarray(dxp[:, :, ph : ph + h, pw : pw + w])
