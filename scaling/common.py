"""What the scaling scripts share: launching (mpirun, torchrun), reading run summaries,
speedup/efficiency, and writing CSV, Markdown, PNG and meta.json.

Every script records the machine, the date and its exact command line (`machine_meta`)
in its meta.json and in a comment at the top of its Markdown table, so a result file
always says where it came from.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (dptrain/, datasets/, scaling/)

# The keys of LOGDIR/summary.json that the sweeps read (dptrain.run.train and scaling/torch_ddp.py
# both write them).
SUMMARY_KEYS = ("train_loss", "val_loss", "val_accuracy", "wall_s", "train_s", "images_per_s",
                "world_size", "global_batch_size")


class ScalingError(Exception):
    """A bad flag or value: the script prints one line naming it and exits with code 2."""


def run_main(prog: str, main, argv=None) -> int:
    """Call main(argv), turning ScalingError into one line on stderr and exit code 2."""
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except ScalingError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


# ----------------------------------------------------------------------------- arguments


def parse_counts(text: str, flag: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (sorted, unique); anything else names the flag."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ScalingError(f"{flag} {text!r}: expected comma-separated positive integers") from None
    if not counts or counts[0] < 1:
        raise ScalingError(f"{flag} {text!r}: expected comma-separated positive integers")
    return counts


def positive_int(text: str) -> int:
    """argparse type: a positive integer, with the value in the message."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# ----------------------------------------------------------------------------- the machine


def gpu_names() -> list[str]:
    """Names of the visible GPUs: dptrain.bench's (CuPy's view) if any, else `nvidia-smi -L`,
    else []."""
    from dptrain.bench.machine import gpu_names as visible

    names = visible()
    if names:
        return names
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)"
        return [line.split(":", 1)[1].split("(UUID")[0].strip()
                for line in out.splitlines() if line.startswith("GPU ")]
    return []


def resolve_device(device: str, gpus: list[str]) -> str:
    """--device auto -> cuda where a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if gpus else "cpu"
    return device


def cap_counts(counts: list[int], device: str, gpus: list[str], dry_run: bool) -> list[int]:
    """GPU counts this machine can run: a CUDA sweep stops at the GPUs present. A CPU sweep
    runs any count (ranks share the cores; the launcher is told to oversubscribe)."""
    if device != "cuda":
        return counts
    if not gpus:
        if dry_run:
            warn("no GPU visible here; the dry run shows every count uncapped")
            return counts
        raise ScalingError("--device cuda: no GPU visible (CuPy and nvidia-smi found none)")
    kept = [n for n in counts if n <= len(gpus)]
    dropped = [n for n in counts if n > len(gpus)]
    if dropped:
        warn(f"--gpus: this machine has {len(gpus)} GPU(s); skipping "
             f"{', '.join(map(str, dropped))}")
    if not kept:
        raise ScalingError(f"--gpus: every count needs more than the {len(gpus)} GPU(s) here")
    return kept


def git_commit() -> str | None:
    """HEAD's short hash, with "-dirty" when the tracked files differ from it (a copied or
    edited tree: then only source_digest() says which code ran)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                             cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


SOURCE_DIRS = ("dptrain", "kernels", "scaling")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh")


def source_digest(root: Path = ROOT) -> str:
    """A digest of the code that ran (every .py / .cu / .cuh under dptrain/, kernels/ and
    scaling/, by relative path and content): the same for a commit's checkout and for any
    copy of it, whatever git knows there."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for path in sorted((root / d).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                h.update(path.relative_to(root).as_posix().encode() + b"\0")
                h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def machine_meta(script: str, argv: list[str], device: str, gpus: list[str], **extra) -> dict:
    """Where and how a result was made: host, GPUs, date, the exact command."""
    return {
        "script": script,
        "command": shlex.join(["python", "-m", f"scaling.{script}", *argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": device,
        "gpus": gpus,
        "git_commit": git_commit(),
        "source_digest": source_digest(),
        **extra,
    }


def describe_machine(meta: dict) -> str:
    gpus = meta.get("gpus") or []
    gpu = f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"
    return f"{meta['hostname']} ({gpu}), {meta['date']}"


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def note(text: str) -> None:
    print(text, flush=True)


# ----------------------------------------------------------------------------- launching


def find_launcher(choice: str, dry_run: bool):
    """The MPI launcher (Open MPI's mpirun, MPICH's mpiexec or srun; dptrain.distributed.launcher), with
    the flavour-specific flags and variables it needs."""
    from dptrain.distributed.launcher import LaunchError, find_launcher as find

    try:
        return find(choice, dry_run)
    except LaunchError as exc:
        raise ScalingError(str(exc)) from None


def torchrun_command(ranks: int, module_args: list[str]) -> list[str]:
    """PyTorch's launcher (torchrun) starting scaling/torch_ddp.py as a module on this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}", "-m", "scaling.torch_ddp", *module_args]


