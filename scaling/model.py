"""A scaling model: predicted step time and efficiency of data-parallel training at 1-512 GPUs.

    step(b, n) = compute(b) + exposed_comm(n)

* compute(b) = a + c * b: the one-GPU step time at per-GPU batch b, a straight line through
  the one-GPU runs in scaling/results (a: the per-step cost that does not shrink with the
  batch, launches and small kernels; c: time per image).
* Each bucket of the flat gradient buffer (the model's real buckets, from dptrain's
  FlatParameters at --bucket-mb, padded for n ranks) is reduce-scattered after backward
  produces it and all-gathered before the next forward needs it. One ring collective of S
  bytes over n ranks takes
      t(S, n) = alpha + (n - 1) * hop + (n - 1) / n * S / B
  alpha (the fixed cost of one collective) and B (the bus bandwidth within a host) are fitted
  to the measured reduce-scatter + all-gather times (scaling/results/comm-*.csv); hop is the
  latency of one ring step (--hop-us-intra within a host, --hop-us-inter once the ring
  crosses hosts); across hosts B is the smaller of the host's bus bandwidth and its network
  (--nics-per-host x --nic-gbps, at --network-efficiency).
* With overlap (what dptrain does): the reduce-scatters overlap the rest of backward (about
  2/3 of compute) except the last bucket backward produces, and the all-gathers overlap the
  forward (about 1/3) except the first bucket it needs: exposed = t(last RS) + t(first AG) +
  what the others do not hide. Without overlap every collective is exposed. In bf16 / fp16
  the all-gathers move the parameters' 16-bit copy, half the bytes (--gather-bytes 2); with
  `train --grad-exchange bf16` the reduce-scatters move a bfloat16 copy of the gradients,
  half the bytes too (--scatter-bytes 2). The compute line and the link are still fitted
  to runs with fp32 reduce-scatters: no 2-GPU run of the bf16 exchange exists yet to refit on.

Efficiency: strong scaling at fixed global batch G, E = compute(G) / (n * step(G/n, n)); weak
scaling at fixed per-GPU batch b, E = compute(b) / step(b, n). The model is checked against
the 1- and 2-GPU measurements in scaling/results (predicted against measured), then predicts
8, 64 and 512 GPUs and the global batch each needs for 90% strong-scaling efficiency.

    python -m scaling.model                      # tables on stdout
    python -m scaling.model --out scaling/results/model
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `scaling` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scaling import common  # noqa: E402
from scaling.common import ScalingError  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MB = 2**20  # the comm benchmark's sizes are MiB


@dataclass
class Link:
    alpha_s: float  # fixed cost of one collective
    bus_bytes_s: float  # bus bandwidth within a host
    hop_intra_s: float
    hop_inter_s: float
    net_bytes_s: float  # a host's network bandwidth (all NICs)
    gpus_per_host: int

    def collective_s(self, nbytes: float, n: int) -> float:
        """One ring reduce-scatter or all-gather of a `nbytes` buffer over n ranks."""
        if n == 1:
            return 0.0
        cross = n > self.gpus_per_host
        hop = self.hop_inter_s if cross else self.hop_intra_s
        bandwidth = min(self.bus_bytes_s, self.net_bytes_s) if cross else self.bus_bytes_s
        return self.alpha_s + (n - 1) * hop + (n - 1) / n * nbytes / bandwidth


@dataclass
class Compute:
    fixed_s: float  # a
    per_image_s: float  # c

    def step_s(self, batch: float) -> float:
        return self.fixed_s + self.per_image_s * batch


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x."""
    n = len(points)
    if n < 2 or len({x for x, _ in points}) < 2:
        raise ScalingError("need measurements at two or more sizes to fit a line")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x, _ in points))
    return my - slope * mx, slope


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def measured_runs(results: Path) -> list[dict]:
    """Our runs of the strong and weak sweeps of the CNN (the model this one describes; older
    sweeps have no model column and ran it): kind, gpus, per-GPU and global batch, step time."""
    runs = []
    for path in sorted(results.glob("*/strong.csv")) + sorted(results.glob("*/weak.csv")):
        kind = "weak" if path.name == "weak.csv" else "strong"
        for row in read_rows(path):
            ours_ok = row["framework"] == "ours" and row["status"] == "ok"
            if not ours_ok or row.get("model", "cnn") != "cnn":
                continue
            runs.append({"source": path.parent.name, "kind": kind, "mode": row["mode"],
                         "gpus": int(row["gpus"]), "batch_per_gpu": int(row["batch_per_gpu"]),
                         "global_batch": int(row["global_batch"]),
                         "step_s": float(row["time_s"]) / int(row["steps"]),
                         "efficiency_pct": float(row["efficiency_pct"])})
    if not runs:
        raise ScalingError(f"no strong/weak results under {results}")
    return runs


