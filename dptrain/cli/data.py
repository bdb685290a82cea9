"""``python -m dptrain data pack|info|synth``: make and inspect packed datasets.

    data pack SRC OUT       any dataset (an image folder, the MNIST/CIFAR-10 files, the
                            FER-2013 CSV) to the packed format (dptrain/data/formats/packed.py)
    data pack --max-size S FOLDER OUT   a big image folder, decoded by all CPUs (processes),
                            each image's shorter side resized to S and its centre SxS kept
    data info PACKED        what a packed dataset holds (--verify: check every file's SHA-256)
    data synth --images N OUT   the synthetic shapes, generated over all CPUs, packed
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from dptrain.errors import UsageError


def detect_format(src: str) -> str:
    """The dataset format of a path: a .csv file is FER-2013; a folder is a packed dataset
    (header.json), MNIST (IDX files), CIFAR-10 (its batches), else an image folder."""
    from dptrain.data.formats import cifar10, mnist, packed

    if os.path.isfile(src):
        if src.lower().endswith(".csv"):
            return "fer2013"
        if os.path.basename(src) == packed.HEADER:
            return "packed"
        raise UsageError(f"{src}: cannot tell the dataset format of this file; pass --dataset")
    if not os.path.isdir(src):
        raise UsageError(f"{src}: no such file or directory")
    if os.path.isfile(os.path.join(src, packed.HEADER)):
        return "packed"
    for name, module in (("mnist", mnist), ("cifar10", cifar10)):
        try:
            module.sources(src)
            return name
        except UsageError:
            pass
    if os.path.isfile(os.path.join(src, "fer2013.csv")):
        return "fer2013"
    return "imagefolder"


class _Bar:
    """A progress bar of images: tqdm when installed and stderr is a terminal, else a line
    now and then (a log file gets no carriage-return frames)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.last, self.start = total, desc, 0.0, time.monotonic()
        try:
            if not sys.stderr.isatty():
                raise ImportError
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="img", unit_scale=True,
                            file=sys.stderr, mininterval=0.5)
        except ImportError:
            self.bar = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
        elif time.monotonic() - self.last > 2 or done == total:
            elapsed = time.monotonic() - self.start
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = f", ETA {(total - done) / rate:.0f} s" if 0 < rate and done < total else ""
            print(f"{self.desc}: {done}/{total} images, {rate:,.0f} images/s{eta}",
                  file=sys.stderr, flush=True)
            self.last = time.monotonic()
        self.done = done

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _check_out(out: str, overwrite: bool = False) -> None:
    """OUT can take a packed set: new, empty, or (with --overwrite) a packed set to replace."""
    from dptrain.data.formats import packed

    if os.path.isfile(out):
        raise UsageError(f"{out}: is a file; OUT must be a directory (new, empty or packed)")
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.isfile(os.path.join(out, packed.HEADER)):
            raise UsageError(f"{out}: exists and is not empty (nor a packed dataset to replace)")
        if not overwrite:
            raise UsageError(f"{out}: holds a packed dataset already; --overwrite replaces it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out) and not os.path.isdir(parent):
        raise UsageError(f"{out}: the parent directory {parent} is missing")
    if not os.access(parent if not os.path.isdir(out) else out, os.W_OK):
        raise UsageError(f"{out}: not writable")


def _parser():
    from dptrain.cli.argtypes import Parser as _Parser
    from dptrain.cli.argtypes import non_negative_float as _non_negative_float
    from dptrain.cli.argtypes import positive_int as _positive_int

    p = _Parser(prog="python -m dptrain data", description="Make and inspect packed datasets.")
    sub = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    pack = sub.add_parser("pack", help="convert a dataset to the packed format",
                          description="Decode a dataset once into the packed format: uint8 "
                          "(N, C, H, W) images, int64 labels, class names and per-channel "
                          "mean/std, memory-mapped by training (--dataset packed --data-dir OUT).")
    pack.add_argument("src", metavar="SRC", help="the dataset's files (folder or CSV)")
    pack.add_argument("out", metavar="OUT", help="the packed dataset's directory")
    pack.add_argument("--dataset", default=None,
                      choices=("imagefolder", "mnist", "cifar10", "fer2013", "packed"),
                      help="SRC's format (default: detected)")
    pack.add_argument("--channels", type=int, default=None, choices=(1, 3),
                      help="1: grayscale, 3: RGB (default: SRC's own)")
    pack.add_argument("--image-size", type=_positive_int, default=None, metavar="S",
                      help="resize images to SxS (needed when an image folder mixes sizes)")
    pack.add_argument("--max-size", type=_positive_int, default=None, metavar="S",
                      help="an image folder of any sizes: each image's shorter side resized "
                      "to S, its centre SxS square stored (decoded by --workers processes); "
                      "train with --augment random-resized-crop --image-size")
    pack.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                      help="--max-size: decoding processes (default: the CPUs this process "
                      "may use)")
    pack.add_argument("--val-fraction", type=_non_negative_float, default=0.1,
                      help="held out as the val split when SRC has no test split")
    pack.add_argument("--seed", type=int, default=0, help="seeds the --val-fraction split")
    pack.add_argument("--on-bad-image", default="error", choices=("error", "skip"),
                      help="an unreadable image file: stop with its name, or skip it (counted)")
    pack.add_argument("--cache-dir", default=None,
                      help="where decoded datasets are cached (default $DPTRAIN_CACHE or "
                      "~/.cache/dptrain)")
    pack.add_argument("--overwrite", action="store_true",
                      help="replace a packed dataset already in OUT")
    info = sub.add_parser("info", help="describe a packed dataset",
                          description="Describe a packed dataset: its images, classes, image "
                          "shape and splits; --verify also checks its files against their "
                          "recorded SHA-256.")
    info.add_argument("path", metavar="PACKED", help="a packed dataset's directory (a `data "
                      "pack` or `data synth` output)")
    info.add_argument("--verify", action="store_true", help="check every file's SHA-256")
    synth = sub.add_parser("synth", help="write the synthetic shapes as a packed dataset",
                           description="Generate the built-in 48x48 shapes over all CPUs "
                           "and write them packed.")
    synth.add_argument("out", metavar="OUT", help="the packed dataset's directory")
    synth.add_argument("--overwrite", action="store_true",
                       help="replace a packed dataset already in OUT")
    synth.add_argument("--images", type=_positive_int, required=True, metavar="N",
                       help="training images")
    synth.add_argument("--val-images", type=int, default=None, metavar="M",
                       help="validation images (default N/10, at least 1)")
    synth.add_argument("--seed", type=int, default=0,
                       help="seeds the images drawn (as train --seed does for --dataset "
                       "synthetic)")
    synth.add_argument("--workers", type=_positive_int, default=None,
                       help="worker processes (default: the CPUs this process may use)")
    return p