def torch_env(device: str) -> dict:
    """What torchrun's ranks need beyond the caller's environment (torchrun passes it on): on
    GPUs NVLink multicast off, as mpirun's ranks have it."""
    from dptrain.distributed.launcher import NO_MULTICAST

    env = dict(NO_MULTICAST) if device == "cuda" else {"OMP_NUM_THREADS": "1"}
    return {k: v for k, v in env.items() if k not in os.environ}


def dataset_command(train_images: int, val_images: int, seed: int,
                    cache_dir: str | None) -> list[str]:
    """Generate (or find) the synthetic set once, in parallel, before any rank needs it: a
    cached set also serves every smaller size, so the largest run's size is enough."""
    cmd = [sys.executable, str(ROOT / "datasets" / "make_synthetic.py"), "--train",
           str(train_images), "--val", str(val_images), "--seed", str(seed)]
    return cmd + (["--cache-dir", cache_dir] if cache_dir else [])


def child_env(extra: dict) -> dict:
    """The caller's environment, the repository first on PYTHONPATH (so `-m dptrain` and
    `-m scaling.torch_ddp` import this checkout), plus `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def shell_line(cmd: list[str], env: dict | None = None) -> str:
    """The command as one copy-pasteable shell line, with the variables we add in front."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(prefix + [shlex.quote(c) for c in cmd])


