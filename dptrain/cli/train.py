"""`python -m dptrain train`: its parser is built from TrainConfig's fields (dptrain.run.config),
so an option is declared once, with its type, default, choices and help; `--config FILE.toml`
reads the same keys (dptrain.cli.config)."""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING

from dptrain.errors import AgreedUsageError
from dptrain.cli.argtypes import (HelpFormatter, Parser, float_range, non_negative_float,
                                  non_negative_int, positive_float, positive_float_or_auto,
                                  positive_int, widths)
from dptrain.data.augment import RATIO_BOUNDS, SCALE_BOUNDS

def model_name(text):
    """An argparse type: a model of dptrain.nn.MODELS, or FILE.py:FUNCTION /
    package.module:FUNCTION (loaded when the run builds it)."""
    from dptrain.nn import MODELS

    if text in MODELS or ":" in text:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a model: choose {', '.join(MODELS)} "
                                     f"or FILE.py:FUNCTION / package.module:FUNCTION")


# (the field's Python type, its bound) -> the argparse type that checks it
ARG_TYPES = {
    (str, "model"): model_name,
    (int, "positive"): positive_int, (int, "non_negative"): non_negative_int,
    (float, "positive"): positive_float, (float, "non_negative"): non_negative_float,
    (float, "positive_or_auto"): positive_float_or_auto,
    (tuple, "widths"): widths, (tuple, "scale_range"): float_range(*SCALE_BOUNDS),
    (tuple, "ratio_range"): float_range(*RATIO_BOUNDS), (int, None): int, (float, None): float, (str, None): None,
}


def _value_type(hint):
    """int, float, str, bool or tuple: the type a field holds when it is not None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return typing.get_origin(args[0]) or args[0]


def train_parser() -> argparse.ArgumentParser:
    from dptrain.cli.commands import version
    from dptrain.run.config import TrainConfig, flag, options

    p = Parser(
        prog="python -m dptrain train",
        description="Train a model on this process, or on every rank mpirun / srun started "
        "(GPU when available, else CPU). Rank 0 shows progress and writes LOGDIR/metrics.jsonl "
        "and LOGDIR/summary.json.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=version())
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="take any of these options from a TOML file (keys as the options, "
                   "without the dashes: batch-size = 128); options given here override it")
    hints, groups = typing.get_type_hints(TrainConfig), {}
    for f in options():
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(
            meta["group"], p.add_argument_group(meta["group"]))
        assert f.default is not MISSING, f.name
        kind = _value_type(hints[f.name])
        if kind is bool:
            group.add_argument(flag(f), dest=f.name, help=meta["help"].replace("%", "%%"),
                               action="store_false" if f.default else "store_true")
            continue
        # a field with a const takes an optional value: the bare flag means the const
        optional = dict(nargs="?", const=meta["const"]) if meta.get("const") else {}
        group.add_argument(flag(f), dest=f.name, default=f.default, help=meta["help"].replace("%", "%%"),
                           type=ARG_TYPES[kind, meta["bound"]], choices=meta["choices"],
                           metavar=meta["metavar"], **optional)
    return p


def check_combinations(parser, args: dict) -> None:
    """What each flag's type cannot check alone: ranges of fractions and combinations."""
    if args["global_batch_size"] is not None and args["batch_size"] is not None:
        parser.error(f"--global-batch-size {args['global_batch_size']} and --batch-size "
                     f"{args['batch_size']}: give one of them")
    # the same flags on every rank: each raises it, rank 0 says it
    if args["nesterov"] and args["optimizer"] != "sgd":
        raise AgreedUsageError(f"--nesterov applies to --optimizer sgd, not "
                               f"{args['optimizer']}")
    if args["momentum"] >= 1:
        raise AgreedUsageError(f"--momentum {args['momentum']}: must be below 1 (0.9 is usual)")
    if args["val_fraction"] >= 1:
        raise AgreedUsageError(f"--val-fraction {args['val_fraction']}: must be below 1 (a "
                               "share of the images)")


def main(argv) -> int:
    from dptrain.cli.config import apply_config
    from dptrain.run.config import TrainConfig
    from dptrain.run.train import train

    parser = train_parser()
    apply_config(parser, argv)
    args = vars(parser.parse_args(argv))
    args.pop("config")
    check_combinations(parser, args)
    if args["checkpoint_every"] and not args["checkpoint_dir"]:
        raise AgreedUsageError(f"--checkpoint-every {args['checkpoint_every']} needs --checkpoint-dir "
                         "DIR (where to write the checkpoints)")
    if args["torch"]:
        from dptrain.run.torch_twin import require_torch

        require_torch()
    # a diverging run overflows on the way to its non-finite step, which the run reports in
    # one line: NumPy's warnings about it would only bury that line
    import numpy as np

    with np.errstate(all="ignore"):
        train(TrainConfig(**args), echo=lambda text: print(text, flush=True))
    return 0
