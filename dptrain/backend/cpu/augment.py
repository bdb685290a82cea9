"""The batch's images from uint8 rows: gather + normalise (laid out for the stem where asked),
random-resized-crop + flip + normalise, and resize + centre crop: the NumPy reference of
kernels/data.cu's gather_normalize and resized_crop kernels (the definition both backends
compute bit for bit).

Boxes (torchvision's ``RandomResizedCrop.get_params``, its logic with our draws): image b's
key is k = splitmix64(index + splitmix64(splitmix64(seed) + counter)), index = first + b *
stride (its position in the global batch); its n-th draw is r_n = splitmix64(k + n), a
uniform u_n = (r_n >> 11) * 2^-53. Attempt a (0..9): target = H*W * (s0 + (s1 - s0) *
u_2a), aspect = exp(l0 + (l1 - l0) * u_2a+1) with l = log(ratio) computed on the host, w =
rint(sqrt(target * aspect)), h = rint(sqrt(target / aspect)) (round half to even, as
Python's round); the first with 0 < w <= W and 0 < h <= H wins, at top = r_20 % (H - h + 1),
left = r_21 % (W - w + 1). Else torchvision's fallback: the centre crop of the whole image
clamped to the ratio range. flip = r_22 & 1. All of it is float64 arithmetic with one
rounding per operation (exp is ``_exp``: +, *, / only), so the boxes are exact on both
backends.

Resampling (bilinear, align_corners=False, pixel centres at +0.5: torchvision's tensor
resize with antialias=False): output (oy, ox) of side S samples the box at src = max(0,
(o + off + 0.5) * (in / out) - 0.5), all float32 with one rounding per operation; the
interpolated pixel value (0..255) is then normalised as gather_normalize does (v * scale_c -
shift_c) and rounded once to the output dtype. A flipped image reads column S-1-ox.
"""
from __future__ import annotations

import math

import numpy as np

from dptrain.backend import input_layout
from dptrain.backend.bfloat16 import BFLOAT16, to_bfloat16
from dptrain.backend.cpu.conv import to_channels_last
from dptrain.backend.cpu.ops import _channel_affine, astype
from dptrain.backend.registry import op

M64 = (1 << 64) - 1
ATTEMPTS = 10  # torchvision's
EVAL_RESIZE = 256 / 224  # eval: shorter side to round(size * 256/224), then the centre square
OUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)


@op
def gather_normalize(images, idx, mean, std, dtype=np.float32, layout=None):
    """Rows idx of a uint8 (M, C, H, W) image array scaled to [0,1] then (x-mean)/std in
    float32, rounded once to `dtype`; mean and std: scalars or C per-channel values.
    `layout` (left, right, group, channels; dptrain.backend.input_layout): the rows laid out
    channels-last as a stem convolution reads them, to_channels_last(rows, group, left, right,
    channels) (B, H, (left + W + right) / group, channels); None: NCHW."""
    if layout is not None:
        layout = input_layout.checked("gather_normalize", layout, images.shape[1:])
    scale, shift = _channel_affine(images, mean, std)
    x = images[idx].astype(np.float32)
    x *= scale
    x -= shift
    x = astype(x, dtype)
    if layout is None:
        return x
    return to_channels_last(x, layout.group, layout.left, layout.right, layout.channels)


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def exp(x: float) -> float:
    """e**x from +, *, / only (each rounded once, as the kernel's __d*_rn): halve x until
    |x| <= 1/8, a degree-12 Taylor polynomial (Horner), then square back."""
    n = 0
    while abs(x) > 0.125:
        x *= 0.5
        n += 1
    p = 1.0
    for k in range(12, 0, -1):
        p = 1.0 + (x / k) * p
    for _ in range(n):
        p = p * p
    return p


SCALE_OK = (0.0, 1.0, "0 < min <= max <= 1")  # (exclusive low, inclusive high, in words)
RATIO_OK = (0.0, 1000.0, "0 < min <= max <= 1000")


def check_range(name, value, bounds) -> tuple:
    """(lo, hi) floats within ``bounds`` (SCALE_OK, RATIO_OK) with lo <= hi, else a
    ValueError naming ``name`` and the value."""
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be two numbers (min, max), got {value!r}") from None
    if not bounds[0] < lo <= hi <= bounds[1]:  # NaN fails too
        raise ValueError(f"{name} must be MIN,MAX with {bounds[2]}, got {value!r}")
    return lo, hi