def execute(cmd: list[str], env: dict, log_path: Path | None, echo: bool = True) -> int:
    """Run cmd; its output (stdout and stderr) goes to log_path and, with echo, here too."""
    log = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "wb")
        log.write((shell_line(cmd, env) + "\n").encode())
    out = getattr(sys.stdout, "buffer", None)
    proc = subprocess.Popen(cmd, env=child_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        # Chunks, not lines: progress bars redraw with \r and should show as they come.
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            if log:
                log.write(chunk)
                log.flush()
            if echo:
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    sys.stdout.write(chunk.decode(errors="replace"))
        return proc.wait()
    except BaseException:
        proc.terminate()  # our own child only; mpirun passes the signal to its ranks
        proc.wait()
        raise
    finally:
        if log:
            log.close()


# ----------------------------------------------------------------------------- sweeps of runs


@dataclass
class Run:
    """One launched training run of a sweep and, once it ran, its row of results."""
    framework: str  # "ours" or "torch"
    execution: str  # how the step runs: "eager", "compile" or "graph"
    model: str  # "cnn" or "resnet18"
    mode: str  # e.g. "per-gpu batch 256" or "global batch 1024"
    gpus: int
    images: int
    batch: int  # per rank
    cmd: list[str]
    env: dict
    log_dir: Path
    row: dict = field(default_factory=dict)

    @property
    def series(self) -> str:
        return f"{self.framework} {self.execution}, {self.mode}"


def read_summary(log_dir: Path) -> dict:
    """LOGDIR/summary.json with every key the sweeps read; ValueError names what is missing."""
    path = Path(log_dir) / "summary.json"
    if not path.is_file():
        raise ValueError(f"no {path}")
    summary = json.loads(path.read_text())
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    return summary


def run_all(runs: list[Run], dry_run: bool, echo: bool, prepare: dict | None = None) -> int:
    """Run the `prepare` commands (name -> command), then every run in turn, filling run.row;
    a run that fails is recorded as failed and the sweep goes on. Returns the failures."""
    prepare = prepare or {}
    total = len(runs) + len(prepare)
    step = 0
    for name, cmd in prepare.items():
        step += 1
        note(f"[{step}/{total}] {name}: {shell_line(cmd)}")
        if not dry_run and execute(cmd, {}, None, echo=echo) != 0:
            raise ScalingError(f"{name} failed (see the output above)")
    failures = 0
    for run in runs:
        step += 1
        note(f"[{step}/{total}] {run.series}, {run.gpus} GPU(s), batch {run.batch} per rank: "
             f"{shell_line(run.cmd, run.env)}")
        if dry_run:
            continue
        (run.log_dir / "summary.json").unlink(missing_ok=True)  # never read an old run's
        rc = execute(run.cmd, run.env, run.log_dir / "run.log", echo=echo)
        run.row = result_row(run, rc)
        if run.row["status"] == "ok":
            note(f"    -> {run.row['time_s']:.2f} s training, {run.row['images_per_s']:.0f} "
                 f"images/s, val acc {run.row['val_accuracy']:.4f}")
        else:
            failures += 1
            warn(f"{run.series}, {run.gpus} GPU(s): {run.row['status']}")
    return failures


def result_row(run: Run, rc: int) -> dict:
    row = {"framework": run.framework, "execution": run.execution, "model": run.model,
           "mode": run.mode, "gpus": run.gpus, "images": run.images, "batch_per_gpu": run.batch,
           "log_dir": str(run.log_dir)}
    if rc != 0:
        return {**row, "status": f"failed (exit {rc}; see {run.log_dir / 'run.log'})"}
    try:
        s = read_summary(run.log_dir)
    except ValueError as exc:
        return {**row, "status": f"failed ({exc})"}
    if s["world_size"] != run.gpus:  # e.g. mpi4py missing: N independent one-rank runs
        return {**row, "status": f"failed (world_size {s['world_size']}, expected {run.gpus})"}
    return {**row, "status": "ok", "global_batch": s["global_batch_size"], "time_s": s["train_s"],
            "wall_s": s["wall_s"], "images_per_s": s["images_per_s"],
            "val_accuracy": s["val_accuracy"], "val_loss": s["val_loss"],
            "train_loss": s["train_loss"], "steps": s.get("steps")}


def add_scaling(rows: list[dict], weak: bool) -> list[dict]:
    """Speedup and efficiency of each row against the fewest GPUs of its series (framework,
    execution, mode) that ran; base count b, training throughput R (images/s):
      strong (fixed total work):   speedup S = b * R_G / R_b, efficiency E = S / G
      weak (fixed work per GPU):   efficiency E = b * R_G / (G * R_b), speedup S = G * E
    Both give ideal S = G and E = 100%. With the same images timed at every G these are
    b * T_b / T_G and T_b / T_G (T: training seconds); rates also stay fair where runs time
    other numbers of steps (warm-up steps left off the clock, a last partial batch dropped)."""
    series = {}
    for row in rows:
        if row.get("status") == "ok":
            key = (row["framework"], row.get("execution"), row["mode"])
            series.setdefault(key, []).append(row)
    for members in series.values():
        base = min(members, key=lambda r: r["gpus"])
        if not base["images_per_s"]:  # no step was timed: nothing to scale against
            continue
        for row in members:
            g, b = row["gpus"], base["gpus"]
            gain = row["images_per_s"] / base["images_per_s"]  # R_G / R_b
            if weak:
                eff = b * gain / g
                speedup = g * eff
            else:
                speedup = b * gain
                eff = speedup / g
            row["speedup"], row["efficiency_pct"] = speedup, 100.0 * eff
    return rows


# ----------------------------------------------------------------------------- outputs


def fmt(value, spec: str) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float) and value != value:  # NaN
        return "nan"
    return format(value, spec)


def write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v)
                             for k, v in row.items()})


