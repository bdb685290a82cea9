"""The device loader: the one place where a dataset meets the device.

A training step reads its batch through ``batch()``, which issues only device work
(``be.gather_normalize`` and ``be.getitem``) on device buffers allocated once, whose
addresses never change. The host chooses the batch beforehand with ``set_batch``, which
does host work only and uploads into those buffers (``be.runtime.upload_``, asynchronous
and ordered on the current stream). So a whole step that calls ``batch()`` can be
recorded once as a CUDA graph and replayed, with ``set_batch`` before each replay::

    loader = DeviceLoader(train_set, be, batch_size=256)
    for indices in sampler.epoch_batches(epoch):
        loader.set_batch(indices)
        run()                     # the step, eager or replayed, calls loader.batch()

Two modes, chosen once, give bitwise identical batches:

* **resident** (when the images fit): the uint8 images and the int64 labels are uploaded
  once; ``set_batch`` uploads the batch's indices into a fixed index buffer, and
  ``batch()`` gathers those rows on the device.
* **streaming** (when the images' bytes exceed ``max_device_bytes``): the host gathers the
  batch's uint8 rows (from ``dataset.images``, which may be a memory map) and uploads them
  into a fixed staging buffer of ``batch_size`` rows, which ``batch()`` reads through the
  fixed indices 0..B-1; the labels stay resident and are picked by the uploaded indices.

``data_on`` chooses: "auto" (default) resident if the images take at most
``max_device_bytes``, or with ``max_device_bytes=None`` at most half of the free device
memory that ``be.runtime.memory_info()`` reports (or when it reports none, 0); "device"
resident whatever that rule says (a ValueError when the images exceed the free memory);
"host" streaming. When streaming, ``plan(batches)`` hands the loader the indices of every step
to come, and a ``BatchStream`` (dptrain.data.stream) gathers them ahead in worker threads
into pinned buffers and copies them on a copy stream while the steps before run;
``set_batch`` then checks its indices against the plan and copies the gathered batch into
the staging buffer on the device; "auto" streams the same way when it does not choose
resident. Without a plan, streaming gathers and uploads in ``set_batch`` itself.
``close()`` stops the stream's threads.

With ``augment=True``, ``batch()`` also applies ``be.augment_crop_flip``: a random crop
with ``augment_pad`` pixels of padding and a horizontal flip, drawn per image and step on
the device from the loader's state, a device uint64 array [seed, counter] that the op
advances itself; so a replayed graph draws a new crop and flip each step, with no host
work. The padding is zeros after normalisation (the training set's mean pixel). Image b
of rank r of N is drawn as position r + N*b of the global batch, so N ranks augment
exactly as one process at the same global batch. ``gather()`` never augments.

With ``resample`` (a ``dptrain.data.augment.ResizedCrop``), the uint8 rows are resampled to
its size instead of only normalised: ``batch()`` through its ``train`` (random-resized-crop
and flip, its device state saved and restored as the augmentation's), ``gather()`` through
its ``view`` (resize + centre crop), in its dtype; ``input_shape`` is then its output's shape.

``gather(indices)`` serves evaluation: any number of indices, eagerly; in streaming mode
in chunks of at most ``batch_size`` rows through a staging buffer of its own, so it never
disturbs the training batch.

With ``layout`` (an InputLayout, dptrain.backend.input_layout: the one the model's
``input_layout`` names), ``batch()`` and ``gather()`` return their images laid out
channels-last as the model's stem convolution reads them, (B, H, (left + W + right) / group,
channels), the bits of ``be.to_channels_last`` of the NCHW batch; the step marks them so
(``F.laid_out``) and the stem skips its own pass. Plain batches are written so by
``be.gather_normalize(..., layout=)``, in the one pass that normalises them; the
augmentations write NCHW, and their result is laid out in a pass of its own.
"""
from __future__ import annotations

import math

import numpy as np

from dptrain.backend import input_layout
from dptrain.data.stream import DEFAULT_DEPTH, DEFAULT_WORKERS, BatchStream, check_depth

DATA_ON = ("auto", "device", "host")


def _positive_int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"DeviceLoader: {name} must be a positive integer, got {value!r}")
    return int(value)


def _source(images) -> str:
    """The file a memory map reads, for errors; else a description."""
    name = getattr(images, "filename", None)
    return str(name) if name else f"the images in memory ({type(images).__name__})"


