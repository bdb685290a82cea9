"""python -m dptrain bench ops: our kernels against cuBLAS / cuDNN / CuPy and the NumPy backend.

Sections (``--sections``):
  gemm  square GEMM 256..8192 in three layouts: ``matmul`` (a @ b), ``matmul_nt`` (a @ b^T,
        the x @ W^T of a linear layer, where Hopper's wgmma kernel applies) and ``matmul_tn``
        (a^T @ b, a weight gradient); each row names the kernel that ran and its relative
        error against a float64 product of the same (rounded) operands
  cnn   the reference CNN's layer shapes at batch 256: its FC GEMMs and its three 3x3
        convolutions, forward / backward-data / backward-weight
  resnet ResNet-18's convolutions at 48x48x1 and batch 256 (every distinct channel count,
        size, filter and stride), each pass with the kernel our plan picks; cuDNN on
        channels-last tensors, as PyTorch's fastest mode runs them
  conv  conv2d forward over the batch size (``--conv-batches``) at the CNN's conv2 shape
  elem  add, mul, pow and transpose from 1e3 to 1e8 elements
GPU times are CUDA-event medians after warm-up; CPU (NumPy backend) times are medians of up to
3 runs, skipped where a run would take > ~1 s. Our ops run through the CUDA backend
(``dptrain.backend.get("cuda")``) under ``be.runtime.precision_scope``. Precisions bf16 and
fp16 run the GEMM and convolution rows on 16-bit copies of the operands (our b16 kernels),
against cuBLAS / cuDNN through PyTorch in the same dtype; the float32 precisions compare with
cuBLAS through CuPy and cuDNN through PyTorch.

    python -m dptrain bench ops [--quick] [--precision tf32,fp32,bf16,fp16]
                                [--sections gemm,cnn,resnet,conv,elem]
                                [--conv-batches 1,4,16] [--csv out.csv] [--plot out.png]

Also used in-process by the scaling scripts: ``cpu_rows`` (the NumPy timings of a machine
without a GPU) and the timing helpers ``gpu_time_ms`` and ``CpuTimer``.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import statistics
import sys
import time
import traceback

import numpy as np

from dptrain.backend import cpu

BATCH = 256
# (name, C_in, C_out, H=W) of the reference CNN's convolutions: 3x3, stride 1, padding 1.
CNN_CONVS = [("conv1", 1, 32, 48), ("conv2", 32, 64, 24), ("conv3", 64, 128, 12)]
CONV_SWEEP = CNN_CONVS[1]  # the batch-size sweep's shape: conv2
CONV_BATCHES, CONV_BATCHES_QUICK = (1, 4, 16, 64, 256), (1, 16, 256)
# (name, C_in, C_out, H=W of the input, filter, stride) of ResNet-18's distinct convolutions on
# 48x48 images (a 3x3 stride-1 stem, no max-pool; padding 1 for 3x3, 0 for 1x1): the stem runs
# the direct kernels and is left out.
RESNET_CONVS = [("l1", 64, 64, 48, 3, 1),
                ("l2.down", 64, 128, 48, 3, 2), ("l2.short", 64, 128, 48, 1, 2),
                ("l2", 128, 128, 24, 3, 1),
                ("l3.down", 128, 256, 24, 3, 2), ("l3.short", 128, 256, 24, 1, 2),
                ("l3", 256, 256, 12, 3, 1),
                ("l4.down", 256, 512, 12, 3, 2), ("l4.short", 256, 512, 12, 1, 2),
                ("l4", 512, 512, 6, 3, 1)]
# (name, in, out) of its fully connected layers.
CNN_FCS = [("fc1", 4608, 256), ("fc2", 256, 7)]
CPU_LIMIT_S = 1.0

FIELDS = ["section", "op", "shape", "precision", "ours_ms", "ours_rate", "unit", "ref",
          "ref_ms", "ref_rate", "pct_of_ref", "cpu_ms", "speedup_vs_cpu", "size", "note"]


# ----------------------------------------------------------------------------- timing


def gpu_time_ms(fn, warmup=3, repeat=20, budget_s=0.3) -> float:
    """Median of CUDA-event times of fn() on the current stream, after warm-up."""
    from dptrain.backend.cuda import vendor

    return vendor.time_ms(fn, warmup, repeat, budget_s)


class CpuTimer:
    """Times NumPy calls; predicts each run from the last of the same series and skips slow ones."""

    def __init__(self, limit_s=CPU_LIMIT_S, enabled=True):
        self.limit_s, self.enabled, self.last = limit_s, enabled, {}

    def __call__(self, series, work, fn):
        """fn's median time in ms, or None when skipped. series=None: a one-off, no prediction."""
        if not self.enabled:
            return None
        if series is not None and series in self.last:
            w0, t0 = self.last[series]
            if t0 * work / w0 > self.limit_s:
                return None
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            if sum(times) > self.limit_s:
                break
        t = statistics.median(times)
        if series is not None:
            self.last[series] = (work, t)
        return t * 1e3


