"""Which augmentation a run uses, and the resampling one (random-resized-crop) as an object
the device loader applies to its uint8 batch in place of plain normalisation.

* ``crop-flip`` (a bare ``--augment``): the loader's own random crop with zero padding and
  horizontal flip (``be.augment_crop_flip``), at the stored size; evaluation sees the stored
  images.
* ``random-resized-crop``: ``be.augment_resized_crop`` from the stored uint8 images straight
  to the model's input of side ``size``: torchvision's RandomResizedCrop (``scale``,
  ``ratio``), bilinear, a horizontal flip, normalisation; drawn per (seed, step, image of the
  global batch) from a device uint64 [seed, counter] that each call advances on the device, so
  a replayed graph draws new crops and N ranks equal one process. Evaluation sees
  ``be.resize_center_crop`` (shorter side round(size * 256/224), centre square of ``size``).
  The definition: dptrain/backend/cpu/augment.py.
"""
from __future__ import annotations

import numpy as np

CROP_FLIP, RESIZED_CROP = "crop-flip", "random-resized-crop"
AUGMENTATIONS = (CROP_FLIP, RESIZED_CROP)
RRC_SCALE, RRC_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # torchvision's defaults
# (exclusive low, inclusive high): the backends' SCALE_OK and RATIO_OK, for the flags' checks
SCALE_BOUNDS, RATIO_BOUNDS = (0.0, 1.0), (0.0, 1000.0)


def kind(augment) -> str | None:
    """The augmentation named by ``augment`` (None/False: none; True: crop-flip, as before)."""
    if augment is None or augment is False:
        return None
    if augment is True:
        return CROP_FLIP
    if augment not in AUGMENTATIONS:
        raise ValueError(f"--augment {augment!r}: choose {' or '.join(AUGMENTATIONS)}")
    return augment


class ResizedCrop:
    """Batches resampled to ``size`` x ``size`` on the device of ``be``: ``train`` draws a
    random-resized-crop and flip (when ``random``), ``view`` is evaluation's resize + centre
    crop. Outputs are NCHW (what the models read) in ``dtype``: the model's activation dtype,
    so a 16-bit step's input cast finds nothing to do (the same values: one rounding)."""

    def __init__(self, be, size: int, *, random: bool = True, scale=RRC_SCALE, ratio=RRC_RATIO,
                 seed: int = 0, shard: tuple = (0, 1), dtype=np.float32):
        from dptrain.backend.cpu.augment import RATIO_OK, SCALE_OK, check_range

        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0:
            raise ValueError(f"ResizedCrop: size must be a positive integer, got {size!r}")
        self.be, self.size, self.random = be, int(size), bool(random)
        self.scale = check_range("--rrc-scale", scale, SCALE_OK)
        self.ratio = check_range("--rrc-ratio", ratio, RATIO_OK)
        self.shard = (int(shard[0]), int(shard[1]))
        self.dtype = np.dtype(dtype)
        self.state = be.asarray(np.array([int(seed) % 2**64, 0], np.uint64)) if random else None

    def output_shape(self, image_shape) -> tuple:
        return (image_shape[0], self.size, self.size)

    def train(self, images, rows, mean, std):
        if not self.random:
            return self.view(images, rows, mean, std)
        return self.be.augment_resized_crop(images, rows, self.state, self.size, self.scale,
                                            self.ratio, mean, std, self.shard[0], self.shard[1],
                                            dtype=self.dtype)

    def view(self, images, rows, mean, std):
        return self.be.resize_center_crop(images, rows, self.size, mean, std, dtype=self.dtype)


def input_shape(augment, image_shape, size) -> tuple:
    """The model's input (C, H, W) for stored images of ``image_shape``: resampled to ``size``
    (default: the stored shorter side) under random-resized-crop, else as stored."""
    if kind(augment) != RESIZED_CROP:
        return tuple(image_shape)
    return (image_shape[0],) + (int(size or min(image_shape[1:])),) * 2


def resamplers(be, augment, image_shape, size, scale, ratio, seed, shard,
               dtype=np.float32) -> tuple:
    """(training's, evaluation's) ResizedCrop under random-resized-crop, else (None, None)."""
    if kind(augment) != RESIZED_CROP:
        return None, None
    side = input_shape(augment, image_shape, size)[1]
    return (ResizedCrop(be, side, scale=scale, ratio=ratio, seed=seed, shard=shard, dtype=dtype),
            ResizedCrop(be, side, random=False, scale=scale, ratio=ratio, dtype=dtype))
