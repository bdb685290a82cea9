"""Command line: ``python -m dptrain COMMAND ...``; no command means ``train``.

Each command is a module with ``main(argv) -> int`` (``COMMANDS`` below): a new command adds
one entry and its own module, so this file stays the dispatcher and the training flags.

Bad input (an unknown model, a non-positive size, a weights file that does not
fit) ends in one line naming the value at fault and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys

from dptrain.errors import UsageError

# command -> (module with main(argv), one line for `python -m dptrain --help`)
COMMANDS = {
    "train": ("dptrain.cli", "train a model (the default when no command is given)"),
    "bench": ("dptrain.bench", "benchmarks: `bench ops`, `bench train`, `bench comm`"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) with exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind, allow_zero):
    """An argparse type: a number of `kind` (int or float) that is positive, or >= 0."""
    noun = "an integer" if kind is int else "a number"
    bound = "non-negative" if allow_zero else "positive"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if value < 0 or (value == 0 and not allow_zero) or value != value:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _widths(text):
    """An argparse type: comma-separated positive layer widths, e.g. 1024,1024."""
    parts = [p.strip() for p in text.split(",")]
    try:
        widths = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         f"integers") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
    return widths


_positive_int = _number(int, allow_zero=False)
_non_negative_int = _number(int, allow_zero=True)
_positive_float = _number(float, allow_zero=False)
_non_negative_float = _number(float, allow_zero=True)


def train_parser() -> argparse.ArgumentParser:
    from dptrain.data import DATASETS
    from dptrain.nn import MODELS
    from dptrain.optim import OPTIMIZERS, LRSchedule
    from dptrain.train import DEVICE_DEFAULTS

    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
    p = _Parser(
        prog="python -m dptrain train",
        description="Train a CNN on one process (GPU when available, else CPU). Rank 0 shows "
        "progress and writes LOGDIR/metrics.jsonl and LOGDIR/summary.json.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="cnn", choices=sorted(MODELS), help="network to train")
    g.add_argument("--hidden", type=_widths, default=None, metavar="W1,W2,...",
                   help="--model mlp: widths of the hidden layers (any number; default 512,256)")
    g.add_argument("--dataset", default="synthetic", choices=sorted(DATASETS),
                   help="dataset (synthetic: built-in 48x48 shapes, generated on the fly)")
    g.add_argument("--train-images", type=_positive_int, default=None,
                   help=f"training images (default {cpu['train_images']} on CPU, "
                   f"{gpu['train_images']} on GPU)")
    g.add_argument("--val-images", type=_positive_int, default=None,
                   help=f"validation images (default {cpu['val_images']} on CPU, "
                   f"{gpu['val_images']} on GPU)")
    g.add_argument("--cache-dir", default=None,
                   help="where generated datasets are cached (default $DPTRAIN_CACHE or "
                   "~/.cache/dptrain)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=_positive_int, default=None,
                   help=f"passes over the training set (default {cpu['epochs']} on CPU, "
                   f"{gpu['epochs']} on GPU)")
    g.add_argument("--max-steps", type=_positive_int, default=None,
                   help="stop after this many steps, whatever the epochs")
    g.add_argument("--batch-size", type=_positive_int, default=64, help="images per step per process")
    g.add_argument("--global-batch-size", type=_positive_int, default=None,
                   help="images per step over all processes (instead of --batch-size)")
    g.add_argument("--no-drop-last", dest="drop_last", action="store_false",
                   help="pad the last ragged batch of an epoch with wrapped-around images "
                   "instead of dropping it")
    g.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    g.add_argument("--lr", type=_positive_float, default=2e-3, help="peak learning rate")
    g.add_argument("--lr-schedule", default="cosine", choices=LRSchedule.KINDS)
    g.add_argument("--warmup-steps", type=_non_negative_int, default=60,
                   help="steps of linear learning-rate warmup")
    g.add_argument("--momentum", type=_non_negative_float, default=0.9, help="SGD momentum")
    g.add_argument("--nesterov", action="store_true", help="Nesterov momentum (SGD)")
    g.add_argument("--weight-decay", type=_non_negative_float, default=5e-4)
    g.add_argument("--seed", type=int, default=0, help="seeds data order, dataset and init")
    g = p.add_argument_group("device")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: the GPU when CuPy and a GPU are present, else the CPU")
    g.add_argument("--sync-bn", action="store_true",
                   help="batch normalisation uses the statistics of all ranks' batches "
                   "(all-reduced inside the step) instead of each rank's own")
    g.add_argument("--bucket-mb", type=_positive_float, default=4.0,
                   help="gradient bucket size for the reduce-scatter (MB)")
    g.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="GPU: run every step eagerly instead of replaying a captured graph")
    g.add_argument("--precision", default="auto", choices=("auto", "tf32", "fp32"),
                   help="GPU matrix precision (auto: TF32 where the GPU has it)")
    g = p.add_argument_group("output")
    g.add_argument("--log-dir", default=None, help="write metrics.jsonl and summary.json here")
    g.add_argument("--save", default=None, metavar="PATH", help="final weights (.npz)")
    g.add_argument("--load", default=None, metavar="PATH", help="initial weights (.npz)")
    g.add_argument("--eval-every", type=_non_negative_int, default=0,
                   help="validate every N steps (0: at the end of each epoch)")
    g.add_argument("--log-every", type=_positive_int, default=20, help="log every N steps")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    g.add_argument("--verify-replicas", action="store_true",
                   help="check after every step that all ranks hold identical parameters "
                   "(slow; for testing)")
    return p


def run_train(argv) -> int:
    """`python -m dptrain train`."""
    from dptrain.train import TrainConfig, train

    args = train_parser().parse_args(argv)
    train(TrainConfig(**vars(args)), echo=lambda text: print(text, flush=True))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        lines = [f"  {name:<7} {text}" for name, (_, text) in COMMANDS.items()]
        print(f"usage: python -m dptrain [{'|'.join(COMMANDS)}] [options]\n\n"
              + "\n".join(lines) + "\n\n`python -m dptrain COMMAND --help` lists a command's "
              "options.")
        return 0
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    from dptrain.dist import guarded

    return guarded(lambda: _run(command, argv))


def _run(command, argv) -> int:
    try:
        if command == "train":
            return run_train(argv)
        import importlib

        return importlib.import_module(COMMANDS[command][0]).main(argv) or 0
    except UsageError as exc:
        print(f"dptrain {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dptrain: interrupted", file=sys.stderr)
        return 130
