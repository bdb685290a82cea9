"""Where a step's time goes: the device time of every backend op it calls.

``with OpProfile(be) as prof: step()`` wraps every op of the backend's contract (``OPS``) so
that each outermost call is bracketed by a timing span: CUDA events on the current stream
where the device works asynchronously (the runtime records graphs), the host clock
otherwise. Ops called from inside another op are counted in their caller. Run it on an eager
step: a replayed graph issues no op calls. ``prof.rows()`` aggregates the spans by op and
first operand shape; most ops are one kernel launch (a few, such as a split-K product, two).
Eager spans also hold the gaps where the device waited for the host, so small ops look slow.

``kernel_rows(step, sync)`` is the other view: the device time of every kernel a replayed
step runs, from the CUDA profiling interface's kernel records (taken through PyTorch's
profiler, which records every kernel of the process, ours included): the true cost of each
kernel inside the graph, without host gaps. It needs PyTorch; None without it.
"""
from __future__ import annotations

import time

from dptrain import backend as backends


class HostSpans:
    """The host clock around each span: right where every op has finished when it returns."""

    def __init__(self):
        self.pairs, self.start = [], None

    def begin(self):
        self.start = time.perf_counter()

    def end(self, name):
        self.pairs.append((name, (time.perf_counter() - self.start) * 1e3))

    def read(self) -> list:
        return list(self.pairs)


def spans_for(be):
    """Device-event spans where work is asynchronous, else host-clock spans."""
    if be.runtime.records_graphs:
        from dptrain.backend.cuda import vendor

        return vendor.EventSpans()
    return HostSpans()


def _shape_text(args) -> str:
    for a in args:
        shape = None if isinstance(a, type) else getattr(a, "shape", None)
        if isinstance(shape, tuple):
            return "x".join(str(d) for d in shape) or "scalar"
    return ""


class OpProfile:
    """Times every backend op called inside the ``with`` block (see the module docstring)."""

    SKIP = ("new_workspace",)

    def __init__(self, be):
        self.be, self.spans, self.depth, self.saved = be, spans_for(be), 0, {}

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            self.spans.begin()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.end(f"{name} {_shape_text(args)}".strip())
                self.depth -= 1

        return timed

    def __enter__(self):
        for name in backends.OPS:
            fn = getattr(self.be, name, None)
            if callable(fn) and name not in self.SKIP:
                self.saved[name] = fn
                setattr(self.be, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.be, name, fn)
        self.saved = {}

    def reset(self):
        """Forget the spans so far (warm-up steps)."""
        self.spans = spans_for(self.be)

    def rows(self, steps: int = 1) -> list[dict]:
        """[{"op", "calls", "ms", "pct"}] per op and operand shape, per step, slowest first."""
        totals: dict[str, list] = {}
        for name, ms in self.spans.read():
            entry = totals.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += ms
        whole = sum(ms for _, ms in totals.values()) or 1.0
        rows = [{"op": name, "calls": calls / steps, "ms": ms / steps, "pct": 100 * ms / whole}
                for name, (calls, ms) in totals.items()]
        return sorted(rows, key=lambda r: -r["ms"])


def format_rows(rows, title: str, top: int = 25) -> str:
    """The profile as text: the `top` slowest entries and the rest summed."""
    lines = [title, f"  {'ms':>8} {'%':>6} {'calls':>6}  op and first operand's shape"]
    for r in rows[:top]:
        lines.append(f"  {r['ms']:8.3f} {r['pct']:6.1f} {r['calls']:6.0f}  {r['op']}")
    rest = rows[top:]
    if rest:
        lines.append(f"  {sum(r['ms'] for r in rest):8.3f} {sum(r['pct'] for r in rest):6.1f} "
                     f"{sum(r['calls'] for r in rest):6.0f}  ({len(rest)} more)")
    lines.append(f"  {sum(r['ms'] for r in rows):8.3f}  100.0 {sum(r['calls'] for r in rows):6.0f}"
                 f"  sum of op times")
    return "\n".join(lines)


def kernel_rows(step, sync, steps: int = 5):
    """[{"op": kernel, "calls", "ms", "pct"}] per step of the kernels `steps` calls of the
    (warmed-up) `step` run, slowest first; None where PyTorch is not installed."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time / 1e3  # us -> ms
    whole = sum(ms for _, ms in totals.values()) or 1.0
    rows = [{"op": name[:120], "calls": calls / steps, "ms": ms / steps, "pct": 100 * ms / whole}
            for name, (calls, ms) in totals.items()]
    return sorted(rows, key=lambda r: -r["ms"])
