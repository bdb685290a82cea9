"""A per-step timeline of the gradient exchange: when each bucket's reduce-scatter and
all-gather ran on the communication stream, and marks on the compute stream (a bucket's
gradients complete, the forward has its gathered bucket, backward waits for the exchange).

Times come from the backend's runtime (``stamp`` / ``stamp_seconds``): the host clock on the
CPU, where each collective is finished when its call returns; on the GPU the device's own
clock, written by a one-thread kernel on the stream the work runs on. So a step captured as
a CUDA graph keeps its stamps as kernel nodes: record the timeline while the step is
captured (``clear()`` before each eager call, not after the capture) and read it after any
replay, which rewrote them. A stamp costs one kernel launch on its stream.

JSON (``to_dict``), one file per rank:
  {"format": "dptrain-timeline", "version": 1, "rank": r, "ranks": n, "device": "cpu",
   "exchange": "fp32"|"bf16", "buckets": [{"index": i, "elements": k, "params": m}, ...],
   "events": [{"lane": "compute"|"comm", "name": str, "bucket": i or null,
               "start_s": float, "end_s": float}, ...]}
Times are seconds from the step's first mark; a mark has start_s == end_s. Buckets are
indexed as the flat buffer holds them: bucket 0 holds the last layers (backward's first).
"""
from __future__ import annotations

import contextlib
import json

FORMAT, VERSION = "dptrain-timeline", 1
LANES = ("compute", "comm")


class Timeline:
    def __init__(self, runtime, rank: int = 0, ranks: int = 1, **meta):
        self.rt, self.rank, self.ranks, self.meta = runtime, rank, ranks, meta
        self.events = []  # [lane, name, bucket, start stamp, end stamp]

    def clear(self):
        self.events = []
        self.rt.clear_stamps()

    def mark(self, lane, name, stream=None, bucket=None):
        stamp = self.rt.stamp(stream)
        self.events.append([lane, name, bucket, stamp, stamp])

    @contextlib.contextmanager
    def span(self, lane, name, stream=None, bucket=None):
        event = [lane, name, bucket, self.rt.stamp(stream), None]
        self.events.append(event)
        yield
        event[4] = self.rt.stamp(stream)

    def to_dict(self, buckets=()) -> dict:
        """The events in seconds (waits for the stamps on the GPU), with the buckets' sizes."""
        stamps = [s for e in self.events for s in e[3:5]]
        seconds = self.rt.stamp_seconds(stamps) if stamps else []
        events = [{"lane": lane, "name": name, "bucket": bucket,
                   "start_s": seconds[2 * k], "end_s": seconds[2 * k + 1]}
                  for k, (lane, name, bucket, _, _) in enumerate(self.events)]
        return {"format": FORMAT, "version": VERSION, "rank": self.rank, "ranks": self.ranks,
                **self.meta,
                "buckets": [{"index": i, "elements": b.stop - b.start, "params": len(b.params)}
                            for i, b in enumerate(buckets)],
                "events": events}

    def write(self, path, buckets=()):
        with open(path, "w") as f:
            json.dump(self.to_dict(buckets), f, indent=1)


def read(path) -> dict:
    """A timeline written by ``Timeline.write``; ValueError naming what is wrong."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a dptrain timeline (no format {FORMAT!r})")
    for event in data.get("events", []):
        if event.get("lane") not in LANES or not event["start_s"] <= event["end_s"]:
            raise ValueError(f"{path}: bad event {event}")
    return data


def summarize(data) -> str:
    """One paragraph of a timeline: the step, the exposed wait for the exchange (backward's
    end to the compute stream having it) and each collective's span, in microseconds."""
    events = data["events"]

    def at(name):
        return next((e["start_s"] for e in events if e["name"] == name), None)

    us = lambda s: f"{1e6 * s:.0f}"  # noqa: E731
    begin, end = at("step_begin"), at("step_end")
    parts = [f"rank {data['rank']}/{data['ranks']}"]
    if begin is not None and end is not None:
        parts.append(f"step {us(end - begin)} us")
    if at("backward_end") is not None and at("exchange_waited") is not None:
        parts.append(f"exposed wait {us(at('exchange_waited') - at('backward_end'))} us")
    for kind in ("reduce_scatter", "all_gather"):
        spans = [e for e in events if e["name"] == kind]
        if spans:
            parts.append(kind + " " + ", ".join(
                f"b{e['bucket']} {us(e['start_s'])}+{us(e['end_s'] - e['start_s'])}"
                for e in spans))
    return "; ".join(parts)