# ----------------------------------------------------------------------------- references


def sixteen(prec):
    """The 16-bit dtype of precision `prec` (bf16, fp16), or None for fp32 / tf32."""
    from dptrain.run import amp

    return amp.COMPUTE_DTYPES.get(prec)


def operands(be, prec, *arrays):
    """The arrays as precision `prec` computes on them: 16-bit copies for bf16 / fp16."""
    dt = sixteen(prec)
    return arrays if dt is None else tuple(be.astype(a, dt) for a in arrays)


def matrix_precision(prec):
    """The runtime precision scope for `prec` (16-bit operands pick their own kernels)."""
    return "tf32" if sixteen(prec) is not None else prec


def torch_view(torch, a):
    """A CuPy array as a PyTorch tensor, bfloat16 bits (uint16) seen as torch.bfloat16."""
    t = torch.from_dlpack(a)
    return t.view(torch.bfloat16) if t.dtype == torch.uint16 else t


def load_torch(prec):
    try:
        import torch
        import torch.nn.functional  # noqa: F401
        import torch.nn.grad  # noqa: F401
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = prec == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    return torch


# ----------------------------------------------------------------------------- rows


class Table:
    def __init__(self):
        self.rows = []

    def add(self, **kw):
        row = {f: kw.get(f, "") for f in FIELDS}
        if row["ref_ms"] and row["ours_ms"]:
            row["pct_of_ref"] = 100.0 * row["ref_ms"] / row["ours_ms"]
        if row["cpu_ms"] and row["ours_ms"]:
            row["speedup_vs_cpu"] = row["cpu_ms"] / row["ours_ms"]
        self.rows.append(row)
        print(_fmt_row(row), flush=True)


def _num(v, fmt):
    return "" if v in ("", None) else format(v, fmt)


def _fmt_row(r):
    return (f"{r['section']:<5} {r['op']:<16} {r['shape']:<30} {r['precision']:<4} "
            f"{_num(r['ours_ms'], '9.4f')} ms {_num(r['ours_rate'], '9.1f'):>9} {r['unit']:<6} "
            f"{r['ref']:<7} {_num(r['ref_ms'], '9.4f'):>9} {_num(r['pct_of_ref'], '6.1f'):>6}% "
            f"{_num(r['cpu_ms'], '10.2f'):>10} {_num(r['speedup_vs_cpu'], '8.1f'):>8}x {r['note']}")


HEADER = (f"{'sect':<5} {'op':<16} {'shape':<30} {'prec':<4} {'ours':>9}    {'rate':>9} "
          f"{'unit':<6} {'ref':<7} {'ref ms':>9} {'%ref':>6}  {'cpu ms':>10} {'gpu/cpu':>8}")


# ----------------------------------------------------------------------------- sections


def _conv_shape(n, cin, cout, hw):
    return f"{n}x{cin}x{hw}x{hw}->{cout} k3"


def _gemm_kernel_name(a, b, trans_a, trans_b) -> str:
    """The GEMM kernel our matmul picks for these operands at the current precision."""
    try:
        from dptrain.backend.cuda.gemm import matmul_kernel

        return matmul_kernel(a, b, trans_a, trans_b)
    except Exception as e:  # a name for the table only: never fail the timing over it
        return f"kernel unknown ({type(e).__name__})"