def _normalisation(name, value, image_shape):
    """A scalar as float; per-channel values (one per channel of ``image_shape``) as a tuple
    of floats."""
    arr = np.asarray(value, np.float64)
    if arr.ndim == 0:
        return float(arr)
    channels = image_shape[0] if image_shape else 0
    if arr.shape != (channels,):
        raise ValueError(f"DeviceLoader: {name} must be a scalar or one value per channel "
                         f"({channels}), got shape {arr.shape}")
    return tuple(float(v) for v in arr)


class DeviceLoader:
    """Batches of a dataset on the device of backend ``be``, normalised to float32.

    ``dataset`` offers ``images`` uint8 (n, C, H, W), ``labels`` int (n,),
    ``num_classes``, ``mean`` and ``std`` (of [0,1]-scaled pixels: scalars, or one value
    per channel). ``augment``, ``augment_pad``, ``augment_seed`` and ``shard`` = (rank,
    world size) set up ``batch()``'s augmentation; ``data_on``, ``prefetch_depth`` and
    ``data_workers`` where the images live and how they stream (see the module's notes).
    ``dtype``: the batches' (float32, or the model's 16 bits: written so by the normalising
    pass, no cast after); a ``resample`` writes its own. ``layout``: the batches laid out for
    the model's stem (see the module's notes; the model's ``input_layout`` for the images
    ``input_shape`` in the dtype the batches come in), or None: NCHW.
    """

    def __init__(self, dataset, be, batch_size: int, max_device_bytes: int | None = None,
                 augment: bool = False, augment_pad: int = 4, augment_seed: int = 0,
                 shard: tuple = (0, 1), resample=None, data_on: str = "auto",
                 prefetch_depth: int = DEFAULT_DEPTH, data_workers: int = DEFAULT_WORKERS,
                 dtype=np.float32, layout=None):
        if data_on not in DATA_ON:
            raise ValueError(f"DeviceLoader: data_on must be one of {', '.join(DATA_ON)}, got "
                             f"{data_on!r}")
        self._depth, self._workers = check_depth(prefetch_depth, data_workers)
        self._data_on, self._stream = data_on, None
        self.be, self.dtype = be, np.dtype(dtype)
        self._batch_size = _positive_int("batch_size", batch_size)
        images, labels = dataset.images, np.asarray(dataset.labels)
        if images.dtype != np.uint8 or images.ndim != 4:
            raise ValueError(f"DeviceLoader: images must be uint8 (n, C, H, W), got "
                             f"{images.dtype} {tuple(images.shape)}")
        if labels.shape != (images.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"DeviceLoader: labels must be integers of shape "
                             f"({images.shape[0]},), got {labels.dtype} {labels.shape}")
        self._num_images = int(images.shape[0])
        self._image_shape = tuple(int(d) for d in images.shape[1:])
        self._num_classes = int(dataset.num_classes)
        self._mean = _normalisation("mean", dataset.mean, self._image_shape)
        self._std = _normalisation("std", dataset.std, self._image_shape)
        self._augment = bool(augment)
        if self._augment:
            if isinstance(augment_pad, bool) or not isinstance(augment_pad, (int, np.integer)) \
                    or augment_pad < 0:
                raise ValueError(f"DeviceLoader: augment_pad must be an integer >= 0, got "
                                 f"{augment_pad!r}")
            if len(self._image_shape) != 3:
                raise ValueError(f"DeviceLoader: augment needs images (n, C, H, W), got "
                                 f"{(self._num_images,) + self._image_shape}")
            self._augment_pad = int(augment_pad)
            self._shard = (int(shard[0]), int(shard[1]))
            self._augment_state = be.asarray(np.array([int(augment_seed) % 2**64, 0], np.uint64))
        self._resample = resample
        if resample is not None:
            if self._augment:
                raise ValueError("DeviceLoader: augment and resample exclude each other")
            self._augment, self._augment_state = resample.random, resample.state
        self._layout = None if layout is None else input_layout.checked(
            "DeviceLoader", layout, self.input_shape)
        self.nbytes = self._num_images * math.prod(self._image_shape)  # the images, uint8
        self._resident = self._choose(data_on, max_device_bytes)

        B = self._batch_size
        self._labels = be.asarray(labels.astype(np.int64, copy=False))
        self._indices = be.zeros((B,), np.int64)  # the batch's dataset indices (for labels)
        if self._resident:
            self._images = be.asarray(images)
            self._rows = self._indices  # rows of self._images: the dataset indices
        else:
            self._host_images = images
            self._host_rows = np.empty((B,) + self._image_shape, np.uint8)
            self._images = be.zeros((B,) + self._image_shape, np.uint8)  # the staging buffer
            self._rows = be.asarray(np.arange(B, dtype=np.int64))
            self._eval_images = self._eval_rows = None  # gather()'s staging, made on first use
        self._has_batch = False

    def _choose(self, data_on, max_device_bytes) -> bool:
        """Resident (True) or streaming, as `data_on` says."""
        if data_on == "host":
            return False
        if data_on == "auto":
            return self._fits(max_device_bytes)
        free = int(self.be.runtime.memory_info()[0])
        if free and self.nbytes > free:
            raise ValueError(f"--data-on device: the training images take "
                             f"{self.nbytes / 2**30:.2f} GiB, more than the "
                             f"{free / 2**30:.2f} GiB free on the device (use --data-on host "
                             f"or auto)")
        return True

    def _fits(self, max_device_bytes) -> bool:
        if max_device_bytes is not None:
            return self.nbytes <= max_device_bytes
        free = int(self.be.runtime.memory_info()[0])
        return free == 0 or self.nbytes <= free // 2

    # -- what the training loop reads
    @property
    def num_images(self) -> int:
        return self._num_images

    @property
    def image_shape(self) -> tuple:
        return self._image_shape

    @property
    def input_shape(self) -> tuple:
        """The shape (C, H, W) of one image of ``batch()``: the stored one, or the resampled
        one; before ``layout`` lays it out (``batch_shape`` is after)."""
        if self._resample is None:
            return self._image_shape
        return self._resample.output_shape(self._image_shape)

    @property
    def layout(self):
        """The InputLayout the batches come in, or None (NCHW)."""
        return self._layout

    def batch_shape(self, n: int) -> tuple:
        """The shape of ``batch()``'s images (n = batch_size) or of ``gather()``'s of n."""
        c, h, w = self.input_shape
        if self._layout is None:
            return (n, c, h, w)
        left, right, group, channels = self._layout
        return (n, h, (left + w + right) // group, channels)

    @property
    def num_classes(self) -> int:
        return self._num_classes

    @property
    def mean(self) -> float:
        return self._mean

    @property
    def std(self) -> float:
        return self._std

    @property
    def augment(self) -> bool:
        return self._augment

    def get_augment_state(self) -> np.ndarray:
        """The augmentation's [seed, counter] as host uint64 (2,) (reads the device)."""
        return np.array(self.be.to_numpy(self._augment_state), np.uint64)

    def set_augment_state(self, state) -> None:
        """Restore a state from ``get_augment_state`` (an upload, outside a captured step)."""
        self.be.runtime.upload_(self._augment_state, np.asarray(state, np.uint64).reshape(2))

    @property
    def resident(self) -> bool:
        return self._resident

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def data_on(self) -> str:
        return self._data_on

    @property
    def mode(self) -> str:
        """"resident", "streamed" (gathered ahead by the stream) or "staged" (gathered in
        set_batch)."""
        return "resident" if self._resident else "streamed" if self._stream else "staged"

    def plan(self, batches, first_step: int = 0) -> bool:
        """Hand over the indices of every step to come (an iterable of ``batch_size`` index
        arrays, in order; dptrain.data.stream.planned_batches), the first being training step
        `first_step` (0-based; for errors). When streaming (``data_on`` "host", or "auto"
        that did not choose resident) they are gathered ahead from now on and ``set_batch``
        must follow them; a resident loader ignores them. True when the stream runs."""
        self.close()
        if self._resident:
            return False
        self._stream = BatchStream(self._host_images, self.be, self._batch_size, batches,
                                   self._depth, self._workers, _source(self._host_images),
                                   first_step)
        return True

    def close(self) -> None:
        """Stop the stream's threads (if any); set_batch gathers in place again."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.close()

    def __repr__(self) -> str:
        mode = "resident" if self._resident else "streaming"
        return (f"DeviceLoader({mode}, {self._num_images} images of "
                f"{'x'.join(map(str, self._image_shape))}, batch_size={self._batch_size})")

    # -- host side
    def _check_indices(self, where: str, host_indices, length: int | None) -> np.ndarray:
        idx = np.asarray(host_indices)
        if idx.ndim != 1 or (length is not None and idx.shape[0] != length):
            want = f"{length} indices (its batch_size)" if length is not None else "1-D indices"
            raise ValueError(f"{self!r}.{where}: expected {want}, got an array of shape "
                             f"{idx.shape}")
        if idx.size == 0:
            return idx.astype(np.int64)
        if not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"{self!r}.{where}: indices must be integers, got {idx.dtype}")
        low, high = int(idx.min()), int(idx.max())
        if low < 0 or high >= self._num_images:
            raise ValueError(f"{self!r}.{where}: indices must lie in [0, {self._num_images}), "
                             f"got values from {low} to {high}")
        return np.ascontiguousarray(idx, dtype=np.int64)

    def set_batch(self, host_indices) -> None:
        """Choose the next batch: ``batch_size`` dataset indices (host data, checked here).

        Host work and asynchronous uploads only; the host arrays may change at once."""
        idx = self._check_indices("set_batch", host_indices, self._batch_size)
        upload = self.be.runtime.upload_
        if self._stream is not None:
            self._stream.take_into(self._images, idx)
        elif not self._resident:
            # mode="clip" skips a buffered bounds check: the indices were checked above.
            np.take(self._host_images, idx, axis=0, out=self._host_rows, mode="clip")
            upload(self._images, self._host_rows)
        upload(self._indices, idx)
        self._has_batch = True

    # -- device side
    def batch(self):
        """``(x, y)`` of the batch the last ``set_batch`` chose: x (B, C, H, W) normalised, in
        the loader's dtype (laid out where the loader has a layout: ``batch_shape``), y int64
        (B,). Device work only, on buffers that never move: safe to record in a CUDA graph
        and replay after later ``set_batch`` calls."""
        if not self._has_batch:
            raise RuntimeError(f"{self!r}.batch: no batch chosen yet; call set_batch first")
        x = self._normalise(self._images, self._rows, train=True)
        y = self.be.getitem(self._labels, self._indices)
        return x, y

    def _normalise(self, images, rows, train: bool):
        """Rows of uint8 images as the model reads them: normalised in the loader's dtype,
        resampled by ``resample`` or (training) augmented, in the loader's layout."""
        if self._resample is not None:
            view = self._resample.train if train else self._resample.view
            return self._lay_out(view(images, rows, self._mean, self._std))
        if train and self._augment:
            x = self.be.gather_normalize(images, rows, self._mean, self._std, self.dtype)
            return self._lay_out(self.be.augment_crop_flip(x, self._augment_state,
                                                           self._augment_pad, *self._shard))
        return self.be.gather_normalize(images, rows, self._mean, self._std, self.dtype,
                                        layout=self._layout)

    def _lay_out(self, x):
        """An augmentation's NCHW batch in the loader's layout: a pass of its own."""
        if self._layout is None:
            return x
        left, right, group, channels = self._layout
        return self.be.to_channels_last(x, group, left, right, channels)

    def gather(self, host_indices):
        """``(x, y)`` for any number of dataset indices (evaluation), eagerly."""
        be = self.be
        idx = self._check_indices("gather", host_indices, None)
        if self._resident or idx.size == 0:
            device_idx = be.asarray(idx)
            return (self._normalise(self._images, device_idx, train=False),
                    be.getitem(self._labels, device_idx))
        if self._eval_images is None:
            B = self._batch_size
            self._eval_host = np.empty((B,) + self._image_shape, np.uint8)
            self._eval_images = be.zeros((B,) + self._image_shape, np.uint8)
            self._eval_rows = be.asarray(np.arange(B, dtype=np.int64))
        xs, ys = [], []
        for start in range(0, idx.size, self._batch_size):
            part = idx[start:start + self._batch_size]
            k = part.size
            # The staging buffer is uploaded whole; rows past k keep stale data, unread.
            np.take(self._host_images, part, axis=0, out=self._eval_host[:k], mode="clip")
            be.runtime.upload_(self._eval_images, self._eval_host)
            rows = self._eval_rows if k == self._batch_size else be.asarray(
                np.arange(k, dtype=np.int64))
            xs.append(self._normalise(self._eval_images, rows, train=False))
            ys.append(be.getitem(self._labels, be.asarray(part)))
        if len(xs) == 1:
            return xs[0], ys[0]
        return be.concatenate(xs, 0), be.concatenate(ys, 0)  # the batch axis, laid out or not
