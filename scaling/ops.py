"""Op benchmarks: the NumPy CPU backend against our GPU kernels, across sizes.

On a GPU this runs `python -m dptrain bench ops` (add, mul, pow and transpose from 1e3
to 1e8 elements; square matmul 256..8192 as a @ b and a @ b^T; the reference CNN's
layers; a conv2d sweep over the batch size at the CNN's second convolution, 32->64
channels, 24x24, 3x3, padding 1; each against the NumPy backend and cuBLAS/cuDNN/CuPy)
and reads its CSV. GPU times are CUDA-event medians after warm-up; CPU times medians of
up to 3 runs, skipped where a run would take more than about a second (those rows have no
speedup). Speedup = CPU time / GPU time.

With --device cpu only the NumPy CPU backend is timed (labelled so, in this process,
through dptrain.bench.ops.cpu_rows): a smoke test.

Outputs in --out: ops.csv, ops.md, ops.png (speedup, or CPU time, against size per op),
meta.json, and on a GPU bench_ops.csv / bench_ops.png / bench_ops.log from the bench.

Examples:
  python -m scaling.ops --out scaling/results/ops
  python -m scaling.ops --quick
  python -m scaling.ops --device cpu --cpu-sizes 1000,10000 --conv-batches 1,2
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `scaling` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scaling import common  # noqa: E402
from scaling.common import Panel, ScalingError  # noqa: E402

FIELDS = ["family", "op", "size", "shape", "precision", "cpu_ms", "gpu_ms", "speedup", "ref",
          "ref_ms", "note"]
FAMILIES = [("elementwise", "elements"), ("matmul", "n (n x n x n)"), ("conv2d", "batch"),
            ("cnn layers", "")]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m scaling.ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto: cuda where a GPU is visible; cpu: NumPy timings only")
    p.add_argument("--quick", action="store_true", help="fewer sizes (passed to bench ops)")
    p.add_argument("--precision", default="tf32,fp32",
                   help="GPU matmul/conv precisions, comma-separated from tf32, fp32")
    p.add_argument("--conv-batches", default=None,
                   help="conv2d batch sizes (default 1,4,16,64,256; --quick 1,16,256; CPU 1,4,16)")
    p.add_argument("--cpu-sizes", default="1000,10000,100000,1000000",
                   help="elementwise sizes of the CPU-only run")
    p.add_argument("--out", default="runs/scaling/ops",
                   help="output directory (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- GPU


def bench_command(out: Path, args, batches) -> list[str]:
    cmd = [sys.executable, "-m", "dptrain", "bench", "ops", "--precision", args.precision,
           "--conv-batches", ",".join(map(str, batches)),
           "--csv", str(out / "bench_ops.csv"), "--plot", str(out / "bench_ops.png")]
    return cmd + (["--quick"] if args.quick else [])


def bench_rows(path: Path) -> list[dict]:
    """bench ops' CSV rows in our fields (its columns: section, op, shape, precision,
    ours_ms, ref, ref_ms, cpu_ms, speedup_vs_cpu, size, note)."""
    family = {"gemm": "matmul", "elem": "elementwise", "cnn": "cnn layers", "conv": "conv2d"}
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            num = lambda k: float(r[k]) if r.get(k) not in (None, "") else None  # noqa: E731
            rows.append({"family": family.get(r["section"], r["section"]), "op": r["op"],
                         "size": int(float(r["size"])) if r.get("size") else None,
                         "shape": r["shape"], "precision": r["precision"],
                         "cpu_ms": num("cpu_ms"), "gpu_ms": num("ours_ms"),
                         "speedup": num("speedup_vs_cpu"), "ref": r["ref"],
                         "ref_ms": num("ref_ms"), "note": r.get("note", "")})
    return rows


# ----------------------------------------------------------------------------- CPU only


def cpu_only_rows(sizes, batches) -> list[dict]:
    """NumPy backend times of the same ops, for a machine without a GPU."""
    from dptrain.bench.ops import cpu_rows

    rows = cpu_rows(sizes, batches, echo=common.note)
    for row in rows:
        row["note"] = "" if row["cpu_ms"] is not None else "skipped: over ~1 s"
    return rows


# ----------------------------------------------------------------------------- outputs


COLUMNS = [("Op", "op", ""), ("Shape", "shape", ""), ("Precision", "precision", ""),
           ("CPU NumPy (ms)", "cpu_ms", ".4f"), ("GPU ours (ms)", "gpu_ms", ".4f"),
           ("Speedup", "speedup", ".1f"), ("Reference", "ref", ""), ("Ref (ms)", "ref_ms", ".4f")]
CPU_COLUMNS = [("Op", "op", ""), ("Shape", "shape", ""), ("CPU NumPy (ms)", "cpu_ms", ".4f"),
               ("Note", "note", "")]


def write_outputs(out: Path, rows, meta, gpu: bool) -> list[Path]:
    common.write_csv(out / "ops.csv", rows, FIELDS)
    body = ["Speedup = CPU (NumPy backend) time / GPU (our kernels) time; blank where the CPU "
            "run was skipped (over ~1 s)." if gpu else
            "CPU only (NumPy backend; no GPU run: --device cpu). Times in milliseconds."]
    for family, _ in FAMILIES:
        mine = [r for r in rows if r["family"] == family]
        if mine:
            body += [f"## {family}", common.markdown_table(COLUMNS if gpu else CPU_COLUMNS, mine)]
    common.write_markdown(out / "ops.md", "NumPy CPU backend against our GPU kernels", meta, body)
    common.write_meta(out / "meta.json", meta)
    written = [out / "ops.csv", out / "ops.md", out / "meta.json"]
    key = "speedup" if gpu else "cpu_ms"
    panels = []
    for family, xlabel in FAMILIES:
        lines = {}
        for r in sorted((r for r in rows if r["family"] == family), key=lambda r: r["size"] or 0):
            if r.get("size") and r.get(key):
                label = f"{r['op']} {r.get('precision') or ''}".strip()
                lines.setdefault(label, ([], []))
                lines[label][0].append(r["size"])
                lines[label][1].append(r[key])
        if lines:
            ylabel = "speedup, GPU over NumPy CPU" if gpu else "NumPy CPU time (ms)"
            panels.append(Panel(family, xlabel, ylabel, lines, logx=True, logy=True,
                                xbase=10 if family == "elementwise" else 2))
    if panels and common.plot_panels(out / "ops.png", panels, meta):
        written.append(out / "ops.png")
    return written


def main(argv) -> int:
    args = parse_args(argv)
    gpus = common.gpu_names()
    device = common.resolve_device(args.device, gpus)
    if device == "cuda" and not gpus and not args.dry_run:
        raise ScalingError("--device cuda: no GPU visible (CuPy and nvidia-smi found none)")
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    if not precisions or any(p not in ("tf32", "fp32") for p in precisions):
        raise ScalingError(f"--precision {args.precision!r}: choose from tf32, fp32")
    default_batches = "1,4,16" if device == "cpu" else "1,16,256" if args.quick else "1,4,16,64,256"
    batches = common.parse_counts(args.conv_batches or default_batches, "--conv-batches")
    sizes = common.parse_counts(args.cpu_sizes, "--cpu-sizes")
    out = Path(args.out)
    meta = common.machine_meta("ops", argv, device, gpus, gpu_used=gpus[:1])
    common.note(f"ops on {common.describe_machine(meta)}, {device}")
    if args.dry_run:
        if device == "cuda":
            common.note(f"[1/1] {common.shell_line(bench_command(out, args, batches))}")
        else:
            common.note(f"[1/1] NumPy CPU timings: elementwise sizes {sizes}, matmul 64..512, "
                        f"conv2d batches {batches}")
        return 0
    out = common.check_out_dir(out, dry_run=False)
    if device == "cuda":
        cmd = bench_command(out, args, batches)
        common.note(f"[1/1] {common.shell_line(cmd)}")
        rc = common.execute(cmd, {}, out / "bench_ops.log")
        if rc != 0:
            common.warn(f"bench ops exited with {rc} (see {out / 'bench_ops.log'})")
        rows = bench_rows(out / "bench_ops.csv") if (out / "bench_ops.csv").is_file() else []
    else:
        common.note("[1/1] NumPy CPU backend only (--device cpu)")
        rows = cpu_only_rows(sizes, batches)
    for path in write_outputs(out, rows, meta, gpu=device == "cuda"):
        common.note(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("scaling/ops.py", main))
