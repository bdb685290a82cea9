"""Generate the synthetic shapes dataset into the on-disk cache, ahead of training.

Training finds the cached arrays by (spec, seed, split, size), so running this once
before `mpirun` saves every rank from generating (or racing to generate) the set.
``--preview`` writes a PNG grid of examples, one row per class (stdlib only).

    python datasets/make_synthetic.py --train 1000000 --val 50000 --preview shapes.png
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import time
import zlib

import numpy as np

try:
    import dptrain  # noqa: F401
except ImportError:  # run from a source checkout without installing: use the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dptrain.data.cache import default_cache_dir
from dptrain.data.parallel import default_workers
from dptrain.data.synthetic import (CLASSES, DEFAULT_SPEC, SIZE, SyntheticDataset,
                                    SyntheticSpec, generate, split_seed)


def write_png(path: str, gray: np.ndarray) -> None:
    """A 2-D uint8 array as an 8-bit grayscale PNG (stdlib only: zlib + struct)."""
    gray = np.ascontiguousarray(gray, np.uint8)
    h, w = gray.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), gray], axis=1).tobytes()  # filter 0

    def chunk(tag, data):
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


def preview(path: str, per_class: int = 8, seed: int = 0, spec: SyntheticSpec = DEFAULT_SPEC,
            scale: int = 2) -> np.ndarray:
    """Write a PNG grid, one row per class (in ``CLASSES`` order), of training images;
    returns the grid."""
    classes = len(CLASSES)
    need = per_class * classes * 3  # labels are balanced per block of 7: enough rows
    images, labels = generate(split_seed(seed, "train"), np.arange(need), spec)
    pad = 2
    cell = SIZE + pad
    grid = np.full((classes * cell + pad, per_class * cell + pad), 255, np.uint8)
    for c in range(classes):
        for j, i in enumerate(np.flatnonzero(labels == c)[:per_class]):
            grid[pad + c * cell: pad + c * cell + SIZE,
                 pad + j * cell: pad + j * cell + SIZE] = images[i, 0]
    grid = grid.repeat(scale, 0).repeat(scale, 1)
    write_png(path, grid)
    return grid


def progress_printer(label: str):
    start = time.perf_counter()

    def show(done: int, total: int) -> None:
        rate = done / max(time.perf_counter() - start, 1e-9)
        end = "\n" if done == total else ""
        print(f"\r{label}: {done}/{total} images ({100 * done / total:.0f}%), "
              f"{rate:,.0f} images/s", end=end, file=sys.stderr, flush=True)
    return show


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Generate and cache the synthetic 48x48 shapes dataset (7 classes). "
                    "Images are a pure function of (seed, split, index), so the cache can "
                    "always be rebuilt; a cached set also serves any smaller size.")
    parser.add_argument("--train", type=int, default=100_000, metavar="N",
                        help="training images to generate (default: %(default)s; 0 skips)")
    parser.add_argument("--val", type=int, default=10_000, metavar="N",
                        help="validation images to generate (default: %(default)s; 0 skips)")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument("--cache-dir", default=None,
                        help=f"where the .npy files go (default: $DPTRAIN_CACHE or "
                             f"~/.cache/dptrain; here {default_cache_dir()})")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="worker processes (default: the CPUs this process may use, "
                             "%(default)s)")
    parser.add_argument("--preview", metavar="PNG", default=None,
                        help="also write a grid of examples, one row per class, to this PNG")
    args = parser.parse_args(argv)
    if args.train < 0 or args.val < 0:
        parser.error("--train and --val must be >= 0")

    for split, n in (("train", args.train), ("val", args.val)):
        if n == 0:
            continue
        start = time.perf_counter()
        data = SyntheticDataset(split, n, seed=args.seed, cache_dir=args.cache_dir,
                                workers=args.workers, progress=progress_printer(split))
        seconds = time.perf_counter() - start
        how = "loaded from the cache" if data.from_cache else "generated and cached"
        print(f"{split}: {len(data)} images {how} in {seconds:.1f} s "
              f"({len(data) / seconds:,.0f} images/s)")
    if args.preview:
        preview(args.preview)
        print(f"preview written to {args.preview}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
