"""Command line: ``python -m dptrain COMMAND ...``; no command means ``train``.

Each command is a module with ``main(argv) -> int`` (``COMMANDS`` below): a new command adds
one entry and its own module, so this file stays the dispatcher.

Bad input (an unknown model, a non-positive size, a weights file that does not
fit) ends in one line naming the value at fault and exit code 2, never a traceback.
"""
from __future__ import annotations

import os
import sys

from dptrain.cli.argtypes import launch_rank, launched_as_ranks
from dptrain.errors import AgreedUsageError, RunStopped, UsageError

# command -> (module with main(argv), one line for `python -m dptrain --help`)
COMMANDS = {
    "train": ("dptrain.cli.train", "train a model (the default when no command is given)"),
    "eval": ("dptrain.cli.eval", "accuracy, per-class accuracy and confusion matrix of weights"),
    "plot": ("dptrain.cli.plot", "loss and accuracy curves of one or several runs, as a PNG"),
    "bench": ("dptrain.bench", "benchmarks: `bench ops`, `bench train`, `bench comm`, `bench startup`, "
              "`bench data`"),
    "data": ("dptrain.cli.data", "datasets: `data pack SRC OUT`, `data info`, `data synth`"),
}


def version() -> str:
    from dptrain import __version__

    return f"dptrain {__version__}"


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
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        if launch_rank() > 0:  # every rank has the same command line: rank 0 says it (and
            return 0  # is not ended by a launcher seeing another rank fail first)
        print(f"dptrain: error: {argv[0]!r} is not a command: choose one of "
              f"{', '.join(COMMANDS)} (see --help)", file=sys.stderr)
        return 2
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    from dptrain.distributed.world import guarded

    return guarded(lambda: _quiet_on_broken_pipe(lambda: _run(command, argv)))


def _quiet_on_broken_pipe(fn) -> int:
    """fn(), ending quietly when the reader of stdout has gone (`... | head`)."""
    try:
        return fn()
    except BrokenPipeError:
        # Python would report the pipe again when it flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE


def _run(command, argv) -> int:
    try:
        import importlib

        return importlib.import_module(COMMANDS[command][0]).main(argv) or 0
    except UsageError as exc:
        agreed = isinstance(exc, AgreedUsageError) and launched_as_ranks()
        if not agreed or launch_rank() == 0:  # an agreed error: every rank has it, one says it
            print(f"dptrain {command}: error: {exc}", file=sys.stderr)
        if agreed:  # guarded ends every rank without an abort: rank 0 with exit 2, the
            # others quietly, so that a launcher that ends a job at its first failed rank
            # (Open MPI) cannot end rank 0 before it has said why; the job's code is 2
            raise RunStopped(str(exc), exit_code=2 if launch_rank() == 0 else 0,
                             agreed=True) from None
        return 2
    except RunStopped as exc:
        from dptrain.distributed.world import job_rank

        if not exc.agreed or (job_rank() or launch_rank()) == 0:  # an agreed stop: every rank has it, one says it
            print(f"dptrain {command}: {exc}", file=sys.stderr)
        if exc.agreed:
            raise  # guarded ends every rank with its code, without an abort
        return exc.exit_code
    except KeyboardInterrupt:
        print("dptrain: interrupted", file=sys.stderr)
        return 130