def rrc_box(seed, counter, index, H, W, scale, ratio) -> tuple:
    """(top, left, h, w, flip) of one image: the module's notes, in Python floats."""
    base = splitmix64((splitmix64(seed & M64) + counter) & M64)
    key = splitmix64((index + base) & M64)

    def r(n):
        return splitmix64((key + n) & M64)

    def u(n):
        return (r(n) >> 11) * 2.0 ** -53

    l0, l1 = math.log(ratio[0]), math.log(ratio[1])
    area = float(H * W)
    flip = r(22) & 1
    for a in range(ATTEMPTS):
        target = area * (scale[0] + (scale[1] - scale[0]) * u(2 * a))
        aspect = exp(l0 + (l1 - l0) * u(2 * a + 1))
        w = int(np.rint(math.sqrt(target * aspect)))
        h = int(np.rint(math.sqrt(target / aspect)))
        if 0 < w <= W and 0 < h <= H:
            return r(20) % (H - h + 1), r(21) % (W - w + 1), h, w, flip
    in_ratio = W / H
    if in_ratio < ratio[0]:
        w, h = W, int(np.rint(W / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = H, int(np.rint(H * ratio[1]))
    else:
        h, w = H, W
    return (H - h) // 2, (W - w) // 2, h, w, flip


def _source(out_size, off, in_size, virtual):
    """(lo, hi, lam) float32 sampling of `out_size` outputs of a `virtual`-long resize of an
    `in_size`-long span, starting at output `off` (PyTorch's upsample_bilinear2d)."""
    scale = np.float32(in_size) / np.float32(virtual)
    src = (np.arange(off, off + out_size, dtype=np.float32) + np.float32(0.5)) * scale \
        - np.float32(0.5)
    src = np.maximum(src, np.float32(0))
    lo = src.astype(np.int64)
    hi = lo + (lo < in_size - 1)
    lam = np.minimum(src - lo.astype(np.float32), np.float32(1))
    return lo, hi, lam


def resample(image, box, size, affine, flip=False):
    """float32 (C, S, S) of uint8 image (C, H, W): box = (top, left, h, w, virtual_h,
    virtual_w, off_y, off_x), bilinear, normalised by affine = (scale, shift) per channel."""
    top, left, h, w, vh, vw, oy, ox = box
    ylo, yhi, ly = _source(size, oy, h, vh)
    xlo, xhi, lx = _source(size, ox, w, vw)
    if flip:
        xlo, xhi, lx = xlo[::-1], xhi[::-1], lx[::-1]
    one = np.float32(1)
    img = image.astype(np.float32)
    rows = img[:, top + ylo, :], img[:, top + yhi, :]
    p00, p01 = rows[0][:, :, left + xlo], rows[0][:, :, left + xhi]
    p10, p11 = rows[1][:, :, left + xlo], rows[1][:, :, left + xhi]
    wy1, wx1 = ly[None, :, None], lx[None, None, :]
    wy0, wx0 = one - wy1, one - wx1
    v = wy0 * (wx0 * p00 + wx1 * p01) + wy1 * (wx0 * p10 + wx1 * p11)
    scale, shift = affine
    return v * scale[:, None, None] - shift[:, None, None]


def _finish(images, idx, size, mean, std, dtype, channels_last, boxes, flips):
    dtype = np.dtype(dtype)
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16 (uint16), got {dtype}")
    scale, shift = _channel_affine(images, mean, std)
    C = images.shape[1]
    affine = (np.broadcast_to(scale.ravel(), (C,)), np.broadcast_to(shift.ravel(), (C,)))
    out = np.empty((len(idx), C, size, size), np.float32)
    for b, row in enumerate(idx):
        out[b] = resample(images[row], boxes[b], size, affine, flips[b])
    if channels_last:
        out = np.ascontiguousarray(out.transpose(0, 2, 3, 1))
    return to_bfloat16(out) if dtype == BFLOAT16 else out.astype(dtype)


def _check(images, idx, size):
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"images must be uint8 (M, C, H, W), got {images.dtype} "
                         f"{images.shape}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    idx = np.asarray(idx).astype(np.int64)
    if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= images.shape[0])):
        raise ValueError(f"idx must be 1-D indices in [0, {images.shape[0]})")
    return idx


@op
def augment_resized_crop(images, idx, state, size, scale, ratio, mean, std, first=0,
                         stride=1, dtype=np.float32, channels_last=False):
    """Rows idx of uint8 images (M, C, H, W), each random-resized-cropped to size x size,
    flipped at random, normalised ((x/255 - mean) / std) and written in ``dtype`` (float32,
    float16, bfloat16 as uint16), NCHW or NHWC (``channels_last``); state = uint64 [seed,
    counter], advanced by one. Row b draws as image first + b * stride of the global batch."""
    idx = _check(images, idx, size)
    scale = check_range("scale", scale, SCALE_OK)
    ratio = check_range("ratio", ratio, RATIO_OK)
    if state.dtype != np.uint64 or state.shape != (2,):
        raise ValueError(f"state must be uint64 (2,), got {state.dtype} {state.shape}")
    H, W = images.shape[2:]
    seed, counter = int(state[0]), int(state[1])
    boxes, flips = [], []
    for b in range(len(idx)):
        top, left, h, w, flip = rrc_box(seed, counter, (first + b * stride) & M64, H, W, scale,
                                        ratio)
        boxes.append((top, left, h, w, size, size, 0, 0))
        flips.append(bool(flip))
    state[1] = np.uint64((counter + 1) & M64)
    return _finish(images, idx, size, mean, std, dtype, channels_last, boxes, flips)


def eval_box(H, W, size) -> tuple:
    """(0, 0, H, W, virtual_h, virtual_w, off_y, off_x): torchvision's Resize(round(size *
    256/224)) (the shorter side; the longer truncated) then CenterCrop(size)."""
    side = int(round(size * EVAL_RESIZE))
    if H <= W:
        vh, vw = side, int(side * W / H)
    else:
        vh, vw = int(side * H / W), side
    return 0, 0, H, W, vh, vw, int(round((vh - size) / 2)), int(round((vw - size) / 2))


@op
def resize_center_crop(images, idx, size, mean, std, dtype=np.float32, channels_last=False):
    """Rows idx of uint8 images, resized (shorter side round(size * 256/224), bilinear) and
    centre-cropped to size x size, normalised, in ``dtype`` and layout: evaluation's view."""
    idx = _check(images, idx, size)
    box = eval_box(images.shape[2], images.shape[3], size)
    return _finish(images, idx, size, mean, std, dtype, channels_last, [box] * len(idx),
                   [False] * len(idx))
