"""`python -m dptrain eval --load W.npz --dataset NAME`: accuracy, loss, per-class accuracy and
the confusion matrix of a weights file on a dataset split; `--out` writes them as JSON.

The model's name, the input normalisation and how the data was read (its files, channels,
image size, validation share and seed) come from the weights file when it carries them
(files saved by `train --save` do); flags override them and fill in for older files. A
dataset read from files is evaluated whole unless `--images` asks for fewer. Any dataset registered in
``dptrain.data.DATASETS`` works; class names come from the dataset when it has them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dptrain.errors import UsageError


def parser() -> argparse.ArgumentParser:
    from dptrain.cli.argtypes import HelpFormatter, Parser
    from dptrain.cli.argtypes import non_negative_float as non_negative_float_arg
    from dptrain.cli.argtypes import non_negative_int as non_negative_int_arg
    from dptrain.cli.argtypes import positive_int as positive_int_arg
    from dptrain.cli.argtypes import widths
    from dptrain.data import DATASETS
    from dptrain.cli.train import model_name
    from dptrain.run.config import DEVICE_DEFAULTS

    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
    p = Parser(prog="python -m dptrain eval", formatter_class=HelpFormatter,
               description="Evaluate a weights file on a dataset split: accuracy, loss, "
               "per-class accuracy and the confusion matrix.")
    p.add_argument("--load", required=True, metavar="PATH", help="weights (.npz)")
    p.add_argument("--dataset", default=None, choices=sorted(DATASETS),
                   help="dataset (default: the one the weights were trained on, else synthetic)")
    p.add_argument("--data-dir", default=None, metavar="PATH",
                   help="the dataset's files (default: the ones the weights were trained on)")
    p.add_argument("--split", default="val", choices=("val", "train"), help="which split")
    p.add_argument("--images", type=positive_int_arg, default=None,
                   help=f"images of the split (default: all of a dataset read from files; "
                   f"synthetic: {cpu['val_images']} on CPU, {gpu['val_images']} on GPU)")
    p.add_argument("--channels", type=int, default=None, choices=(1, 3),
                   help="1: grayscale, 3: RGB (default: as the weights were trained)")
    p.add_argument("--image-size", type=positive_int_arg, default=None, metavar="S",
                   help="resize images to SxS (default: as the weights were trained)")
    p.add_argument("--val-fraction", type=non_negative_float_arg, default=None,
                   help="share held out for validation when the dataset has no test split "
                   "(default: as the weights were trained, else 0.1)")
    p.add_argument("--model", default=None, type=model_name, metavar="MODEL",
                   help="network (default: the one recorded in the weights file, else cnn)")
    p.add_argument("--hidden", default=None, type=widths, metavar="W1,W2,...",
                   help="--model mlp: widths of the hidden layers (default: as recorded in "
                   "the weights file, else 512,256)")
    p.add_argument("--seed", type=non_negative_int_arg, default=None,
                   help="dataset seed (default: the training run's, else 0)")
    p.add_argument("--cache-dir", default=None, help="dataset cache (as for train)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: the GPU when CuPy and a GPU are present, else the CPU")
    p.add_argument("--batch-size", type=positive_int_arg, default=500, help="images per batch")
    p.add_argument("--out", default=None, metavar="JSON", help="also write the results here")
    return p


class _Normalised:
    """A dataset seen through another normalisation (the one the weights were trained with)."""

    def __init__(self, dataset, mean, std):
        self.images, self.labels = dataset.images, dataset.labels
        self.num_classes, self.image_shape = dataset.num_classes, dataset.image_shape
        self.mean, self.std = mean, std

    def __len__(self):
        return len(self.labels)


def _stat(value):
    return float(value) if np.ndim(value) == 0 else np.asarray(value, dtype=np.float32)


def confusion(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[true, predicted]."""
    counts = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(counts, (labels, predictions), 1)
    return counts