def markdown_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> str:
    """columns: (heading, row key, format spec). Empty cells where a row lacks the key."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = [fmt(row.get(key), spec) if spec else str(row.get(key, ""))
                 for _, key, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(path: Path, title: str, meta: dict, body: list[str]) -> None:
    """A Markdown file headed by a comment giving machine, date and exact command."""
    header = (f"<!-- machine: {describe_machine(meta)}; platform: {meta['platform']}; "
              f"commit: {meta.get('git_commit')} (sources {meta.get('source_digest')})\n"
              f"     command: {meta['command']} -->")
    text = "\n\n".join([header, f"# {title}",
                        f"{describe_machine(meta)}. Command: `{meta['command']}`", *body])
    Path(path).write_text(text.rstrip() + "\n")


def write_meta(path: Path, meta: dict) -> None:
    Path(path).write_text(json.dumps(meta, indent=2) + "\n")


def pyplot():
    """matplotlib's pyplot (headless), or None with a warning when it is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        warn("matplotlib is not installed (pip install matplotlib): no PNG written")
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class Panel:
    """One plot: lines (label -> (xs, ys)), an optional ideal line, horizontal reference
    lines (label -> y) and bars (label -> height, drawn when there are no lines)."""
    title: str
    xlabel: str
    ylabel: str
    lines: dict = field(default_factory=dict)
    ideal: tuple | None = None
    hlines: dict = field(default_factory=dict)
    bars: dict = field(default_factory=dict)
    xticks: list | None = None  # label these x values as plain numbers
    logx: bool = False
    xbase: int = 2  # of the log x axis
    logy: bool = False


