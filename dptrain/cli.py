"""Command line: ``python -m dptrain COMMAND ...``; no command means ``train``.

Each command is a module with ``main(argv) -> int`` (``COMMANDS`` below): a new command adds
one entry and its own module, so this file stays the dispatcher and the training flags.

Bad input (an unknown model, a non-positive size, a weights file that does not
fit) ends in one line naming the value at fault and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys

from dptrain.argtypes import (HelpFormatter, Parser, non_negative_float, non_negative_int,
                              positive_float, positive_int, widths)
from dptrain.errors import RunStopped, UsageError

# command -> (module with main(argv), one line for `python -m dptrain --help`)
COMMANDS = {
    "train": ("dptrain.cli", "train a model (the default when no command is given)"),
    "eval": ("dptrain.evaluation", "accuracy, per-class accuracy and confusion matrix of weights"),
    "plot": ("dptrain.plot", "loss and accuracy curves of one or several runs, as a PNG"),
    "bench": ("dptrain.bench", "benchmarks: `bench ops`, `bench train`, `bench comm`"),
    "data": ("dptrain.data.commands", "datasets: `data pack SRC OUT`, `data info`, `data synth`"),
}


def version() -> str:
    from dptrain import __version__

    return f"dptrain {__version__}"


DEFAULT_BATCH = 64  # images per step per process


# The argument types under the names this file has always used.
_Parser = Parser
_widths = widths
_positive_int, _non_negative_int = positive_int, non_negative_int
_positive_float, _non_negative_float = positive_float, non_negative_float


def train_parser() -> argparse.ArgumentParser:
    from dptrain.data import DATASETS
    from dptrain.nn import MODELS
    from dptrain.optim import OPTIMIZERS, LRSchedule
    from dptrain.train import DEVICE_DEFAULTS
    from dptrain.watchdog import DEFAULT_TIMEOUT

    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
    p = _Parser(
        prog="python -m dptrain train",
        description="Train a CNN on one process (GPU when available, else CPU). Rank 0 shows "
        "progress and writes LOGDIR/metrics.jsonl and LOGDIR/summary.json.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=version())
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="take any of these options from a TOML file (keys as the options, "
                   "without the dashes: batch-size = 128); options given here override it")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="cnn", choices=sorted(MODELS), help="network to train")
    g.add_argument("--hidden", type=_widths, default=None, metavar="W1,W2,...",
                   help="--model mlp: widths of the hidden layers (any number; default 512,256)")
    g.add_argument("--dataset", default="synthetic", choices=sorted(DATASETS),
                   help="dataset (synthetic: built-in 48x48 shapes, generated on the fly; "
                   "imagefolder, mnist, cifar10, fer2013, packed: read from --data-dir)")
    g.add_argument("--data-dir", default=None, metavar="PATH",
                   help="the dataset's files (a folder of class folders, the MNIST/CIFAR-10 "
                   "files, the FER-2013 CSV, a `data pack` output)")
    g.add_argument("--channels", type=int, default=None, choices=(1, 3),
                   help="1: grayscale, 3: RGB (default: the dataset's own)")
    g.add_argument("--image-size", type=_positive_int, default=None, metavar="S",
                   help="resize images to SxS (needed when an image folder mixes sizes)")
    g.add_argument("--val-fraction", type=_non_negative_float, default=0.1,
                   help="share held out for validation when the dataset has no test split")
    g.add_argument("--on-bad-image", default="error", choices=("error", "skip"),
                   help="an unreadable image file: stop with its name, or skip it (counted)")
    g.add_argument("--augment", action="store_true",
                   help="random crop (zero padding) and horizontal flip of training batches, "
                   "on the device")
    g.add_argument("--augment-pad", type=_non_negative_int, default=4, metavar="P",
                   help="padding of the --augment crop, pixels")
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
    g.add_argument("--batch-size", type=_positive_int, default=None,
                   help=f"images per step per process (default {DEFAULT_BATCH})")
    g.add_argument("--global-batch-size", type=_positive_int, default=None,
                   help="images per step over all processes (instead of --batch-size)")
    g.add_argument("--no-drop-last", dest="drop_last", action="store_false",
                   help="pad the last ragged batch of an epoch with wrapped-around images "
                   "instead of dropping it")
    g.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                   help="sgd: momentum SGD; adamw: Adam with decoupled weight decay")
    g.add_argument("--lr", type=_positive_float, default=2e-3, help="peak learning rate")
    g.add_argument("--lr-schedule", default="cosine", choices=LRSchedule.KINDS,
                   help="decay after the warmup")
    g.add_argument("--warmup-steps", type=_non_negative_int, default=None,
                   help=f"steps of linear learning-rate warmup (default: "
                   f"{LRSchedule.AUTO_WARMUP_FRACTION:.0%}% of the run, at most "
                   f"{LRSchedule.AUTO_WARMUP_MAX} steps)")
    g.add_argument("--momentum", type=_non_negative_float, default=0.9, help="SGD momentum")
    g.add_argument("--nesterov", action="store_true", help="Nesterov momentum (SGD)")
    g.add_argument("--weight-decay", type=_non_negative_float, default=5e-4,
                   help="weight decay (decoupled for adamw, added to the gradient for sgd)")
    g.add_argument("--seed", type=_non_negative_int, default=0,
                   help="seeds data order, dataset and init")
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
    g.add_argument("--precision", default="auto",
                   choices=("auto", "tf32", "fp32", "bf16", "fp16"),
                   help="tf32/fp32: fp32 activations, matrix products on TF32 tensor cores or "
                   "in full fp32; bf16/fp16: mixed precision, 16-bit activations with fp32 "
                   "weights, optimizer and gradient exchange (cnn and mlp models; bf16 on a GPU "
                   "only; fp16 with dynamic loss scaling). auto: bf16 on a GPU with bf16 "
                   "tensor cores for the models that have it (the fastest precision at fp32's "
                   "accuracy), else TF32 where the GPU has it, else fp32")
    g.add_argument("--loss-scale", type=_positive_float, default=2.0**16, metavar="S",
                   help="fp16: the initial loss scale; halved on every step whose gradients "
                   "overflow (that step is skipped on all ranks)")
    g.add_argument("--loss-scale-interval", type=_positive_int, default=2000, metavar="N",
                   help="fp16: the loss scale doubles after N steps without an overflow")
    g = p.add_argument_group("output")
    g.add_argument("--log-dir", default=None,
                   help="write metrics.jsonl, summary.json and config.json here; a directory "
                   "that holds files already is left alone and DIR-1, DIR-2, ... used instead")
    g.add_argument("--overwrite", action="store_true",
                   help="write into an existing --log-dir, replacing its files")
    g.add_argument("--save", default=None, metavar="PATH", help="final weights (.npz)")
    g.add_argument("--load", default=None, metavar="PATH", help="initial weights (.npz)")
    g.add_argument("--eval-every", type=_non_negative_int, default=0,
                   help="validate every N steps (0: at the end of each epoch)")
    g.add_argument("--log-every", type=_positive_int, default=20, help="log every N steps")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    g.add_argument("--torch", action="store_true",
                   help="then train the same model in PyTorch from the same initial weights on "
                   "the same batches, into LOGDIR/torch/metrics.jsonl (needs torch)")
    g.add_argument("--skip-nonfinite", type=_non_negative_int, default=0, metavar="N",
                   help="skip up to N steps whose loss or gradient is NaN or infinite (their "
                   "update is not applied); 0: stop at the first with exit code 3")
    g = p.add_argument_group("checkpoints and failures")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write exact-resume checkpoints here (model, optimizer, step, RNG "
                   "states); SIGINT/SIGTERM then stop after a step and write one")
    g.add_argument("--checkpoint-every", type=_non_negative_int, default=0, metavar="N",
                   help="write a checkpoint every N steps (0: only when stopped by a signal)")
    g.add_argument("--keep-checkpoints", type=_positive_int, default=3, metavar="K",
                   help="keep the newest K checkpoints")
    g.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="continue a run: auto = the newest usable checkpoint in "
                   "--checkpoint-dir (a fresh start if none), or a checkpoint directory")
    g.add_argument("--collective-timeout", type=_non_negative_float, default=DEFAULT_TIMEOUT,
                   metavar="SECONDS",
                   help="abort the job, naming the ranks that did not arrive, when a collective "
                   "or a step has not finished after this long (0: never)")
    g = p.add_argument_group("testing")
    g.add_argument("--verify-replicas", action="store_true",
                   help="check after every step that all ranks hold identical parameters "
                   "(slow; for testing)")
    return p


def run_train(argv) -> int:
    """`python -m dptrain train`."""
    from dptrain.train import TrainConfig, train

    from dptrain.config import apply_config

    parser = train_parser()
    apply_config(parser, argv)
    args = vars(parser.parse_args(argv))
    args.pop("config")
    if args["global_batch_size"] is not None and args["batch_size"] is not None:
        parser.error(f"--global-batch-size {args['global_batch_size']} and --batch-size "
                     f"{args['batch_size']}: give one of them")
    if args["batch_size"] is None:
        args["batch_size"] = DEFAULT_BATCH
    if args["torch"]:
        from dptrain.torch_twin import require_torch

        require_torch()
    train(TrainConfig(**args), echo=lambda text: print(text, flush=True))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        lines = [f"  {name:<7} {text}" for name, (_, text) in COMMANDS.items()]
        print(f"usage: python -m dptrain [{'|'.join(COMMANDS)}] [options]\n\n"
              + "\n".join(lines) + "\n\n`python -m dptrain COMMAND --help` lists a command's "
              "options.")
        return 0
    if argv and argv[0] == "--version":
        print(version())
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
    except RunStopped as exc:
        print(f"dptrain {command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("dptrain: interrupted", file=sys.stderr)
        return 130