def pack(args) -> int:
    from dptrain.data import get_dataset
    from dptrain.data.formats import packed

    kind = args.dataset or detect_format(args.src)
    _check_out(args.out, args.overwrite)
    if os.path.abspath(args.src) == os.path.abspath(args.out):
        raise UsageError(f"{args.out}: OUT must differ from SRC")
    if args.max_size is not None or args.workers is not None:
        return pack_squares(args, kind)
    options = dict(data_dir=args.src, channels=args.channels, image_size=args.image_size,
                   val_fraction=args.val_fraction, on_bad_image=args.on_bad_image)
    start = time.perf_counter()
    sets = {split: get_dataset(kind, split, None, args.seed, args.cache_dir, **options)
            for split in ("train", "val")}
    train = sets["train"]
    header = packed.write(args.out, {s: (d.images, d.labels) for s, d in sets.items()},
                          train.class_names, train.mean, train.std,
                          source=f"{kind}:{os.path.abspath(args.src)}")
    counts = ", ".join(f"{s} {v['count']}" for s, v in header["splits"].items())
    print(f"packed {kind} {args.src} -> {args.out}: {counts} images of "
          f"{'x'.join(map(str, header['image_shape']))}, {len(train.class_names)} classes "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


CHUNK = 64  # images per decoding job: fixed, so the store never depends on --workers


def _check_squares(args, kind) -> None:
    if args.max_size is None:
        raise UsageError(f"--workers {args.workers}: only with --max-size S")
    if kind != "imagefolder":
        raise UsageError(f"--max-size {args.max_size}: {args.src} is {kind}; --max-size packs "
                         f"an image folder (use --image-size for the other formats)")
    if args.image_size is not None:
        raise UsageError(f"--max-size {args.max_size} and --image-size {args.image_size}: give "
                         f"one of them")
    if args.max_size > 4096:
        raise UsageError(f"--max-size {args.max_size}: must be at most 4096")


def _pack_split(writer, pool, folder, split, items, channels, side, on_bad_image, counts):
    """Decode one split into the writer in CHUNK-image jobs, in order; adds the pixel
    histogram to ``counts`` (training split only). Returns how many were skipped."""
    from dptrain.data.formats import imagefolder

    paths = [p for p, _ in items]
    labels = np.array([label for _, label in items], np.int64)
    images = writer.split(split, len(paths), (channels, side, side))
    jobs = [(paths[i:i + CHUNK], channels, side) for i in range(0, len(paths), CHUNK)]
    decoded = pool.imap(imagefolder.decode_squares, jobs) if pool else map(
        imagefolder.decode_squares, jobs)
    bar, row, keep, bad = _Bar(len(paths), f"pack {split}"), 0, [], []
    try:
        for k, (chunk, chunk_bad) in enumerate(decoded):
            start, skipped = k * CHUNK, {i for i, _ in chunk_bad}
            bad += [(paths[start + i], reason) for i, reason in chunk_bad]
            if bad and on_bad_image == "error":
                raise UsageError(f"{bad[0][0]}: not a readable image ({bad[0][1]}); "
                                 f"--on-bad-image skip leaves such files out")
            images[row:row + len(chunk)] = chunk
            row += len(chunk)
            keep += [start + i for i in range(len(jobs[k][0])) if i not in skipped]
            if counts is not None:
                for ch in range(channels):
                    counts[ch] += np.bincount(chunk[:, ch].reshape(-1), minlength=256)
            bar(start + len(jobs[k][0]), len(paths))
    finally:
        bar.close()
    for path, reason in bad[:10]:
        print(f"dptrain: skipping {path}: not a readable image ({reason})", file=sys.stderr)
    if row == 0:
        raise UsageError(f"{folder}: no readable images (the {split} split is empty)")
    if row < len(paths):
        writer.truncate(split, row)
    writer.labels(split, labels[keep])
    return len(bad)


def pack_squares(args, kind) -> int:
    """`data pack --max-size S`: an image folder decoded by processes straight into the
    store's memory maps, written atomically (dptrain.data.formats.packed.Writer)."""
    import multiprocessing

    from dptrain.data.formats import imagefolder, packed
    from dptrain.data.parallel import default_workers

    _check_squares(args, kind)
    train_dir, val_dir = imagefolder.split_dirs(args.src)
    classes, items = imagefolder.scan(train_dir)
    splits = {"train": (train_dir, items)}
    if val_dir is not None:
        splits["val"] = (val_dir, imagefolder.scan(val_dir, classes)[1])
    side = args.max_size
    channels = args.channels or imagefolder.first_channels(p for p, _ in items)
    workers = min(args.workers or default_workers(), max(1, -(-len(items) // CHUNK)))
    counts = np.zeros((channels, 256), np.int64)
    start, skipped = time.perf_counter(), 0
    pool = (multiprocessing.get_context("spawn").Pool(workers, imagefolder.worker_init)
            if workers > 1 else None)
    try:
        with packed.Writer(args.out) as writer:
            for split, (folder, part) in splits.items():
                skipped += _pack_split(writer, pool, folder, split, part, channels, side,
                                       args.on_bad_image, counts if split == "train" else None)
            levels = np.arange(256, dtype=np.float64) / 255.0
            total = counts.sum(axis=1)
            mean = counts @ levels / total
            std = np.sqrt(np.maximum(counts @ (levels * levels) / total - mean * mean, 0.0))
            std[std == 0] = 1.0
            header = writer.commit(classes, mean, std, f"{kind}:{os.path.abspath(args.src)}",
                                   stored={"layout": "center-square", "max_size": side})
    finally:
        if pool is not None:
            pool.terminate()
    n = sum(v["count"] for v in header["splits"].values())
    seconds = time.perf_counter() - start
    counts = ", ".join(f"{s} {v['count']}" for s, v in header["splits"].items())
    print(f"packed {kind} {args.src} -> {args.out}: {counts} images of "
          f"{channels}x{side}x{side}, {len(classes)} classes, {skipped} skipped "
          f"({seconds:.1f} s, {n / seconds:,.0f} images/s, {workers} workers)")
    return 0


def info(args) -> int:
    from dptrain.data.formats import packed

    header = packed.read_header(args.path)
    shape = "x".join(map(str, header["image_shape"]))
    names = header["class_names"]
    print(f"{args.path}: dptrain packed dataset v{header['version']}")
    print(f"  images:  {shape} uint8 (C x H x W)")
    stored = header.get("stored")
    if stored:
        print(f"  stored:  shorter side resized to {stored['max_size']}, the centre square "
              f"kept (data pack --max-size)")
    print(f"  classes: {len(names)}: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}")
    print(f"  mean:    {', '.join(f'{v:.4f}' for v in header['mean'])}")
    print(f"  std:     {', '.join(f'{v:.4f}' for v in header['std'])}")
    if header.get("source"):
        print(f"  source:  {header['source']}")
    total = sum(e["images"]["bytes"] + e["labels"]["bytes"] for e in header["splits"].values())
    print(f"  bytes:   {total:,} ({total / 2**30:.2f} GiB) in "
          f"{sum(e['count'] for e in header['splits'].values())} images")
    for split, entry in header["splits"].items():
        nbytes = entry["images"]["bytes"] + entry["labels"]["bytes"]
        print(f"  {split + ':':<8} {entry['count']} images, {nbytes:,} bytes "
              f"({nbytes / 2**20:.1f} MiB)")
        if args.verify:
            images, labels, _ = packed.load_split(args.path, split, verify=True)
            counts = np.bincount(labels, minlength=len(names))
            print(f"           SHA-256 verified; per class: {' '.join(map(str, counts))}")
    return 0


def synth(args) -> int:
    from dptrain.data.formats import packed
    from dptrain.data.formats.common import channel_stats
    from dptrain.data.parallel import default_workers
    from dptrain.data.synthetic import CLASSES, generate_parallel, split_seed

    _check_out(args.out, args.overwrite)
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be >= 0")
    n_val = args.val_images if args.val_images is not None else max(1, args.images // 10)
    if n_val < 0:
        raise UsageError(f"--val-images {n_val}: must be >= 0")
    workers = args.workers or default_workers()
    start = time.perf_counter()
    splits = {}
    for split, n in (("train", args.images), ("val", n_val)):
        if n == 0:
            continue
        bar = _Bar(n, f"synth {split}")
        try:
            splits[split] = generate_parallel(split_seed(args.seed, split), np.arange(n),
                                              workers, progress=bar)
        finally:
            bar.close()
    mean, std = channel_stats(splits["train"][0])
    packed.write(args.out, splits, CLASSES, mean, std,
                 source=f"synthetic:seed{args.seed}")
    seconds = time.perf_counter() - start
    print(f"wrote {args.images} + {n_val} synthetic images to {args.out} in {seconds:.1f} s "
          f"({(args.images + n_val) / seconds:,.0f} images/s, {workers} workers)")
    return 0


def main(argv) -> int:
    args = _parser().parse_args(argv)
    return {"pack": pack, "info": info, "synth": synth}[args.action](args)
