"""What a run reports: metrics.jsonl, config.json and summary.json, and the training throughput."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from dptrain.fileio import atomic_write


def strict(value):
    """`value` with every NaN or infinity replaced by None, for strict JSON (null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(record, **kwargs) -> str:
    """Strict JSON: non-finite numbers become null (never a bare NaN)."""
    return json.dumps(strict(record), allow_nan=False, **kwargs)


# The files a run writes into its log directory.
RUN_FILES = ("metrics.jsonl", "summary.json", "config.json")


def fresh_log_dir(log_dir, overwrite: bool = False) -> tuple[str, str | None]:
    """Where a run logs: ``log_dir`` itself when it holds no run's files (RUN_FILES) or
    ``overwrite`` is set; else the first free ``log_dir-1``, ``log_dir-2``, ... Returns
    (directory, a note saying so or None), so an earlier run's files are never silently
    replaced."""
    path = Path(log_dir)
    if overwrite or not path.is_dir() or not any((path / name).exists() for name in RUN_FILES):
        return str(log_dir), None
    n = 1
    while (candidate := path.with_name(f"{path.name}-{n}")).exists():
        n += 1
    return str(candidate), (f"--log-dir {log_dir} holds an earlier run; writing to {candidate} "
                            "instead (--overwrite reuses it)")


def _dump(path: Path, record: dict) -> None:
    text = dumps(record, indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def _entries_up_to(path: Path, step: int) -> list[str]:
    """The lines of metrics file `path` whose step is at most `step` (a torn last line, left by
    a killed run, goes too)."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step and line.endswith("\n"):
            kept.append(line)
    return kept


class MetricsLog:
    """metrics.jsonl (one object per line, each with its wall-clock ``time``, Unix seconds),
    config.json and summary.json under the log directory, in strict JSON. Files of an earlier
    run there are replaced: the new run's summary.json never sits beside an old one. A run
    resumed at `resume_step` continues the metrics of the run it continues, without the
    entries past that step (the steps it runs again), so the log reads as one run's.

    A file that cannot be written (a full disk) is one warning naming it and the cause, through
    `warn`; the run goes on without it (what the log already holds stays)."""

    def __init__(self, log_dir: str | None, resume_step: int = 0, warn=None):
        self.dir = Path(log_dir) if log_dir else None
        self.file = None
        self.warn = warn or (lambda text: print(text, file=sys.stderr, flush=True))
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            for name in RUN_FILES[1:]:
                (self.dir / name).unlink(missing_ok=True)
            path = self.dir / "metrics.jsonl"
            try:
                if resume_step > 0:
                    kept = _entries_up_to(path, resume_step)
                    atomic_write(path, lambda f: f.write("".join(kept).encode()))
                self.file = open(path, "a" if resume_step > 0 else "w")
            except OSError as exc:
                self._failed("metrics.jsonl", exc, "the run goes on without logging its metrics")

    def _failed(self, name: str, exc: OSError, then: str) -> None:
        self.warn(f"dptrain: warning: {self.dir / name}: cannot write ({exc.strerror or exc}); "
                  f"{then}")

    def write(self, record: dict):
        if self.file:
            try:
                self.file.write(dumps({**record, "time": round(time.time(), 3)}) + "\n")
                self.file.flush()
            except OSError as exc:
                self._failed("metrics.jsonl", exc, "the run goes on without logging its metrics")
                self.close()

    def config(self, record: dict):
        """The run's effective configuration (flags, config file and defaults resolved)."""
        if self.dir:
            try:
                _dump(self.dir / "config.json", record)
            except OSError as exc:
                self._failed("config.json", exc, "the run goes on without it")

    def summary(self, record: dict):
        if self.dir:
            try:
                _dump(self.dir / "summary.json", record)
            except OSError as exc:
                self._failed("summary.json", exc, "the run's results are in its last lines")

    def close(self):
        if self.file:
            file, self.file = self.file, None
            try:
                file.close()
            except OSError:  # what could not be flushed was reported when it was written
                pass


class Throughput:
    """Images per second of training time. The clock starts after the first `warmup_steps`
    calls of ``step()`` (a run's eager warm-up steps and the capture of its graph, where
    kernels may still compile: not training speed); ``pause()`` / ``resume()`` leave out what
    is not training (evaluation); ``window()`` closes the steps counted since the last window
    and returns their rate (None while no step has been counted yet)."""

    def __init__(self, images_per_step: int, warmup_steps: int = 0):
        self.images_per_step = images_per_step
        self.warmup_steps, self.steps_seen = int(warmup_steps), 0
        self.total_s, self.total_steps = 0.0, 0
        self.window_s, self.window_steps = 0.0, 0
        self.running, self.paused = self.warmup_steps == 0, False
        self.started = self.began = time.perf_counter()

    def step(self):
        self.steps_seen += 1
        if self.running:
            self.window_steps += 1
        elif self.steps_seen >= self.warmup_steps:  # the clock starts now
            self.running = True
            self.started = time.perf_counter()

    def pause(self):
        if self.running and not self.paused:
            self.window_s += time.perf_counter() - self.started
        self.paused = True

    def resume(self):
        self.paused = False
        self.started = time.perf_counter()

    def window(self) -> float | None:
        """Images/s of the steps since the last window (the clock keeps running)."""
        was_paused = self.paused
        self.pause()
        rate = (self.window_steps * self.images_per_step / self.window_s
                if self.window_s and self.window_steps else None)
        self.total_s += self.window_s
        self.total_steps += self.window_steps
        self.window_s, self.window_steps = 0.0, 0
        if not was_paused:
            self.resume()
        return rate

    def wall(self) -> float:
        """Seconds since the meter was made, evaluation included."""
        return time.perf_counter() - self.began

    @property
    def rate(self) -> float:
        """Images/s over every closed window."""
        return self.total_steps * self.images_per_step / self.total_s if self.total_s else 0.0
