"""The command line, ``python -m dptrain COMMAND``: one module per command, each with
``main(argv) -> int``.

    commands.py  the dispatcher: COMMANDS, exit codes, one-line errors
    train.py     `train`: its parser, built from dptrain.run.config.TrainConfig
    eval.py      `eval`: accuracy, per-class accuracy and confusion matrix of a weights file
    plot.py      `plot`: loss and accuracy curves of runs (or an exchange timeline), as a PNG
    plot_timeline.py  drawing of a step's exchange timeline
    data.py      `data pack|info|synth`
    config.py    `--config FILE.toml` for any command
    argtypes.py  the parser class, help formatter and argument types every command shares

May import any package of dptrain except bench/ (which `bench` loads by name).
"""
from dptrain.cli.commands import main

__all__ = ["main"]