def fit_compute(runs: list[dict]) -> Compute:
    points = [(r["batch_per_gpu"], r["step_s"]) for r in runs if r["gpus"] == 1]
    fixed, per_image = fit_line(points)
    return Compute(fixed, per_image)


def newest_sweep(results: Path, runs: list[dict]) -> str | None:
    """The newest sweep (by its meta.json date) with 1-GPU runs at two or more batch sizes:
    today's step, which the predictions should be made from (older sweeps ran older kernels
    or precisions)."""
    dated = []
    for source in {r["source"] for r in runs}:
        sizes = {r["batch_per_gpu"] for r in runs if r["source"] == source and r["gpus"] == 1}
        meta = results / source / "meta.json"
        if len(sizes) >= 2 and meta.exists():
            dated.append((json.loads(meta.read_text()).get("date", ""), source))
    return max(dated)[1] if dated else None


def fit_link(results: Path, args) -> Link:
    files = sorted(results.glob("comm-*.csv"))
    if not files:
        raise ScalingError(f"no comm-*.csv under {results} (python -m dptrain bench comm --csv)")
    rows = [r for f in files for r in read_rows(f) if int(r["ranks"]) == 2]
    # RS + AG of S bytes on 2 ranks: 2 * alpha + 2 * (1/2) * S / B (hops folded into alpha)
    pair = [(float(r["size_mb"]) * MB, float(r["rs_ag_ms"]) / 1e3) for r in rows]
    intercept, slope = fit_line(pair)
    return Link(alpha_s=max(intercept / 2, 0.0), bus_bytes_s=1.0 / slope,
                hop_intra_s=args.hop_us_intra * 1e-6, hop_inter_s=args.hop_us_inter * 1e-6,
                net_bytes_s=args.nics_per_host * args.nic_gbps / 8 * 1e9
                * args.network_efficiency, gpus_per_host=args.gpus_per_host)


def bucket_bytes(model: str, image_shape, classes: int, bucket_mb: float, n: int) -> list[int]:
    """The model's gradient buckets in bytes, in the order backward produces them."""
    import dptrain
    from dptrain.distributed.flat import FlatParameters
    from dptrain.nn import build_model

    dptrain.manual_seed(0)
    net = build_model(model, image_shape, classes)
    flat = FlatParameters(net.parameters(), n, int(bucket_mb * MB))
    return [(b.stop - b.start) * flat.dtype.itemsize for b in flat.buckets]


def exposed_s(buckets: list[int], n: int, link: Link, compute_s: float, overlap: bool,
              gather_fraction: float = 1.0, scatter_fraction: float = 1.0) -> float:
    """Communication time per step that compute waits for; the all-gathers move
    `gather_fraction` of each bucket's (fp32 gradient) bytes: 0.5 where they send the
    parameters' 16-bit copy; the reduce-scatters `scatter_fraction` (0.5: bf16 exchange)."""
    rs = [link.collective_s(b * scatter_fraction, n) for b in buckets]
    ag = [link.collective_s(b * gather_fraction, n) for b in buckets]
    if not overlap:
        return sum(rs) + sum(ag)
    # buckets[0] holds the last layers: backward produces it first and the forward needs it
    # last, so the last bucket is both the last reduce-scattered and the first gathered.
    hidden_rs = max(0.0, sum(rs[:-1]) - 2 / 3 * compute_s)
    hidden_ag = max(0.0, sum(ag[:-1]) - 1 / 3 * compute_s)
    return rs[-1] + ag[-1] + hidden_rs + hidden_ag


class Model:
    def __init__(self, compute: Compute, link: Link, args):
        self.compute, self.link, self.args = compute, link, args

    def step_s(self, batch_per_gpu: float, n: int, overlap: bool = True) -> float:
        c = self.compute.step_s(batch_per_gpu)
        buckets = bucket_bytes(self.args.model, (1, 48, 48), 7, self.args.bucket_mb, n)
        return c + exposed_s(buckets, n, self.link, c, overlap,
                             getattr(self.args, "gather_bytes", 4) / 4,
                             getattr(self.args, "scatter_bytes", 4) / 4)

    def strong(self, global_batch: float, n: int, overlap: bool = True) -> float:
        return self.compute.step_s(global_batch) / (n * self.step_s(global_batch / n, n, overlap))

    def weak(self, batch_per_gpu: float, n: int, overlap: bool = True) -> float:
        return self.compute.step_s(batch_per_gpu) / self.step_s(batch_per_gpu, n, overlap)

    def batch_for(self, n: int, target: float = 0.9) -> int | None:
        """The smallest global batch (a multiple of n) with strong efficiency >= target."""
        per_gpu = 1
        while per_gpu <= 2**20:
            if self.strong(per_gpu * n, n) >= target:
                return per_gpu * n
            per_gpu *= 2
        return None


