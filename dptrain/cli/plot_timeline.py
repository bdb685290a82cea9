"""Drawing of a step's exchange timeline (dptrain.distributed.timeline's JSON), for
`python -m dptrain plot TIMELINE.json` and `bench comm --timeline`: one row for the compute
stream's marks, one for the communication stream's per-bucket reduce-scatters (blue) and
all-gathers (green), each labelled with its bucket."""
from __future__ import annotations

from pathlib import Path

from dptrain.cli.plot import save_figure
from dptrain.distributed import timeline as tl
from dptrain.errors import UsageError

COLORS = {"reduce_scatter": "tab:blue", "all_gather": "tab:green"}


def is_timeline(path) -> bool:
    path = Path(path)
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        tl.read(path)
    except (ValueError, OSError):
        return False
    return True


def plot_timeline(path, out, title=None) -> Path:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UsageError("plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = tl.read(path)
    fig, ax = plt.subplots(figsize=(11, 2.8))
    rows = {"comm": 0, "compute": 1}
    for e in data["events"]:
        y, ms = rows[e["lane"]], 1e3 * e["start_s"]
        label = "" if e["bucket"] is None else str(e["bucket"])
        if e["end_s"] > e["start_s"]:
            width = 1e3 * (e["end_s"] - e["start_s"])
            ax.broken_barh([(ms, width)], (y - 0.35, 0.7), color=COLORS.get(e["name"], "grey"))
            ax.text(ms + width / 2, y, label, ha="center", va="center", fontsize=7)
        else:
            ax.plot([ms, ms], [y - 0.4, y + 0.4], color="black", lw=0.8)
            ax.text(ms, y + 0.42, f"{e['name']} {label}".strip(), rotation=60, fontsize=6)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlabel("ms from the step's first mark")
    ax.set_ylim(-0.6, 2.2)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or f"rank {data['rank']} of {data['ranks']}, exchange "
                 f"{data.get('exchange', '?')}: reduce-scatter blue, all-gather green")
    return save_figure(fig, out, dpi=110)
