"""`python -m dptrain plot LOGDIR [LOGDIR ...] -o out.png`: loss and accuracy curves of runs;
`python -m dptrain plot TIMELINE.json -o out.png`: a step's exchange timeline
(`bench comm --timeline`, dptrain.cli.plot_timeline).

One figure, two panels against the training step: loss (training, solid; validation, dashed)
and accuracy (the same). Each LOGDIR is a run's log directory (its metrics.jsonl); a
LOGDIR/torch/ written by `train --torch` is drawn too, as its own run. Needs matplotlib
(pip install 'dptrain[plot]').
"""
from __future__ import annotations

import json
from pathlib import Path

from dptrain.errors import UsageError


def parser():
    from dptrain.cli.argtypes import HelpFormatter, Parser

    p = Parser(prog="python -m dptrain plot", formatter_class=HelpFormatter,
               description="Loss and accuracy curves of one or several runs on one figure.")
    p.add_argument("logdirs", nargs="+", metavar="LOGDIR",
                   help="a run's log directory (holding metrics.jsonl), or one timeline "
                   "JSON written by `bench comm --timeline`")
    p.add_argument("-o", "--out", default="curves.png", help="the PNG to write")
    p.add_argument("--title", default=None, help="the figure's title")
    p.add_argument("--no-torch", dest="torch", action="store_false",
                   help="leave out LOGDIR/torch (the PyTorch twin of `train --torch`)")
    return p


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a run still writing) is skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                break
            raise UsageError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(record, dict) or "step" not in record:
            raise UsageError(f"{path}:{number}: not a metrics record (no 'step')")
        records.append(record)
    return records


def runs_of(logdirs, with_torch: bool = True) -> list[tuple[str, list[dict]]]:
    """(label, records) for each LOGDIR (and LOGDIR/torch where present)."""
    runs = []
    for logdir in logdirs:
        path = Path(logdir)
        metrics = path / "metrics.jsonl" if path.is_dir() else path
        if not metrics.is_file():
            raise UsageError(f"{logdir}: no metrics.jsonl there (a --log-dir of `train`)")
        runs.append((str(logdir), read_metrics(metrics)))
        twin = path / "torch" / "metrics.jsonl"
        if with_torch and path.is_dir() and twin.is_file():
            runs.append((f"{logdir} (PyTorch)", read_metrics(twin)))
    return runs


def _series(records, key):
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot(runs, out, title=None) -> Path:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UsageError("plot needs matplotlib: pip install matplotlib (or "
                         "pip install 'dptrain[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(runs):
        color = colors[i % len(colors)]
        for ax, train_key, val_key in ((ax_loss, "loss", "val_loss"),
                                       (ax_acc, "accuracy", "val_accuracy")):
            for key, style, kind in ((train_key, "-", "train"), (val_key, "--", "val")):
                steps, values = _series(records, key)
                if steps:
                    ax.plot(steps, values, style, color=color, label=f"{label} {kind}",
                            marker="o" if len(steps) < 3 else None)
    for ax, name in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.suptitle(title or ", ".join(label for label, _ in runs))
    return save_figure(fig, out, dpi=100)


def main(argv) -> int:
    args = parser().parse_args(argv)
    from dptrain.cli.plot_timeline import is_timeline, plot_timeline

    if len(args.logdirs) == 1 and is_timeline(args.logdirs[0]):
        print(f"wrote {plot_timeline(args.logdirs[0], args.out, args.title)}")
        return 0
    out = plot(runs_of(args.logdirs, args.torch), args.out, args.title)
    print(f"wrote {out}")
    return 0


def save_figure(fig, out, dpi=100) -> Path:
    """Write a matplotlib figure to `out` (its folder made), closing it; an unwritable path is
    one line naming it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=dpi)
    except OSError as exc:
        raise UsageError(f"-o {out}: cannot write ({exc.strerror})") from None
    except ValueError as exc:  # matplotlib: a suffix it cannot write ("Format 'txt' is not ...")
        raise UsageError(f"-o {out}: {exc} (write a .png, .pdf or .svg)") from None
    finally:
        plt.close(fig)
    return out