def plot_panels(path: Path, panels: list[Panel], meta: dict) -> bool:
    """Panels side by side in one PNG, captioned with machine, date and command."""
    plt = pyplot()
    if plt is None:
        return False
    width = max(9.0, 5.5 * len(panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel.lines:
            for label, (xs, ys) in panel.lines.items():
                ax.plot(xs, ys, marker="o", label=label)
            if panel.ideal:
                ax.plot(*panel.ideal, linestyle="--", color="gray", label="ideal")
            for i, (label, y) in enumerate(panel.hlines.items()):
                ax.axhline(y, linestyle=":", color=f"C{len(panel.lines) + i}", label=label)
            if panel.logx:
                ax.set_xscale("log", base=panel.xbase)
            if panel.xticks:
                ax.set_xticks(panel.xticks, [str(x) for x in panel.xticks])
                ax.minorticks_off()
            if panel.logy:
                ax.set_yscale("log")
        elif panel.bars:  # horizontal: long labels stay readable
            names = list(panel.bars)[::-1]
            ax.barh(names, [panel.bars[n] for n in names],
                    color=[f"C{i}" for i in range(len(names))])
            if panel.logy:
                ax.set_xscale("log")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(panel.title)
        # Bars run horizontally: the value is on x.
        ax.set_xlabel(panel.ylabel if panel.bars and not panel.lines else panel.xlabel)
        ax.set_ylabel(panel.xlabel if panel.bars and not panel.lines else panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if panel.lines:
            ax.legend(fontsize=8)
    command = "\n".join(textwrap.wrap(meta["command"], 160))
    fig.suptitle(f"{describe_machine(meta)}\n{command}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def check_out_dir(out: Path, dry_run: bool) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ScalingError(f"--out {out}: exists and is not a directory")
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
    return out


# ----------------------------------------------------------------------------- sweep outputs

SWEEP_FIELDS = ["framework", "execution", "model", "mode", "gpus", "images", "batch_per_gpu",
                "global_batch", "steps", "time_s", "wall_s", "images_per_s", "speedup",
                "efficiency_pct", "val_accuracy", "val_loss", "train_loss", "status", "log_dir"]
SWEEP_COLUMNS = [("Framework", "framework", ""), ("Execution", "execution", ""),
                 ("GPUs", "gpus", "d"), ("Images", "images", ","),
                 ("Global batch", "global_batch", "d"), ("Time (s)", "time_s", ".2f"),
                 ("Images/s", "images_per_s", ",.0f"), ("Speedup", "speedup", ".2f"),
                 ("Efficiency (%)", "efficiency_pct", ".1f"), ("Val acc", "val_accuracy", ".4f"),
                 ("Loss", "val_loss", ".4f")]


def write_sweep(out: Path, name: str, title: str, runs: list[Run], meta: dict, weak: bool,
                definitions: str) -> list[Path]:
    """NAME.csv, NAME.md (a table per mode), NAME.png (speedup and efficiency) and meta.json."""
    rows = add_scaling([run.row for run in runs if run.row], weak)
    out = Path(out)
    written = [out / f"{name}.csv", out / f"{name}.md", out / "meta.json"]
    write_csv(written[0], rows, SWEEP_FIELDS)
    body = [definitions]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        # in run order: ours, then each PyTorch execution, each over the counts
        mine = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        body += [f"## {mode}", markdown_table(SWEEP_COLUMNS, mine)]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        body.append("Failed runs:\n\n" + "\n".join(
            f"- {r['framework']} {r['execution']}, {r['mode']}, {r['gpus']} GPU(s): "
            f"{r['status']}" for r in failed))
    write_markdown(written[1], title, meta, body)
    write_meta(written[2], meta)

    ok = [r for r in rows if r["status"] == "ok"]
    lines_s, lines_e = {}, {}
    for r in sorted(ok, key=lambda r: r["gpus"]):
        key = f"{r['framework']} {r['execution']}, {r['mode']}"
        lines_s.setdefault(key, ([], []))
        lines_e.setdefault(key, ([], []))
        lines_s[key][0].append(r["gpus"])
        lines_s[key][1].append(r["speedup"])
        lines_e[key][0].append(r["gpus"])
        lines_e[key][1].append(r["efficiency_pct"])
    counts = sorted({r["gpus"] for r in ok})
    kind = "weak" if weak else "strong"
    xlabel = "GPUs" if meta["device"] == "cuda" else "ranks (CPU backend)"
    panels = [Panel(f"{kind} scaling: speedup", xlabel, "speedup", lines_s,
                    ideal=(counts, counts) if counts else None, xticks=counts, logx=True),
              Panel(f"{kind} scaling: efficiency", xlabel, "efficiency (%)", lines_e,
                    ideal=(counts, [100.0] * len(counts)) if counts else None, xticks=counts,
                    logx=True)]
    if plot_panels(out / f"{name}.png", panels, meta):
        written.append(out / f"{name}.png")
    return written


# ----------------------------------------------------------------------------- strong / weak


MODELS = ("cnn", "resnet18")  # the models both frameworks train (torch_ddp.py has their twins)
TORCH_MODES = ("eager", "compile", "graph")  # how scaling/torch_ddp.py runs the step
# PyTorch's fastest on one GPU is the whole step as a CUDA graph; the CPU has no graphs.
DEFAULT_TORCH_MODES = {"cuda": "graph", "cpu": "eager"}
CPU_COUNTS = [1, 2, 4, 8]  # the default counts where no GPU is counted


def default_val_images(train_images: int) -> int:
    """10% of the training set, at least 64 and at most 10,000 images."""
    return min(10_000, max(64, train_images // 10))


def default_counts(device: str, gpus_present: int) -> list[int]:
    """--gpus by default: 1, 2, 4, ... up to the GPUs present on CUDA; 1, 2, 4, 8 on the CPU
    (ranks share its cores) and where no GPU is seen (a dry run on a machine without one)."""
    if device != "cuda" or gpus_present < 1:
        return list(CPU_COUNTS)
    counts = [1]
    while counts[-1] * 2 <= gpus_present:
        counts.append(counts[-1] * 2)
    return counts


def parse_torch_modes(text: str | None, device: str) -> list[str]:
    """--torch-modes 'eager,graph' -> ['eager', 'graph'], in the order given; None: the
    device's default."""
    modes = list(dict.fromkeys(m.strip() for m in (text or DEFAULT_TORCH_MODES[device]).split(",")
                               if m.strip()))
    if not modes or any(m not in TORCH_MODES for m in modes):
        raise ScalingError(f"--torch-modes {text!r}: choose from {', '.join(TORCH_MODES)}")
    if device != "cuda" and "graph" in modes:
        raise ScalingError("--torch-modes graph: CUDA graphs need --device cuda")
    return modes


def add_sweep_args(p, name: str, per_gpu_default: str) -> None:
    """Flags strong.py and weak.py share."""
    g = p.add_argument_group("sweep")
    g.add_argument("--gpus", default=None,
                   help="comma-separated GPU (rank) counts (default 1, 2, 4, ... up to the GPUs "
                   "present; 1,2,4,8 on the CPU); on CUDA capped at the GPUs present")
    g.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto: cuda where a GPU is visible, else cpu (ranks over MPI on the CPU "
                   "backend, for smoke tests)")
    g.add_argument("--model", default="cnn", choices=MODELS,
                   help="the network both frameworks train (default %(default)s)")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"images per step per rank (default {per_gpu_default})")
    g.add_argument("--val-images", type=positive_int, default=None,
                   help="validation images (default 10%% of the training set, 64..10,000)")
    g.add_argument("--seed", type=int, default=0, help="dataset, data order and init seed")
    g.add_argument("--cache-dir", default=None,
                   help="dataset cache (default $DPTRAIN_CACHE or ~/.cache/dptrain)")
    g.add_argument("--torch", action="store_true",
                   help="also run PyTorch DDP (scaling/torch_ddp.py via torchrun): same model, "
                   "data, batches and optimizer")
    g.add_argument("--torch-modes", default=None, metavar="MODES",
                   help="with --torch (implies it), comma-separated from eager (DDP), compile "
                   "(DDP + torch.compile), graph (DDP with the whole step as one CUDA graph); "
                   "default graph, PyTorch's fastest on one GPU (eager on the CPU)")
    g.add_argument("--train-args", default="",
                   help="extra options for every run, e.g. --train-args=\"--optimizer sgd "
                   "--lr 0.05\" (dptrain train and torch_ddp.py accept the same names)")
    g.add_argument("--mpi-args", default="",
                   help="extra options for the launcher, e.g. --mpi-args=\"--map-by numa\"")
    g.add_argument("--launcher", default="auto",
                   help="mpirun, mpiexec, srun or a path (auto: srun inside a Slurm allocation, "
                   "else mpirun, else mpiexec); its flavour (Open MPI, MPICH/Hydra, srun) is read "
                   "from its --version and picks the flags (default %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=f"runs/scaling/{name}",
                   help="output directory (default %(default)s)")
    g.add_argument("--no-prepare", dest="prepare", action="store_false",
                   help="skip generating the dataset up front (it is then generated by each "
                   "rank of the first run)")
    g.add_argument("--quiet", action="store_true", help="do not echo the runs' output")
    g.add_argument("--dry-run", action="store_true",
                   help="print the commands, run nothing, create nothing")


class Sweep:
    """The resolved set-up of a strong or weak sweep, and how to make its runs."""

    def __init__(self, script: str, argv: list[str], args):
        self.script, self.argv, self.args = script, argv, args
        self.dry_run = args.dry_run
        self.gpus = gpu_names()
        self.device = resolve_device(args.device, self.gpus)
        counts = (parse_counts(args.gpus, "--gpus") if args.gpus is not None
                  else default_counts(self.device, len(self.gpus)))
        self.counts = cap_counts(counts, self.device, self.gpus, self.dry_run)
        self.out = check_out_dir(Path(args.out), self.dry_run)
        self.launcher = find_launcher(args.launcher, self.dry_run)
        self.extra = shlex.split(args.train_args)
        # (framework, execution) of each series; ours replays a CUDA graph unless told not to
        ours = "graph" if self.device == "cuda" and "--no-cuda-graph" not in self.extra else "eager"
        self.executions = [("ours", ours)]
        if args.torch or args.torch_modes:
            self.executions += [("torch", mode)
                                for mode in parse_torch_modes(args.torch_modes, self.device)]
            self.check_torch()
        if not self.dry_run and importlib.util.find_spec("mpi4py") is None:
            raise ScalingError("mpi4py is not installed (pip install 'dptrain[mpi]'): mpirun "
                               "would start independent one-rank runs")

    def check_torch(self) -> None:
        if self.dry_run:
            return
        if importlib.util.find_spec("torch") is None:
            raise ScalingError("--torch: PyTorch is not installed here")
        if self.args.model == "resnet18" and importlib.util.find_spec("torchvision") is None:
            raise ScalingError("--torch --model resnet18: the PyTorch twin is torchvision's "
                               "resnet18, and torchvision is not installed here")

    def runs(self, mode: str, mode_key: str, images, val_images: int, batch,
             batch_args) -> list[Run]:
        """The runs of one batch mode: every framework and execution at every count; images,
        batch (per rank) and batch_args (the flags that set it) are functions of the count."""
        return [self.run(fw, ex, mode, mode_key, g, images(g), val_images, batch(g),
                         batch_args(g))
                for fw, ex in self.executions for g in self.counts]

    def run(self, framework: str, execution: str, mode: str, mode_key: str, gpus: int,
            images: int, val_images: int, batch: int, batch_args: list[str]) -> Run:
        """One training epoch over `images` on `gpus` ranks; batch_args sets the batch."""
        log_dir = self.out / "runs" / f"{framework}-{execution}-{mode_key}-{gpus}gpu"
        model = self.args.model
        train = ["--device", self.device, "--model", model, "--train-images", str(images),
                 "--val-images", str(val_images), "--epochs", "1", "--seed", str(self.args.seed),
                 "--log-dir", str(log_dir), *batch_args]
        if self.args.cache_dir:
            train += ["--cache-dir", self.args.cache_dir]
        if self.args.quiet or not sys.stdout.isatty():
            train.append("--no-progress")  # a progress bar is for a terminal
        train += self.extra
        if framework == "ours":
            cmd = self.launcher.command(gpus, [sys.executable, "-m", "dptrain", "train", *train],
                                        self.device, shlex.split(self.args.mpi_args))
            env = self.launcher.env(self.device)
        else:
            cmd = torchrun_command(gpus, [*train, "--torch-mode", execution])
            env = torch_env(self.device)
        return Run(framework, execution, model, mode, gpus, images, batch, cmd, env, log_dir)

    def warmup_command(self) -> list[str]:
        """A few steps on one GPU before the sweep, so NVRTC compiles the model's kernels into
        CuPy's disk cache now rather than inside the first run's training time (the extra
        train args first: they may pick the precision, hence the kernels)."""
        cmd = [sys.executable, "-m", "dptrain", "train", *self.extra, "--device", "cuda",
               "--model", self.args.model, "--train-images", "256", "--val-images", "64",
               "--max-steps", "3", "--batch-size", "32", "--seed", str(self.args.seed),
               "--no-progress"]
        return cmd + (["--cache-dir", self.args.cache_dir] if self.args.cache_dir else [])

    def execute(self, runs: list[Run], largest: int, val_images: int, title: str,
                definitions: str, weak: bool) -> int:
        args = self.args
        prepare = {}
        if args.prepare:
            prepare["dataset"] = dataset_command(largest, val_images, args.seed, args.cache_dir)
        if self.device == "cuda":
            prepare["warm-up"] = self.warmup_command()
        meta = machine_meta(self.script, self.argv, self.device, self.gpus, counts=self.counts,
                            model=args.model,
                            frameworks=[f"{fw} {ex}" for fw, ex in self.executions])
        dry = " (dry run: nothing is run)" if self.dry_run else ""
        note(f"{self.script} scaling on {describe_machine(meta)}: {self.device}, {args.model}, "
             f"counts {self.counts}, {len(runs)} runs{dry}")
        failures = run_all(runs, self.dry_run, echo=not args.quiet, prepare=prepare)
        if self.dry_run:
            return 0
        for path in write_sweep(self.out, self.script, title, runs, meta, weak, definitions):
            note(f"wrote {path}")
        if failures:
            warn(f"{failures} of {len(runs)} runs failed; see the Markdown file")
        return 1 if failures else 0