def evaluate_weights(args) -> dict:
    from dptrain import backend
    from dptrain.checkpoints.weights import class_names, load_weights, read_metadata
    from dptrain.data import DeviceLoader, fixed_size, get_dataset
    from dptrain.data.augment import ResizedCrop
    from dptrain.nn import build_model
    from dptrain.run.evaluate import predict
    from dptrain.run.config import DEVICE_DEFAULTS

    meta = read_metadata(args.load) or {}
    dataset_name = args.dataset or meta.get("dataset") or "synthetic"
    model_name = args.model or meta.get("model") or "cnn"
    # how the training run read its data (weights saved by `train --save`), unless overridden
    trained = meta.get("data") if meta.get("dataset") == dataset_name else None
    trained = trained if isinstance(trained, dict) else {}
    options = {key: getattr(args, key) if getattr(args, key) is not None else trained.get(key)
               for key in ("data_dir", "channels", "image_size", "val_fraction")}
    options = {k: v for k, v in options.items() if v is not None}
    if args.data_dir is None and "data_dir" in options:
        options["data_dir"] = _recorded_path(options["data_dir"], args.load)
    hidden = args.hidden or (tuple(meta["hidden"]) if meta.get("hidden") else None)
    seed = args.seed if args.seed is not None else int(trained.get("seed", 0))
    try:
        device = backend.resolve_device(args.device)
        be = backend.get(device)
        n = args.images
        if n is None and not fixed_size(dataset_name):
            n = DEVICE_DEFAULTS[device]["val_images"]
        dataset = get_dataset(dataset_name, args.split, n, seed, args.cache_dir, **options)
        # weights trained with random-resized-crop see resize + centre crop to their side
        crop = trained.get("eval_crop") if args.image_size is None else None
        view_of = ResizedCrop(be, int(crop), random=False) if crop else None
        shape = view_of.output_shape(dataset.image_shape) if crop else dataset.image_shape
        model = build_model(model_name, shape, dataset.num_classes, hidden=hidden).to(device)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    except UsageError as exc:  # the dataset names train's flag for a size; ours is --images
        raise UsageError(str(exc).replace(f"--{args.split}-images", "--images")) from None
    load_weights(model, args.load)
    names = class_names(dataset)
    if meta.get("class_names") and len(meta["class_names"]) == len(names):
        names = [str(name) for name in meta["class_names"]]
    view = _Normalised(dataset, _stat(meta.get("mean", dataset.mean)),
                       _stat(meta.get("std", dataset.std)))
    # float32 batches, laid out for the stem where the model lays its input out (predict marks)
    loader = DeviceLoader(view, be, args.batch_size, resample=view_of,
                          layout=model.input_layout(shape, np.float32, be))
    labels = np.asarray(dataset.labels, dtype=np.int64)
    total = len(labels)
    predictions, loss_sum = predict(model, loader, labels, args.batch_size)
    counts = confusion(labels, predictions, len(names))
    support = counts.sum(axis=1)
    per_class = [float(counts[c, c] / support[c]) if support[c] else None
                 for c in range(len(names))]
    return {"weights": str(args.load), "model": model_name, "dataset": dataset_name,
            "split": args.split, "images": total, "device": device,
            "accuracy": float(np.trace(counts) / total), "loss": loss_sum / total,
            "class_names": names, "per_class_accuracy": per_class,
            "support": support.tolist(), "confusion_matrix": counts.tolist()}


def _recorded_path(data_dir: str, weights) -> str:
    """A data directory a weights file recorded: as it is where it exists, else (a relative
    path, recorded by an older dptrain) beside the weights file where it exists there."""
    if Path(data_dir).is_absolute() or Path(data_dir).exists():
        return data_dir
    beside = Path(weights).resolve().parent / data_dir
    return str(beside) if beside.exists() else data_dir


def report(result: dict) -> str:
    names, counts = result["class_names"], np.asarray(result["confusion_matrix"])
    lines = [f"{result['weights']} ({result['model']}) on {result['dataset']} {result['split']}, "
             f"{result['images']} images: accuracy {result['accuracy']:.4f}, "
             f"loss {result['loss']:.4f}", "", "per-class accuracy:"]
    width = max(len(name) for name in names)
    for name, acc, n in zip(names, result["per_class_accuracy"], result["support"]):
        lines.append(f"  {name:<{width}}  {'-' if acc is None else f'{acc:.4f}'}  ({n} images)")
    cell, index = max(5, len(str(counts.max())) + 1), len(str(len(names) - 1))
    lines += ["", "confusion matrix (rows: true class, columns: predicted class, by number):",
              " " * (width + index + 3) + "".join(f"{i:>{cell}}" for i in range(len(names)))]
    for i, (name, row) in enumerate(zip(names, counts)):
        lines.append(f"  {i:>{index}} {name:<{width}}" + "".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines)


def main(argv) -> int:
    from dptrain.fileio import atomic_write

    args = parser().parse_args(argv)
    result = evaluate_weights(args)
    print(report(result), flush=True)
    if args.out:
        text = json.dumps(result, indent=2) + "\n"
        try:
            atomic_write(Path(args.out), lambda f: f.write(text.encode()))
        except OSError as exc:
            raise UsageError(f"--out {args.out}: cannot write ({exc.strerror})") from None
    return 0