def bench_gemm(table, be, cpu_timer, precisions, sizes):
    """Square GEMM in three layouts: a @ b, a @ b^T (x @ W^T, the wgmma kernel's layout) and
    a^T @ b."""
    from dptrain.backend.cuda import vendor

    rng = np.random.default_rng(0)
    layouts = (("matmul", False, False), ("matmul_nt", False, True), ("matmul_tn", True, False))
    for n in sizes:
        a_h = rng.standard_normal((n, n), dtype=np.float32)
        b_h = rng.standard_normal((n, n), dtype=np.float32)
        a0, b0 = be.asarray(a_h), be.asarray(b_h)
        ops = {p: operands(be, p, a0, b0) for p in precisions}  # each precision's operands
        flops = 2.0 * n**3
        for op, ta, tb in layouts:
            cpu_ms = cpu_timer(f"gemm.{op}", flops,
                               lambda: cpu.matmul(a_h, b_h, trans_a=ta, trans_b=tb))
            for prec in precisions:
                a, b = ops[prec]
                a32, b32 = (be.astype(v, np.float32) for v in (a, b))  # the operands' values
                want = vendor.matmul64(a32, b32, trans_a=ta, trans_b=tb)
                with be.runtime.precision_scope(matrix_precision(prec)):
                    kernel = _gemm_kernel_name(a, b, ta, tb)
                    got = be.astype(be.matmul(a, b, trans_a=ta, trans_b=tb), np.float32)
                    err = vendor.rel_error(got, want)
                    ours = gpu_time_ms(lambda: be.matmul(a, b, trans_a=ta, trans_b=tb))
                ref = None
                if sixteen(prec) is None:
                    vendor.cublas_precision(prec)
                    ref = gpu_time_ms(lambda: vendor.cublas_matmul(a, b, trans_a=ta, trans_b=tb))
                elif (torch := load_torch(prec)) is not None:  # cuBLAS in bf16 / fp16
                    at, bt = torch_view(torch, a), torch_view(torch, b)
                    at, bt = (at.t() if ta else at), (bt.t() if tb else bt)
                    ref = gpu_time_ms(lambda: torch.matmul(at, bt))
                table.add(section="gemm", op=op, shape=f"{n}x{n}x{n}", precision=prec,
                          ours_ms=ours, ours_rate=flops / ours / 1e6, unit="GFLOP/s",
                          ref="cuBLAS" if ref else "", ref_ms=ref,
                          ref_rate=flops / ref / 1e6 if ref else "", cpu_ms=cpu_ms, size=n,
                          note=f"{kernel}; rel err vs fp64 {err:.2g}")
                del want, a32, b32
        del ops, a0, b0


def bench_fc(table, be, cpu_timer, precisions):
    """The CNN's linear layers: y = x W^T, dx = gy W, dW = gy^T x."""
    from dptrain.backend.cuda import vendor

    rng = np.random.default_rng(1)
    for name, fin, fout in CNN_FCS:
        x_h = rng.standard_normal((BATCH, fin), dtype=np.float32)
        w_h = rng.standard_normal((fout, fin), dtype=np.float32)
        gy_h = rng.standard_normal((BATCH, fout), dtype=np.float32)
        x, w, gy = be.asarray(x_h), be.asarray(w_h), be.asarray(gy_h)
        flops = 2.0 * BATCH * fin * fout
        cases = [
            ("fwd", lambda: be.matmul(x, w, trans_b=True), lambda: vendor.cublas_matmul(x, w, trans_b=True),
             lambda: cpu.matmul(x_h, w_h, trans_b=True)),
            ("bwd_data", lambda: be.matmul(gy, w), lambda: vendor.cublas_matmul(gy, w),
             lambda: cpu.matmul(gy_h, w_h)),
            ("bwd_wgt", lambda: be.matmul(gy, x, trans_a=True), lambda: vendor.cublas_matmul(gy, x, trans_a=True),
             lambda: cpu.matmul(gy_h, x_h, trans_a=True)),
        ]
        for kind, ours_fn, ref_fn, cpu_fn in cases:
            cpu_ms = cpu_timer(None, 1, cpu_fn)
            for prec in (p for p in precisions if sixteen(p) is None):  # float32 rows only
                vendor.cublas_precision(prec)
                with be.runtime.precision_scope(prec):
                    ours = gpu_time_ms(ours_fn)
                ref = gpu_time_ms(ref_fn)
                table.add(section="cnn", op=f"{name}.{kind}", shape=f"{BATCH}x{fin}->{fout}",
                          precision=prec, ours_ms=ours, ours_rate=flops / ours / 1e6,
                          unit="GFLOP/s", ref="cuBLAS", ref_ms=ref, ref_rate=flops / ref / 1e6,
                          cpu_ms=cpu_ms)