def check_rows(model: Model, runs: list[dict]) -> list[dict]:
    """Predicted against measured efficiency for every measured multi-GPU run. A sweep with
    1-GPU runs at two batch sizes is predicted from its own compute line (sweeps of other
    kernels or precisions step at other speeds); one with a single batch size from `model`'s
    line scaled through its 1-GPU step."""
    models = {}
    for source in {r["source"] for r in runs}:
        mine = [r for r in runs if r["source"] == source]
        try:
            own = fit_compute(mine)
        except ScalingError:
            one = [r for r in mine if r["gpus"] == 1]
            k = one[0]["step_s"] / model.compute.step_s(one[0]["batch_per_gpu"]) if one else 1.0
            own = Compute(model.compute.fixed_s * k, model.compute.per_image_s * k)
        models[source] = Model(own, model.link, model.args)
    base = {}
    for r in runs:
        if r["gpus"] == 1:
            base[(r["source"], r["mode"])] = r
    rows = []
    for r in runs:
        one = base.get((r["source"], r["mode"]))
        if one is None:
            continue
        m = models[r["source"]]
        if r["gpus"] == 1:  # how well the compute line fits the run it was fitted to
            rows.append({"source": r["source"], "kind": r["kind"], "mode": r["mode"],
                         "gpus": 1, "global_batch": r["global_batch"],
                         "measured_step_ms": r["step_s"] * 1e3,
                         "predicted_step_ms": m.step_s(r["batch_per_gpu"], 1) * 1e3,
                         "measured_pct": 100.0, "predicted_pct": 100.0, "error_points": 0.0})
            continue
        n = r["gpus"]
        if r["kind"] == "weak":
            predicted = m.weak(r["batch_per_gpu"], n)
            measured = one["step_s"] / r["step_s"]
        else:
            predicted = m.strong(r["global_batch"], n) if one["global_batch"] == r[
                "global_batch"] else m.weak(r["batch_per_gpu"], n)
            measured = r["efficiency_pct"] / 100
        rows.append({"source": r["source"], "kind": r["kind"], "mode": r["mode"], "gpus": n,
                     "global_batch": r["global_batch"],
                     "measured_step_ms": r["step_s"] * 1e3,
                     "predicted_step_ms": m.step_s(r["batch_per_gpu"], n) * 1e3,
                     "measured_pct": measured * 100, "predicted_pct": predicted * 100,
                     "error_points": (predicted - measured) * 100})
    return rows


def prediction_rows(model: Model, counts: list[int], strong_batch: int, weak_batch: int):
    rows = []
    for n in counts:
        rows.append({"gpus": n,
                     "strong_pct": model.strong(strong_batch, n) * 100,
                     "strong_no_overlap_pct": model.strong(strong_batch, n, False) * 100,
                     "weak_pct": model.weak(weak_batch, n) * 100,
                     "weak_no_overlap_pct": model.weak(weak_batch, n, False) * 100,
                     "exposed_us": (model.step_s(weak_batch, n)
                                    - model.compute.step_s(weak_batch)) * 1e6,
                     "batch_for_90pct": model.batch_for(n)})
    return rows


CHECK_COLUMNS = [("Sweep", "source", ""), ("GPUs", "gpus", "d"),
                 ("Global batch", "global_batch", "d"),
                 ("Step ms measured", "measured_step_ms", ".3f"),
                 ("Step ms predicted", "predicted_step_ms", ".3f"),
                 ("Efficiency % measured", "measured_pct", ".1f"),
                 ("Efficiency % predicted", "predicted_pct", ".1f"),
                 ("Error (points)", "error_points", "+.1f")]


