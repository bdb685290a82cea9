"""Your own images: one subfolder per class, as torchvision's ImageFolder reads them.

    DIR/cat/0001.png   DIR/cat/more/0002.jpg   DIR/dog/a.webp ...

Classes are the subfolders' names sorted (so label i is the i-th name); files may sit in
nested folders below their class folder. PNG, JPEG, BMP, GIF (first frame) and WebP files
are read (by extension, case-insensitive; other files and hidden ones are ignored). When
``DIR/train`` and ``DIR/val`` (or ``DIR/test``) exist, they are the two splits, each with
the same class folders; otherwise ``--val-fraction`` of DIR is held out.

``--channels 1`` reads grayscale, ``3`` RGB (alpha dropped); by default grayscale when every
image is grey, else RGB. Images must share one size unless ``--image-size S`` is given,
which resizes every image to S x S (bilinear).

Hostile input: Pillow opens only the five formats above; an image of more than
``MAX_PIXELS`` pixels (a decompression bomb) is refused from its header, before decoding;
truncated, zero-byte and non-image files are bad images. With ``--on-bad-image error`` (the
default) the first bad file (in sorted order) ends the run with a one-line error naming it;
with ``skip`` bad files are left out, counted and reported. An empty class folder or a
folder with no images is an error, and so is a single class folder (nothing to tell apart).
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dptrain.data.formats.common import Decoded, report
from dptrain.data.parallel import default_workers
from dptrain.errors import UsageError

NAME = "imagefolder"
VERSION = 1
EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
PIL_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "WEBP")
MAX_PIXELS = 1 << 26  # 64 Mpixel, e.g. 8192 x 8192: far above any training image
GRAY_MODES = ("L", "1")


def split_dirs(data_dir: str):
    """(train folder, val folder or None)."""
    if not os.path.isdir(data_dir):
        raise UsageError(f"--data-dir {data_dir}: not a directory (imagefolder needs one "
                         f"subfolder per class)")
    train = os.path.join(data_dir, "train")
    for name in ("val", "test"):
        val = os.path.join(data_dir, name)
        if os.path.isdir(train) and os.path.isdir(val):
            return train, val
    return data_dir, None


def _images_under(folder: str) -> list[str]:
    """Image files below ``folder`` in torchvision's order: folders sorted by path, files
    sorted by name within each (hidden ones skipped; symbolic links to folders not followed)."""
    found = []
    walk = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        walk.append((root, files))
    for root, files in sorted(walk):
        found.extend(os.path.join(root, f) for f in sorted(files)
                     if not f.startswith(".") and f.lower().endswith(EXTENSIONS))
    return found


def scan(root: str, classes=None):
    """(class names, [(path, label)]) of a split folder; ``classes`` given: the training
    split's, which this folder's class folders must be among."""
    names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not names:
        raise UsageError(f"{root}: no class folders (imagefolder needs one subfolder per class)")
    if classes is None:
        if len(names) < 2:  # it would learn to say "yes" and report a perfect accuracy
            raise UsageError(f"{root}: one class folder ({names[0]!r}); a classifier needs "
                             "at least two (one subfolder per class)")
        classes = names
    index = {name: i for i, name in enumerate(classes)}
    items = []
    for name in names:
        folder = os.path.join(root, name)
        if name not in index:
            raise UsageError(f"{folder}: class {name!r} is not among the training classes")
        files = _images_under(folder)
        if not files:
            raise UsageError(f"{folder}: empty class folder (no {'/'.join(EXTENSIONS)} files)")
        items.extend((path, index[name]) for path in files)
    return tuple(classes), items


def sources(data_dir: str) -> list[str]:
    train_dir, val_dir = split_dirs(data_dir)
    classes, items = scan(train_dir)
    if val_dir is not None:
        items += scan(val_dir, classes)[1]
    return [path for path, _ in items]


class BadImage(Exception):
    pass


@contextlib.contextmanager
def _opened(path: str):
    """The image at `path`, opened and its size checked; any failure while it is read (a
    hostile file) is one BadImage with the reason."""
    from PIL import Image

    try:
        with Image.open(path, formats=PIL_FORMATS) as im:
            w, h = im.size
            if w * h > MAX_PIXELS or w <= 0 or h <= 0:
                raise BadImage(f"{w}x{h} pixels exceeds the limit of {MAX_PIXELS} "
                               f"(a decompression bomb?)")
            yield im
    except BadImage:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of a hostile file is a bad image
        text = str(err) or type(err).__name__
        if os.path.exists(path) and os.path.getsize(path) == 0:
            text = "empty file"
        raise BadImage(text) from None


def read_image(path: str, channels, size):
    """One image as uint8 (H, W) when grey or (H, W, 3), resized to ``size`` when given.

    ``channels``: 1 -> grey, 3 -> RGB, None -> grey if the image is grey, else RGB.
    BadImage (with the reason) for anything that is not a readable image of the allowed
    formats and size."""
    from PIL import Image

    with _opened(path) as im:
        im.load()
        if channels == 1 or (channels is None and im.mode in GRAY_MODES):
            im = im.convert("L")
        else:
            im = im.convert("RGB")
        if size is not None and im.size != (size[1], size[0]):
            im = im.resize((size[1], size[0]), Image.BILINEAR)
        arr = np.asarray(im, np.uint8)
    if channels is None and arr.ndim == 3 and (arr[..., 0] == arr[..., 1]).all() \
            and (arr[..., 0] == arr[..., 2]).all():
        arr = np.ascontiguousarray(arr[..., 0])  # RGB with equal channels: grey
    return arr


def _decode_files(paths, channels, image_size, on_bad_image):
    """(images uint8 (n, C, H, W), kept rows, bad [(path, reason)]) of ``paths``."""
    n = len(paths)
    size = None if image_size is None else (image_size, image_size)
    bad = []
    first = 0
    while size is None and first < n:  # the size of the first readable image sets the size
        try:
            size = read_image(paths[first], channels, None).shape[:2]
        except BadImage as err:
            bad.append((first, str(err)))
            if on_bad_image == "error":
                break
            first += 1
    gray = np.zeros((n,) + (size or (0, 0)), np.uint8)
    color = {}

    def work(i):
        try:
            arr = read_image(paths[i], channels, size if image_size is not None else None)
        except BadImage as err:
            return i, str(err)
        if arr.shape[:2] != tuple(size):
            return i, ("size", arr.shape[:2])
        if arr.ndim == 2:
            gray[i] = arr
        else:
            color[i] = arr
        return i, None

    if size is not None and not (bad and on_bad_image == "error"):
        with ThreadPoolExecutor(max(1, min(default_workers(), 16))) as pool:
            for i, problem in pool.map(work, range(first, n), chunksize=64):
                if isinstance(problem, tuple):
                    h, w = problem[1]
                    raise UsageError(
                        f"{paths[i]}: {w}x{h} pixels, but {paths[0]} is "
                        f"{size[1]}x{size[0]}; pass --image-size S to resize all images to SxS")
                if problem is not None:
                    bad.append((i, problem))
    bad.sort()
    if bad and on_bad_image == "error":
        i, reason = bad[0]
        raise UsageError(f"{paths[i]}: not a readable image ({reason}); --on-bad-image skip "
                         f"leaves such files out")
    keep = np.setdiff1d(np.arange(n), [i for i, _ in bad]).astype(np.int64)
    if channels == 3 or (channels is None and color):
        images = np.repeat(gray[:, None], 3, axis=1)
        for i, arr in color.items():
            images[i] = arr.transpose(2, 0, 1)
    else:
        images = gray[:, None]
    return images[keep], keep, [(paths[i], reason) for i, reason in bad]


def decode(data_dir: str, channels=None, image_size=None, on_bad_image="error") -> Decoded:
    train_dir, val_dir = split_dirs(data_dir)
    classes, items = scan(train_dir)
    splits = [items] + ([scan(val_dir, classes)[1]] if val_dir is not None else [])
    paths = [p for part in splits for p, _ in part]
    labels = np.array([label for part in splits for _, label in part], np.int64)
    images, keep, bad = _decode_files(paths, channels, image_size, on_bad_image)
    for path, reason in bad[:10]:
        report(f"skipping {path}: not a readable image ({reason})")
    if len(bad) > 10:
        report(f"... and {len(bad) - 10} more unreadable images skipped")
    if len(keep) == 0:
        raise UsageError(f"{data_dir}: no readable images (the dataset is empty)")
    labels = labels[keep]
    n_train = int(np.searchsorted(keep, len(splits[0])))
    train = (np.ascontiguousarray(images[:n_train]), labels[:n_train])
    val = None
    if val_dir is not None:
        val = (np.ascontiguousarray(images[n_train:]), labels[n_train:])
        if len(val[1]) == 0:
            raise UsageError(f"{val_dir}: no readable images (the validation split is empty)")
    if n_train == 0:
        raise UsageError(f"{train_dir}: no readable images (the dataset is empty)")
    return Decoded(train, val, classes, skipped=len(bad))


# ----------------------------------------------------------------------------- big folders
# `data pack --max-size S`: every image's shorter side resized to S (Pillow's bilinear, which
# filters when it shrinks), then its centre S x S square kept; decoded by worker processes
# (decoding holds the GIL) in chunks of fixed size, so the output does not depend on how many.

def read_square(path: str, channels: int, side: int) -> np.ndarray:
    """uint8 (C, side, side): the image's shorter side resized to ``side``, the centre
    square kept. BadImage as ``read_image``."""
    from PIL import Image

    with _opened(path) as im:
        im.draft("L" if channels == 1 else "RGB", (side, side))  # JPEG: decode smaller
        im = im.convert("L" if channels == 1 else "RGB")
        w, h = im.size
        scale = side / min(w, h)
        nw, nh = max(side, round(w * scale)), max(side, round(h * scale))
        if (nw, nh) != (w, h):
            im = im.resize((nw, nh), Image.BILINEAR)
        left, top = (nw - side) // 2, (nh - side) // 2
        arr = np.asarray(im.crop((left, top, left + side, top + side)), np.uint8)
    return arr[None] if arr.ndim == 2 else np.ascontiguousarray(arr.transpose(2, 0, 1))


def first_channels(paths) -> int:
    """1 when the first readable image is grey, else 3 (--max-size's default --channels)."""
    from PIL import Image

    for path in paths:
        try:
            with Image.open(path, formats=PIL_FORMATS) as im:
                return 1 if im.mode in GRAY_MODES else 3
        except Exception:  # noqa: BLE001 - a bad file is judged when it is decoded
            continue
    return 3


def worker_init() -> None:
    """A decoding process leaves Ctrl-C to its parent, which stops the pool and cleans up."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def decode_squares(job) -> tuple:
    """A worker's chunk: job = (paths, channels, side) -> (images uint8 (k, C, S, S) of the
    readable ones, [(position in the chunk, reason)] of the others)."""
    paths, channels, side = job
    images, bad = [], []
    for i, path in enumerate(paths):
        try:
            images.append(read_square(path, channels, side))
        except BadImage as err:
            bad.append((i, str(err)))
    shape = (len(images), channels, side, side)
    return (np.stack(images) if images else np.zeros(shape, np.uint8)), bad
