"""What every command line of dptrain shares: a parser whose errors are one line with exit
code 2, a help formatter that shows defaults only where they say something, and argument
types for sizes and rates (finite, positive or non-negative numbers; layer widths)."""
from __future__ import annotations

import argparse
import math
import os

from dptrain.errors import AgreedUsageError

# A launcher's rank and size of this process, before the ranks meet (mpirun, mpiexec, srun).
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def _first_int(names) -> int | None:
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return None


def launch_rank() -> int:
    """This process's rank as its launcher numbered it (0 when not launched as ranks)."""
    return _first_int(_RANK_VARS) or 0


def launched_as_ranks() -> bool:
    """Whether a launcher started this process as one of several ranks."""
    return (_first_int(_SIZE_VARS) or 1) > 1


class Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) with exit code 2. Started as
    several ranks, every rank meets the same error: it is an AgreedUsageError, which rank 0
    alone prints and which ends every rank without an MPI abort (dptrain.cli.commands)."""

    def error(self, message):
        if launched_as_ranks():
            raise AgreedUsageError(f"{message} (see --help)")
        # the prefix every command's errors share: "dptrain COMMAND: error:", whatever prog
        # the usage line shows (python -m dptrain COMMAND)
        name = self.prog.removeprefix("python -m ")
        self.exit(2, f"{name}: error: {message} (see --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where it tells something: not for switches, not for None, and not
    where the help text already states its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or action.nargs == 0 or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def number(kind, allow_zero):
    """An argparse type: a finite number of `kind` (int or float) that is positive, or >= 0."""
    noun = "an integer" if kind is int else "a number"
    bound = "non-negative" if allow_zero else "positive"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


positive_int = number(int, allow_zero=False)
non_negative_int = number(int, allow_zero=True)
positive_float = number(float, allow_zero=False)
non_negative_float = number(float, allow_zero=True)


def positive_float_or_auto(text):
    """An argparse type: "auto", or a positive number (--bucket-mb)."""
    return "auto" if text.strip().lower() == "auto" else positive_float(text)


def widths(text):
    """An argparse type: comma-separated positive layer widths, e.g. 1024,1024."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         f"integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
    return values


def float_range(low: float, high: float):
    """An argparse type: MIN,MAX with low < MIN <= MAX <= high (--rrc-scale, --rrc-ratio)."""
    def parse(text):
        parts = text.split(",")
        try:
            lo, hi = (float(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX (two numbers)") from None
        if not low < lo <= hi <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be MIN,MAX with {low:g} < MIN <= MAX <= "
                                             f"{high:g}, got {text!r}")
        return (lo, hi)

    return parse