def prediction_columns(strong_batch, weak_batch):
    return [("GPUs", "gpus", "d"),
            (f"Strong % (global {strong_batch})", "strong_pct", ".1f"),
            ("no overlap", "strong_no_overlap_pct", ".1f"),
            (f"Weak % ({weak_batch}/GPU)", "weak_pct", ".1f"),
            ("no overlap", "weak_no_overlap_pct", ".1f"),
            ("Exposed comm us (weak)", "exposed_us", ".0f"),
            ("Global batch for 90% strong", "batch_for_90pct", "")]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m scaling.model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="folder of measured sweeps (*/strong.csv, */weak.csv, comm-*.csv)")
    p.add_argument("--gpus", default="8,64,512", help="GPU counts to predict")
    p.add_argument("--model", default="cnn", help="model whose gradient buckets are exchanged")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--gather-bytes", type=int, choices=(2, 4), default=4,
                   help="bytes per parameter in the all-gather: 4 (fp32 / tf32, and the "
                        "16-bit runs measured before the 16-bit shadow), 2 (bf16 / fp16 now)")
    p.add_argument("--scatter-bytes", type=int, choices=(2, 4), default=4,
                   help="bytes per gradient in the reduce-scatter: 4 (--grad-exchange fp32, "
                        "every measured run), 2 (--grad-exchange bf16)")
    p.add_argument("--strong-batch", type=common.positive_int, default=1024,
                   help="global batch of the strong-scaling prediction")
    p.add_argument("--weak-batch", type=common.positive_int, default=256,
                   help="per-GPU batch of the weak-scaling prediction")
    p.add_argument("--gpus-per-host", type=common.positive_int, default=8)
    p.add_argument("--nics-per-host", type=common.positive_int, default=4)
    p.add_argument("--nic-gbps", type=float, default=400.0, help="one NIC, Gbit/s")
    p.add_argument("--network-efficiency", type=float, default=0.9,
                   help="fraction of the NICs' line rate a ring achieves")
    p.add_argument("--hop-us-intra", type=float, default=1.0,
                   help="latency of one ring step within a host (us)")
    p.add_argument("--hop-us-inter", type=float, default=3.0,
                   help="latency of one ring step once the ring crosses hosts (us)")
    p.add_argument("--out", type=Path, default=None, help="also write model.md and model.csv")
    return p.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    counts = common.parse_counts(args.gpus, "--gpus")
    runs = measured_runs(args.results)
    newest = newest_sweep(args.results, runs)
    fitted = [r for r in runs if r["source"] == newest] if newest else runs
    model = Model(fit_compute(fitted), fit_link(args.results, args), args)
    link, comp = model.link, model.compute
    assumptions = (
        f"Compute (fitted to the 1-GPU runs of {newest or 'every sweep'}"
        f"{', the newest sweep with two batch sizes' if newest else ''}): step = "
        f"{comp.fixed_s * 1e3:.3f} ms + "
        f"{comp.per_image_s * 1e6:.2f} us x per-GPU batch. Collective (fitted to the 2-rank "
        f"RS+AG measurements): alpha {link.alpha_s * 1e6:.1f} us, bus bandwidth "
        f"{link.bus_bytes_s / 1e9:.0f} GB/s within a host; ring step {args.hop_us_intra:g} us "
        f"within a host, {args.hop_us_inter:g} us across hosts; {args.gpus_per_host} GPUs per "
        f"host; network {args.nics_per_host} x {args.nic_gbps:g} Gb/s at "
        f"{args.network_efficiency:.0%} = {link.net_bytes_s / 1e9:.0f} GB/s per host. "
        f"Bytes per parameter: all-gather {args.gather_bytes}, reduce-scatter "
        f"{args.scatter_bytes}. Gradient buckets ({args.model}, {args.bucket_mb:g} MB): "
        + ", ".join(f"{b / 1e3:.1f} kB" for b in bucket_bytes(args.model, (1, 48, 48), 7,
                                                               args.bucket_mb, 2)))
    checks = check_rows(model, runs)
    predictions = prediction_rows(model, counts, args.strong_batch, args.weak_batch)
    check_md = common.markdown_table(CHECK_COLUMNS, checks)
    pred_md = common.markdown_table(prediction_columns(args.strong_batch, args.weak_batch),
                                    predictions)
    print("Assumptions: " + assumptions + "\n")
    print("Predicted against measured (our runs in " + str(args.results.name) + "/):\n"
          + check_md + "\n")
    print("Predictions:\n" + pred_md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = common.machine_meta("model", ["python", "-m", "scaling.model",
                                             *(argv or [])], "cpu", [])
        common.write_markdown(args.out / "model.md", "Scaling model: predicted and measured",
                              meta, ["## Assumptions", assumptions + "\n\n" + __doc__.split(
                                  "\n\n")[1], "## Predicted against measured (1 and 2 GPUs)",
                                     check_md, "## Predictions", pred_md])
        common.write_csv(args.out / "model.csv", checks + predictions,
                         sorted({k for row in checks + predictions for k in row}))
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main("python -m scaling.model", main))
