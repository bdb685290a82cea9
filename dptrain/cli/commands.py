"""Command line: ``python -m dptrain COMMAND ...``; no command means ``train``.

Each command is a module with ``main(argv) -> int`` (``COMMANDS`` below): a new command adds
one entry and its own module, so this file stays the dispatcher.

Bad input (an unknown model, a non-positive size, a weights file that does not
fit) ends in one line naming the value at fault and exit code 2, never a traceback.
"""
from __future__ import annotations

import sys

from dptrain.errors import RunStopped, UsageError

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
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    from dptrain.distributed.world import guarded

    return guarded(lambda: _run(command, argv))


def _run(command, argv) -> int:
    try:
        import importlib

        return importlib.import_module(COMMANDS[command][0]).main(argv) or 0
    except UsageError as exc:
        print(f"dptrain {command}: error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        from dptrain.distributed.world import job_rank

        if not exc.agreed or job_rank() == 0:  # an agreed stop: every rank has it, one says it
            print(f"dptrain {command}: {exc}", file=sys.stderr)
        if exc.agreed:
            raise  # guarded ends every rank with its code, without an abort
        return exc.exit_code
    except KeyboardInterrupt:
        print("dptrain: interrupted", file=sys.stderr)
        return 130