def _conv_cases(be, rng, n, cin, cout, hw, kinds=("fwd", "bwd_data", "bwd_wgt"), k=3, s=1,
                channels_last=False):
    """(kind, ours(prec), cpu, torch reference factory (torch, prec)) for a k x k convolution
    of stride s and padding k // 2; ours and the reference run on the operands of precision
    prec (the reference on channels-last copies if `channels_last`)."""
    stride, pad = (s, s), (k // 2, k // 2)
    ho = (hw + 2 * (k // 2) - k) // s + 1
    x_h = rng.standard_normal((n, cin, hw, hw), dtype=np.float32)
    w_h = rng.standard_normal((cout, cin, k, k), dtype=np.float32)
    b_h = rng.standard_normal((cout,), dtype=np.float32)
    gy_h = rng.standard_normal((n, cout, ho, ho), dtype=np.float32)
    host = (x_h, w_h, b_h, gy_h)
    arrays = {}

    def get(prec):  # the device operands in precision prec, made once
        key = sixteen(prec)
        if key not in arrays:
            arrays[key] = operands(be, prec, *(be.asarray(v) for v in host))
        return arrays[key]

    def ours(kind):
        def run(prec):
            x, w, b, gy = get(prec)
            if kind == "fwd":
                return lambda: be.conv2d_forward(x, w, b, stride, pad)
            if kind == "bwd_data":
                return lambda: be.conv2d_backward_data(gy, w, x.shape, stride, pad)
            return lambda: be.conv2d_backward_weight(x, gy, w.shape, stride, pad)
        return run

    cpus = {
        "fwd": lambda: cpu.conv2d_forward(x_h, w_h, b_h, stride, pad),
        "bwd_data": lambda: cpu.conv2d_backward_data(gy_h, w_h, x_h.shape, stride, pad),
        "bwd_wgt": lambda: cpu.conv2d_backward_weight(x_h, gy_h, w_h.shape, stride, pad),
    }
    return [(kind, ours(kind), cpus[kind],
             lambda torch, prec, kind=kind: _torch_conv(torch, kind, *get(prec), stride, pad,
                                                        channels_last))
            for kind in kinds]


def _timed_conv(table, be, precisions, cpu_ms, ours_fn, torch_ref, flops, kernel=None, **row):
    """A row per precision; kernel(prec) -> the name of the kernel ours runs (for the note)."""
    for prec in precisions:
        torch = load_torch(prec)
        ref_ms, note = None, ""
        if torch is not None:
            ref_ms = gpu_time_ms(torch_ref(torch, prec))
        else:
            note = "no torch: cuDNN skipped"
        with be.runtime.precision_scope(matrix_precision(prec)):
            ours = gpu_time_ms(ours_fn(prec))
            if kernel is not None:
                note = " ".join(v for v in (kernel(prec), note) if v)
        table.add(precision=prec, ours_ms=ours, ours_rate=flops / ours / 1e6, unit="GFLOP/s",
                  ref="cuDNN" if ref_ms else "", ref_ms=ref_ms,
                  ref_rate=flops / ref_ms / 1e6 if ref_ms else "", cpu_ms=cpu_ms, note=note,
                  **row)


def bench_conv(table, be, cpu_timer, precisions):
    """The CNN's three convolutions at batch 256, each pass."""
    rng = np.random.default_rng(2)
    for name, cin, cout, hw in CNN_CONVS:
        flops = 2.0 * BATCH * cout * hw * hw * cin * 9
        for kind, ours_fn, cpu_fn, torch_ref in _conv_cases(be, rng, BATCH, cin, cout, hw):
            cpu_ms = cpu_timer(None, 1, cpu_fn)
            _timed_conv(table, be, precisions, cpu_ms, ours_fn, torch_ref, flops,
                        section="cnn", op=f"{name}.{kind}",
                        shape=_conv_shape(BATCH, cin, cout, hw))


def bench_resnet_convs(table, be, precisions):
    """ResNet-18's convolutions at 48x48 and batch 256, each pass, with our kernel's name."""
    from dptrain.backend.cuda.conv import conv2d_kernels

    rng = np.random.default_rng(3)
    for name, cin, cout, hw, k, s in RESNET_CONVS:
        ho = (hw + 2 * (k // 2) - k) // s + 1
        flops = 2.0 * BATCH * cout * ho * ho * cin * k * k
        cases = _conv_cases(be, rng, BATCH, cin, cout, hw, k=k, s=s, channels_last=True)
        for kind, ours_fn, _, torch_ref in cases:
            def kernel(prec, kind=kind, cin=cin, cout=cout, k=k, s=s):
                dt = sixteen(prec) or np.float32
                x = be.empty((BATCH, cin, hw, hw), dt)
                w, gy = be.empty((cout, cin, k, k), dt), be.empty((BATCH, cout, ho, ho), dt)
                pad = (k // 2, k // 2)
                names = conv2d_kernels(x, w, gy, (s, s), pad)
                return names[{"fwd": "forward", "bwd_data": "backward_data"}.get(
                    kind, "backward_weight")]
            _timed_conv(table, be, precisions, None, ours_fn, torch_ref, flops, kernel=kernel,
                        section="resnet", op=f"{name}.{kind}",
                        shape=f"{BATCH}x{cin}x{hw}x{hw}->{cout} k{k}s{s}")


def bench_conv_batches(table, be, cpu_timer, precisions, batches):
    """conv2d forward at the CNN's conv2 shape over the batch size."""
    _, cin, cout, hw = CONV_SWEEP
    rng = np.random.default_rng(4)
    for n in batches:
        flops = 2.0 * n * cout * hw * hw * cin * 9
        [(_, ours_fn, cpu_fn, torch_ref)] = _conv_cases(be, rng, n, cin, cout, hw, ("fwd",))
        cpu_ms = cpu_timer("conv.fwd", n, cpu_fn)
        _timed_conv(table, be, precisions, cpu_ms, ours_fn, torch_ref, flops, section="conv",
                    op="conv2d fwd", shape=_conv_shape(n, cin, cout, hw), size=n)


def _torch_conv(torch, kind, x, w, b, gy, stride, pad, channels_last=False):
    xt, wt, bt, gyt = (torch_view(torch, v) for v in (x, w, b, gy))
    if channels_last:
        xt, wt, gyt = (t.contiguous(memory_format=torch.channels_last) for t in (xt, wt, gyt))
    if kind == "fwd":
        return lambda: torch.nn.functional.conv2d(xt, wt, bt, stride, pad)
    if kind == "bwd_data":
        return lambda: torch.nn.grad.conv2d_input(xt.shape, wt, gyt, stride, pad)
    return lambda: torch.nn.grad.conv2d_weight(xt, wt.shape, gyt, stride, pad)


def _shape2d(n):
    """The 2-D shape transpose is timed on for n elements (about sqrt(n) rows)."""
    rows = 10 ** (int(round(math.log10(n))) // 2)
    return rows, n // rows


def bench_elementwise(table, be, cpu_timer, sizes):
    """Our elementwise kernels; references: CuPy's own elementwise ops on the same arrays."""
    from dptrain.backend.cuda import vendor

    rng = np.random.default_rng(3)
    for n in sizes:
        shape2d = _shape2d(n)
        a_h = rng.random(n, dtype=np.float32) + 0.5
        b_h = rng.random(n, dtype=np.float32) + 0.5
        a, b = be.asarray(a_h), be.asarray(b_h)
        a2_h = a_h[: shape2d[0] * shape2d[1]].reshape(shape2d)
        a2 = be.asarray(a2_h)
        cases = [
            ("add", 12 * n, lambda: be.add(a, b), lambda: vendor.add(a, b), lambda: cpu.add(a_h, b_h)),
            ("mul", 12 * n, lambda: be.mul(a, b), lambda: vendor.mul(a, b), lambda: cpu.mul(a_h, b_h)),
            ("pow", 8 * n, lambda: be.pow_scalar(a, 2.5), lambda: vendor.pow_scalar(a, 2.5),
             lambda: cpu.pow_scalar(a_h, 2.5)),
            ("transpose", 8 * a2_h.size, lambda: be.transpose(a2, (1, 0)),
             lambda: vendor.transpose2d(a2), lambda: cpu.transpose(a2_h, (1, 0))),
        ]
        for op, nbytes, ours_fn, ref_fn, cpu_fn in cases:
            try:
                ours = gpu_time_ms(ours_fn)
            except Exception as e:
                table.add(section="elem", op=op, shape=str(n), note=f"failed: {e}")
                continue
            ref = gpu_time_ms(ref_fn)
            cpu_ms = cpu_timer(f"elem.{op}", n, cpu_fn)
            table.add(section="elem", op=op, shape=f"{n:.0e}" if op != "transpose" else
                      "x".join(map(str, shape2d)), precision="", ours_ms=ours,
                      ours_rate=nbytes / ours / 1e6, unit="GB/s", ref="CuPy", ref_ms=ref,
                      ref_rate=nbytes / ref / 1e6, cpu_ms=cpu_ms, size=n)
        del a, b, a2


# ----------------------------------------------------------------------------- CPU only


def cpu_rows(sizes, batches, echo=print) -> list[dict]:
    """The NumPy backend's times of the same ops, for a machine without a GPU: elementwise at
    ``sizes`` elements, square matmul 64..512, conv2d forward at the conv sweep's shape for
    ``batches``. Rows: family, op, size, shape, cpu_ms (None where skipped as too slow)."""
    rng = np.random.default_rng(0)
    timer, rows = CpuTimer(), []

    def add(family, op, size, shape, fn):
        ms = timer(f"{family}.{op}", size, fn)
        rows.append({"family": family, "op": op, "size": size, "shape": shape, "cpu_ms": ms})
        echo(f"  {op:<10} {shape:<24} CPU " + (f"{ms:.4f} ms" if ms is not None else "skipped"))

    for n in sizes:
        a, b = rng.random(n, dtype=np.float32) + 0.5, rng.random(n, dtype=np.float32) + 0.5
        rows2, cols = _shape2d(n)
        a2 = a[: rows2 * cols].reshape(rows2, cols)
        add("elementwise", "add", n, str(n), lambda: cpu.add(a, b))
        add("elementwise", "mul", n, str(n), lambda: cpu.mul(a, b))
        add("elementwise", "pow", n, str(n), lambda: cpu.pow_scalar(a, 2.5))
        add("elementwise", "transpose", n, f"{rows2}x{cols}", lambda: cpu.transpose(a2, (1, 0)))
    for n in (64, 128, 256, 512):
        m1, m2 = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
        add("matmul", "matmul", n, f"{n}x{n}x{n}", lambda: cpu.matmul(m1, m2))
    _, cin, cout, hw = CONV_SWEEP
    for n in batches:
        x = rng.standard_normal((n, cin, hw, hw), dtype=np.float32)
        w = rng.standard_normal((cout, cin, 3, 3), dtype=np.float32)
        bias = rng.standard_normal((cout,), dtype=np.float32)
        add("conv2d", "conv2d fwd", n, _conv_shape(n, cin, cout, hw),
            lambda: cpu.conv2d_forward(x, w, bias, (1, 1), (1, 1)))
    return rows


# ----------------------------------------------------------------------------- output


def write_csv(path, rows, device, date):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS + ["device", "date"])
        w.writeheader()
        for r in rows:
            w.writerow({**{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()},
                        "device": device, "date": date})


def write_plot(path, rows, meta):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"--plot: matplotlib unavailable ({e}); no plot written")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, section, xlabel in ((ax1, "gemm", "matrix size n (n x n x n)"),
                                (ax2, "elem", "elements")):
        series = {}
        for r in rows:
            if r["section"] == section and r["speedup_vs_cpu"] not in ("", None) and r["size"]:
                key = f"{r['op']} {r['precision']}".strip()
                series.setdefault(key, []).append((r["size"], r["speedup_vs_cpu"]))
        for key, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("speedup, GPU over NumPy CPU")
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend()
    ax1.set_title("GEMM")
    ax2.set_title("elementwise")
    fig.suptitle(meta, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def print_summary(rows):
    """The rows that matter most, compactly, last (the end of a log is what gets read)."""
    print("\nsummary: op shape prec | ours ms, rate | ref ms, % of ref | x cpu")
    for r in rows:
        if r["section"] == "gemm" and r["size"] not in (4096, 8192):
            continue
        if r["section"] == "elem" and r["size"] != 10**8:
            continue
        print(f"  {r['op']:<16} {r['shape']:<30} {r['precision']:<4} | "
              f"{_num(r['ours_ms'], '.4f')} {_num(r['ours_rate'], '.0f')} {r['unit']} | "
              f"{r['ref']} {_num(r['ref_ms'], '.4f')} {_num(r['pct_of_ref'], '.0f')}% | "
              f"{_num(r['speedup_vs_cpu'], '.0f')}")


# ----------------------------------------------------------------------------- main


SECTIONS = ("gemm", "cnn", "resnet", "conv", "elem")


def _ints(text, flag):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} {text!r}: expected comma-separated positive integers")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m dptrain bench ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short subset of every section")
    p.add_argument("--precision", default="tf32,fp32",
                   help="comma-separated list from tf32, fp32, bf16, fp16 (default: tf32,fp32; "
                   "bf16 and fp16 measure the GEMM and convolution rows)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated list from {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--conv-batches", default=None,
                   help="batch sizes of the conv section (default "
                   f"{','.join(map(str, CONV_BATCHES))}; --quick "
                   f"{','.join(map(str, CONV_BATCHES_QUICK))})")
    p.add_argument("--no-cpu", action="store_true", help="skip the NumPy CPU timings")
    p.add_argument("--csv", metavar="PATH", help="write every row as CSV")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of GPU-over-CPU speedup")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not sections or sections - set(SECTIONS):
        raise SystemExit(f"--sections {args.sections!r}: choose from {', '.join(SECTIONS)}")
    conv_batches = (_ints(args.conv_batches, "--conv-batches") if args.conv_batches else
                    list(CONV_BATCHES_QUICK if args.quick else CONV_BATCHES))
    from dptrain import backend
    from dptrain.bench.machine import gpu_names, gpu_software

    if not backend.cuda_available():
        print("bench ops: no GPU (CuPy missing or no CUDA device); nothing to measure")
        return 1
    be = backend.get("cuda")
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    offered = (*be.runtime.PRECISIONS, "bf16", "fp16")
    for p in precisions:
        if p not in offered:
            raise SystemExit(f"--precision: unknown {p!r}; choose from {', '.join(offered)}")
    device = (gpu_names() or ["unknown GPU"])[0]
    date = datetime.datetime.now().isoformat(timespec="seconds")
    meta = (f"{device}, {date}, "
            f"{gpu_software()}, python -m dptrain bench ops {' '.join(argv or [])}")
    print(meta)
    print(HEADER)

    table, cpu_timer = Table(), CpuTimer(enabled=not args.no_cpu)
    gemm_sizes = [256, 1024, 4096] if args.quick else [256, 512, 1024, 2048, 4096, 8192]
    elem_sizes = [10**3, 10**5, 10**7] if args.quick else [10**e for e in range(3, 9)]
    runs = [("gemm", lambda: bench_gemm(table, be, cpu_timer, precisions, gemm_sizes)),
            ("cnn", lambda: bench_fc(table, be, cpu_timer, precisions)),
            ("cnn", lambda: bench_conv(table, be, cpu_timer, precisions)),
            ("resnet", lambda: bench_resnet_convs(table, be, precisions)),
            ("conv", lambda: bench_conv_batches(table, be, cpu_timer, precisions, conv_batches)),
            ("elem", lambda: bench_elementwise(table, be, cpu_timer, elem_sizes))]
    failed = False
    for section, run in runs:
        if section in sections:
            try:
                run()
            except Exception:  # report and go on: one broken section should not hide the rest
                failed = True
                traceback.print_exc()
    print_summary(table.rows)

    if args.csv:
        write_csv(args.csv, table.rows, device, date)
        print(f"CSV written to {args.csv}")
    if args.plot:
        write_plot(args.plot, table.rows, meta)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
