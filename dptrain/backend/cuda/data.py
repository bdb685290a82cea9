"""Launchers of kernels/data.cu: batch assembly on the device, and dropout masks.

Conventions (the .cu file's header has the kernel side):
  * gather_normalize(images uint8 (M, ...), idx, mean, std, dtype) -> rows idx, scaled to
    [0, 1] then (x - mean) / std in float32 (rounded once to dtype where it is 16-bit: the
    model's input as its cast would give it), bit for bit as the CPU backend computes them.
    mean and std are scalars, or per-channel sequences of length C for images (M, C, ...)
    (at most MAX_CHANNELS); they reach the kernel by value, so a captured step holds them.
    Host indices are uploaded (outside a captured step); a device index outside [0, M) gives
    a NaN row. With layout=(left, right, group, channels) (dptrain.backend.input_layout) the
    rows come laid out channels-last as the stem convolution reads them, (B, H, (left + W +
    right) / group, channels): to_channels_last of the NCHW result bit for bit (zero columns
    and channels, NaN where the image's values are in an invalid row), in one pass of
    gather_normalize_cl_kernel, 16-byte stores where channels * itemsize allows.
  * augment_crop_flip(x (B, C, H, W) of any float dtype, state uint64 [seed, counter] on the
    device, pad, first=0, stride=1) -> random crop with zero padding and horizontal flip, out
    of place (the elements moved as raw bits), the same draws as the CPU backend (a
    splitmix64 hash of seed, counter and image index: kernels/data.cu). A one-thread kernel
    then adds 1 to the counter on the device, so a replayed graph draws a new crop and flip
    each step.
  * augment_resized_crop(images uint8 (M, C, H, W), idx, state, size, scale, ratio, mean,
    std, first, stride, dtype, channels_last) and resize_center_crop(images, idx, size, mean,
    std, dtype, channels_last): random-resized-crop + flip, or evaluation's resize + centre
    crop, normalised and written in the model's dtype (float32, float16, bfloat16) and layout;
    the definition is dptrain/backend/cpu/augment.py, computed bit for bit (the boxes by a
    one-thread-per-image kernel into a small int32 table, then one thread per output value).
    The random one advances state[1] by one on the device, as augment_crop_flip does.
  * dropout_mask(shape, p) keeps each element with probability 1 - p and scales it by
    1 / (1 - p) (inverted dropout). Philox4x32-10 keyed by the seed; the seed and the counter
    offset live in runtime.rng_state on the device. After each draw a one-thread kernel adds
    the draw's group count (4 numbers per group) to the offset, so every draw, eager or
    replayed from a CUDA graph, gets fresh numbers; after runtime.manual_seed(s) the masks
    are a function of s and the sequence of draws alone.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from dptrain.backend import input_layout
from dptrain.backend.bfloat16 import HALVES
from dptrain.backend.cpu import augment as reference
from dptrain.backend.cuda import launch
from dptrain.backend.cuda.runtime import runtime
from dptrain.backend.cuda.transpose import copy
from dptrain.backend.registry import op

DATA = "data.cu"
MAX_CHANNELS = 16  # DP_MAX_CHANNELS in kernels/data.cu

# struct ChannelAffine (kernels/data.cu): per-channel float32 scale and shift.
CHANNEL_AFFINE = np.dtype([("scale", np.float32, (MAX_CHANNELS,)),
                           ("shift", np.float32, (MAX_CHANNELS,))])


def _channel_affine(images, mean, std, every_channel=False):
    """(channels, ChannelAffine struct) of x * scale - shift = (x / 255 - mean) / std, the
    float32 values the CPU backend uses; scalars once, or (`every_channel`: for a kernel
    that reads each channel's pair) once for each of the images' C channels."""
    mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    if mean.ndim == 0 and std.ndim == 0 and not every_channel:
        channels = 1
    else:
        channels = images.shape[1] if images.ndim >= 2 else -1
        if mean.shape not in ((), (channels,)) or std.shape not in ((), (channels,)):
            raise ValueError(f"cuda.gather_normalize: mean and std must be scalars or of "
                             f"length C={channels}, got shapes {mean.shape} and {std.shape}")
        if channels > MAX_CHANNELS:
            raise ValueError(f"cuda.gather_normalize: at most {MAX_CHANNELS} channels with "
                             f"per-channel mean/std, got {channels}")
    scale = np.broadcast_to(1.0 / (255.0 * std), (channels,)).astype(np.float32)
    shift = np.broadcast_to(mean / std, (channels,)).astype(np.float32)
    return channels, launch.struct(CHANNEL_AFFINE, scale=np.pad(scale, (0, MAX_CHANNELS - channels)),
                                   shift=np.pad(shift, (0, MAX_CHANNELS - channels)))


@op
def gather_normalize(images, idx, mean, std, dtype=np.float32, layout=None):
    """Rows idx of a uint8 (M, C, H, W) image array scaled to [0,1] then (x-mean)/std, in
    float32 or rounded once to 16 bits (`dtype`: the model's input, no cast pass after);
    laid out channels-last where `layout` (left, right, group, channels) says (the module's
    notes)."""
    launch.check_arrays("gather_normalize", images)
    if images.dtype != np.uint8 or images.ndim < 1:
        raise TypeError(f"cuda.gather_normalize: images must be uint8 (M, ...), got {images.dtype}")
    launch.check_contiguous("gather_normalize", images)
    if not launch.is_cupy(idx):
        idx = cupy.asarray(np.asarray(idx))  # host indices: uploaded (outside a captured step)
    if idx.ndim != 1 or idx.dtype.kind != "i" or idx.itemsize not in (4, 8):
        raise TypeError(f"cuda.gather_normalize: idx must be 1-D int32/int64, got {idx.shape} {idx.dtype}")
    idx = idx if idx.flags.c_contiguous else copy(idx)
    m = images.shape[0]
    chw = math.prod(images.shape[1:])
    if np.dtype(dtype) not in (np.dtype(np.float32),) + HALVES:
        raise TypeError(f"cuda.gather_normalize: dtype must be float32, float16 or bfloat16, "
                        f"got {np.dtype(dtype)}")
    if layout is not None:
        return _gather_laid_out(images, idx, mean, std, np.dtype(dtype), layout)
    out = launch.new((idx.size,) + tuple(images.shape[1:]), dtype)
    launch.check_int32("gather_normalize", idx.size, chw)
    channels, affine = _channel_affine(images, mean, std)
    hw = chw // channels if channels > 1 else max(chw, 1)
    if out.size:
        # eight or four values a thread where rows and planes are whole 8- or 4-byte words
        v = next(k for k in (8, 4, 1) if chw % k == 0 and hw % k == 0 and images.data.ptr % k == 0)
        # grid y: images (striding over the batch past the grid's limit); x: one image's values
        grid = (min(-(-chw // (launch.BLOCK * v)), 1024), min(idx.size, launch.GRID_YZ_MAX))
        launch.kernel(DATA, "gather_normalize_kernel", launch.ctype(idx.dtype), str(v),
                      launch.ctype(dtype))(
            grid, (launch.BLOCK,), (out, images, idx, np.int32(idx.size), np.int64(m),
                                    np.int32(chw), np.int32(hw), affine))
    return out


def _gather_laid_out(images, idx, mean, std, dtype, layout):
    """gather_normalize's rows laid out in `layout`: one pass of gather_normalize_cl_kernel,
    a thread a 16-byte vector of a pixel's slots where they fill whole vectors, else a slot."""
    left, right, group, channels = input_layout.checked("cuda.gather_normalize", layout,
                                                        images.shape[1:])
    C, H, W = images.shape[1:]
    if (left, right, group, channels) == (0, 0, 1, 1):  # NCHW's bytes: its wider stores
        return gather_normalize(images, idx, mean, std, dtype).reshape(idx.size, H, W, 1)
    wo = (left + W + right) // group
    out = launch.new((idx.size, H, wo, channels), dtype)
    vec = 16 // out.itemsize if channels * out.itemsize % 16 == 0 else 1
    items = out.size // vec
    if items:
        launch.check_int32("gather_normalize", out.size, C * H * W)
        _, affine = _channel_affine(images, mean, std, every_channel=True)
        fn = launch.kernel(DATA, "gather_normalize_cl_kernel", launch.ctype(idx.dtype), str(vec),
                           launch.ctype(dtype))
        launch.grid_stride(fn, items, (out, images, idx, np.int64(images.shape[0]),
                                       *map(np.int32, (items, C, H, W, wo, channels, group,
                                                       left)), affine))
    return out


@op
def augment_crop_flip(x, state, pad, first=0, stride=1):
    """Random crop (zero padding ``pad``) and horizontal flip of x (B, C, H, W), out of
    place; advances state[1] by one on the device."""
    launch.check_arrays("augment_crop_flip", x, state)
    if x.ndim != 4 or x.dtype not in launch.FLOATS + HALVES:
        raise TypeError(f"cuda.augment_crop_flip: x must be a float (B, C, H, W), got "
                        f"{x.dtype} {x.shape}")
    if state.dtype != np.uint64 or state.shape != (2,):
        raise ValueError(f"cuda.augment_crop_flip: state must be uint64 (2,), got {state.dtype} "
                         f"{state.shape}")
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or pad < 0:
        raise ValueError(f"cuda.augment_crop_flip: pad must be an integer >= 0, got {pad!r}")
    x = x if x.flags.c_contiguous else copy(x)
    B, C, H, W = x.shape
    launch.check_int32("augment_crop_flip", C, H + pad, W + pad)
    out = launch.new(x.shape, x.dtype)
    if out.size:
        launch.grid_stride(launch.kernel(DATA, "augment_crop_flip_kernel",
                                         launch.bits(x.itemsize)[0]),  # moves bits
                           out.size,
                           (out, x, np.int64(B), np.int32(C), np.int32(H), np.int32(W),
                            np.int32(pad), state, np.uint64(first), np.uint64(stride)))
    launch.kernel(DATA, "rng_advance_kernel")((1,), (1,), (state, np.uint64(1)))
    return out


BOX_INTS = 9  # DP_BOX_INTS in kernels/data.cu


def _resample(where, images, idx, size, mean, std, dtype, channels_last, boxes, box_stride):
    """The resized_crop_kernel launch shared by both ops: checks, then out (B, ...) in dtype."""
    B, C, H, W = len(idx), images.shape[1], images.shape[2], images.shape[3]
    S = int(size)
    launch.check_int32(where, C * S * S, H * W, C)
    # per-channel pairs even for scalars: the kernel reads scale[c] for every channel c
    _, affine = _channel_affine(images, np.broadcast_to(np.asarray(mean, np.float64), (C,)),
                                np.broadcast_to(np.asarray(std, np.float64), (C,)))
    shape = (B, S, S, C) if channels_last else (B, C, S, S)
    out = launch.new(shape, dtype)
    if out.size:
        fn = launch.kernel(DATA, "resized_crop_kernel", launch.ctype(dtype),
                           "true" if channels_last else "false")
        launch.grid_stride(fn, out.size, (out, images, idx, np.int64(B), np.int64(images.shape[0]),
                                          np.int32(C), np.int32(H), np.int32(W), np.int32(S),
                                          boxes, np.int32(box_stride), affine))
    return out


def _checked(where, images, idx, size, dtype):
    launch.check_arrays(where, images)
    if images.dtype != np.uint8 or images.ndim != 4:
        raise TypeError(f"cuda.{where}: images must be uint8 (M, C, H, W), got {images.dtype} "
                        f"{images.shape}")
    launch.check_contiguous(where, images)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0:
        raise ValueError(f"cuda.{where}: size must be a positive integer, got {size!r}")
    if np.dtype(dtype) not in reference.OUT_DTYPES:
        raise TypeError(f"cuda.{where}: dtype must be float32, float16 or bfloat16 (uint16), "
                        f"got {np.dtype(dtype)}")
    if not launch.is_cupy(idx):
        idx = cupy.asarray(np.asarray(idx))  # host indices: uploaded (outside a captured step)
    if idx.ndim != 1 or idx.dtype.kind != "i":
        raise TypeError(f"cuda.{where}: idx must be 1-D integers, got {idx.shape} {idx.dtype}")
    return idx if idx.dtype == np.int64 and idx.flags.c_contiguous else idx.astype(np.int64)


@op
def augment_resized_crop(images, idx, state, size, scale, ratio, mean, std, first=0,
                         stride=1, dtype=np.float32, channels_last=False):
    """Random-resized-crop + flip + normalisation of rows idx, in dtype and layout; advances
    state[1] by one on the device."""
    where = "augment_resized_crop"
    idx = _checked(where, images, idx, size, dtype)
    launch.check_arrays(where, state)
    if state.dtype != np.uint64 or state.shape != (2,):
        raise ValueError(f"cuda.{where}: state must be uint64 (2,), got {state.dtype} "
                         f"{state.shape}")
    s0, s1 = reference.check_range("scale", scale, reference.SCALE_OK)
    r0, r1 = reference.check_range("ratio", ratio, reference.RATIO_OK)
    B, H, W = idx.size, images.shape[2], images.shape[3]
    boxes = launch.new((max(B, 1), BOX_INTS), np.int32)
    if B:
        launch.grid_stride(launch.kernel(DATA, "rrc_boxes_kernel"), B,
                           (boxes, np.int64(B), np.int32(H), np.int32(W), np.int32(size),
                            np.float64(s0), np.float64(s1), np.float64(math.log(r0)),
                            np.float64(math.log(r1)), np.float64(r0), np.float64(r1), state,
                            np.uint64(first), np.uint64(stride)))
    out = _resample(where, images, idx, size, mean, std, np.dtype(dtype), channels_last, boxes,
                    BOX_INTS)
    launch.kernel(DATA, "rng_advance_kernel")((1,), (1,), (state, np.uint64(1)))
    return out


@op
def resize_center_crop(images, idx, size, mean, std, dtype=np.float32, channels_last=False):
    """Evaluation's view: resize (shorter side round(size * 256/224)) + centre crop, no draws."""
    where = "resize_center_crop"
    idx = _checked(where, images, idx, size, dtype)
    box = reference.eval_box(images.shape[2], images.shape[3], int(size)) + (0,)
    boxes = cupy.asarray(np.array(box, np.int32))  # one row for all (uploaded: eager only)
    return _resample(where, images, idx, size, mean, std, np.dtype(dtype), channels_last, boxes, 0)


@op
def dropout_mask(shape, p, dtype=np.float32):
    """Keep each element with probability 1-p, scaled by 1/(1-p) (inverted dropout)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"cuda.dropout_mask: p must be in [0, 1), got {p}")
    dtype = np.dtype(dtype)
    if dtype not in launch.FLOATS + launch.HALVES:
        raise TypeError(f"cuda.dropout_mask: dtype {dtype} not supported (float16, bfloat16, "
                        f"float32 or float64)")
    out = launch.new(shape, dtype)
    n = out.size
    if n:
        groups = -(-n // 4)  # one Philox call gives 4 numbers
        state = runtime.rng_state
        launch.grid_stride(launch.kernel(DATA, "dropout_mask_kernel", launch.ctype(dtype)), groups,
                           (out, np.int64(n), state, np.float32(p),
                            (np.float32 if dtype in launch.HALVES else dtype.type)(1.0 / (1.0 - p))))
        launch.kernel(DATA, "rng_advance_kernel")((1,), (1,), (state, np.uint64(groups)))
    return out
