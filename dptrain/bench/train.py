"""`python -m dptrain bench train`: one training step of each model, ours next to PyTorch's,
at each batch size and precision, in one run on one device.

Rows, for every model of ``dptrain.nn.MODELS`` that builds for the image shape (or
``--models``), every ``--batch-sizes`` and every precision the runtime offers
(``be.runtime.PRECISIONS``, plus bf16 and fp16 mixed precision on a GPU; or ``--precisions``):
  dptrain  graph     our TrainStep captured once and replayed (devices that record graphs)
  dptrain  eager     the same step run op by op
  dptrain  api       the same step written with dptrain.DataParallel and ddp.compile (GPU)
  pytorch  eager / graph / compile            in fp32 and tf32 (TF32 on or off)
  pytorch  graph-autocast-cl                  bf16 and fp16 autocast + channels_last, in a
                                              graph (always measured on a GPU: the mode to beat)
  pytorch  compile-max-autotune               bf16 and fp16 autocast + channels_last,
                                              torch.compile(mode="max-autotune"); only when
                                              ``--torch-modes`` names it (its compile and
                                              autotuning can take minutes)
``--torch-modes`` picks PyTorch's modes (default: every one but compile-max-autotune). Both
compile modes report the wall time of their first step, where torch.compile traces, generates
and (max-autotune) benchmarks its kernels, apart from the timed steps: a note in the table and
``compile_s`` in the CSV and JSON (Inductor's on-disk cache shortens it on a second run).
Both sides start from the same weights (PyTorch's twin of our model gets our state_dict: cnn
and mlp as Sequential stacks, resnet18/34/50 as torchvision's with our stem for the image
size, vit with nn.TransformerEncoderLayer blocks; models without a twin get no PyTorch
rows), use the same optimizer (``--optimizer``: SGD with momentum 0.9, or AdamW), read uint8
images already on the device and gather and normalise them inside the step. Each is warmed
up (``--warmup`` steps: kernels compiled, graphs captured), then ``--repeats`` runs of
``--steps`` steps are timed on the host clock around a device synchronisation; a row is the
median.

Columns: ms/step; images/s; ``vs best torch`` = PyTorch's fastest mode in the same precision
(TF32 rows against PyTorch's TF32 modes, bf16 against its bf16 modes, compile-max-autotune
included when it ran) divided by this row's time, so > 1 is faster than PyTorch's best;
TFLOP/s from the FLOPs a training step needs (``dptrain.bench.flops``: 3x the forward's conv
and matmul FLOPs, 138.5 MFLOP per 48x48 image for the reference CNN); ``% floor`` = that
rate over the device's dense peak in the row's precision (``PEAK_TFLOPS`` by GPU name, or
``--peak-tflops``). ``--profile`` adds, for each model, batch and precision, our eager
step's time per op (CUDA events around each op, ``dptrain.bench.profile``) and, where
PyTorch is installed, the replayed step's time per kernel (the CUDA profiling interface's
kernel records). ``--csv`` /
``--json`` write the rows (JSON adds the profiles); the table prints last. On the CPU only
eager rows run (PyTorch's eager CPU step if torch is installed).

Images are ``--channels`` x ``--image-size`` x ``--image-size`` (default 1x48x48; 3x224x224
runs the ResNets through ImageNet's stem), the same uint8 batch on both sides.

    python -m dptrain bench train [--batch-sizes 64 256 1024] [--optimizer sgd|adamw]
        [--models cnn] [--precisions tf32] [--channels 3 --image-size 224]
        [--profile] [--csv F.csv] [--json F.json]
        [--torch-modes graph-autocast-cl compile-max-autotune]
"""
from __future__ import annotations

import csv
import datetime
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from types import SimpleNamespace

import numpy as np

from dptrain.bench import flops as flop_count
from dptrain.bench import machine, torch_step
from dptrain.errors import UsageError
from dptrain.run.torch_twin import twin

NUM_CLASSES = 7
MEAN, STD = 0.5, 0.25

# Dense tensor rates in TFLOP/s by GPU name (first match wins; SXM figures for H100/H200).
PEAK_TFLOPS = (
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),
    ("H200", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
)

FIELDS = ["model", "batch", "precision", "impl", "mode", "ms", "images_per_s",
          "vs_best_torch", "tflops", "pct_of_floor", "flops_per_image", "compile_s", "note"]


# ----------------------------------------------------------------------------- timing


def time_step(step, sync, steps, warmup, repeats) -> float:
    """Median seconds per step over `repeats` runs of `steps` steps, after `warmup` steps."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def _batch_data(batch, image_shape, seed):
    rng = np.random.default_rng(seed)
    return SimpleNamespace(images=rng.integers(0, 256, (batch, *image_shape), dtype=np.uint8),
                           labels=rng.integers(0, NUM_CLASSES, batch), mean=MEAN, std=STD,
                           num_classes=NUM_CLASSES, image_shape=tuple(image_shape))


def our_step(be, model_name, state, data, optimizer, graph, precision="fp32"):
    """(step, sync) of our TrainStep on `data` (uint8 images held on the device), starting
    from the weights `state`, eager or captured and replayed; fp16 (mixed precision) runs
    with its loss scaler and the non-finite guard, as training does (bf16 needs neither)."""
    from dptrain.run import amp
    from dptrain import distributed as dist
    from dptrain.data import DeviceLoader
    from dptrain.distributed.flat import FlatParameters
    from dptrain.nn import build_model
    from dptrain.optim import SGD, AdamW
    from dptrain.distributed.reducer import Reducer
    from dptrain.run.step import CAPTURE_WARMUP, TrainStep

    model = build_model(model_name, data.image_shape, NUM_CLASSES)
    model.load_state_dict(state)
    model.to(be.name)
    flat = FlatParameters(model.parameters(), shadow_dtype=amp.shadow_dtype(precision))
    opt = (SGD(flat, lr=0.01, momentum=0.9) if optimizer == "sgd"
           else AdamW(flat, lr=1e-3, weight_decay=0.01))
    reducer = Reducer(flat, dist.World(comm=dist.LocalComm(be)))
    dtype, guard = amp.compute_dtype(precision), None
    # as train: batches laid out for the stem in the pass that normalises them
    loader = DeviceLoader(data, be, len(data.labels), dtype=dtype,
                          layout=model.input_layout(data.image_shape, dtype, be))
    if precision in amp.LOSS_SCALED:
        from dptrain.run.nonfinite import NonFiniteGuard

        guard = NonFiniteGuard(opt, dist.LocalComm(be), 0, amp.LossScaler(be))
    step_fn = TrainStep(model, opt, reducer, loader, guard, dtype)
    run = be.runtime.capture(step_fn, warmup=CAPTURE_WARMUP) if graph else step_fn
    indices = np.arange(len(data.labels), dtype=np.int64)

    def step():
        opt.begin_step()
        loader.set_batch(indices)
        run()

    return step, be.runtime.synchronize


def api_step(be, model_name, state, data, optimizer, precision="fp32"):
    """(step, sync) of the same training step written as a user of the library writes it
    (dptrain.DataParallel and a compiled step function), on this batch already on the device
    (normalised images, labels): the row that shows what the public API costs."""
    import dptrain as dp
    from dptrain import distributed as dist
    from dptrain.data import DeviceLoader
    from dptrain.engine import functional as F
    from dptrain.nn import build_model

    model = build_model(model_name, data.image_shape, NUM_CLASSES)
    model.load_state_dict(state)
    model.to(be.name)
    options = dict(lr=0.01, momentum=0.9) if optimizer == "sgd" else dict(lr=1e-3,
                                                                          weight_decay=0.01)
    ddp = dp.DataParallel(model, optimizer, world=dist.init(be), precision=precision,
                          **options)
    loader = DeviceLoader(data, be, len(data.labels))
    batch = loader.gather(np.arange(len(data.labels), dtype=np.int64))
    step = ddp.compile(lambda b: F.cross_entropy(ddp(b[0]), b[1]))
    return (lambda: step(batch)), be.runtime.synchronize


def profile_ours(be, model_name, state, data, optimizer, precision, steps=3) -> dict:
    """{"ops": per-op device time of our eager step (mean of `steps` steps after two warm-up
    steps), "kernels": per-kernel time of the replayed step (profile.kernel_rows; None without
    PyTorch or graphs)}."""
    from dptrain.bench.profile import OpProfile, kernel_rows
    from dptrain.run.step import CAPTURE_WARMUP

    with OpProfile(be) as prof:
        step, sync = our_step(be, model_name, state, data, optimizer, graph=False,
                              precision=precision)
        for _ in range(2):
            step()
        sync()
        prof.reset()
        for _ in range(steps):
            step()
        sync()
        ops = prof.rows(steps)
    kernels = None
    if be.runtime.records_graphs:
        step, sync = our_step(be, model_name, state, data, optimizer, graph=True,
                              precision=precision)
        for _ in range(CAPTURE_WARMUP + 3):  # captured, then replayed
            step()
        kernels = kernel_rows(step, sync)
    return {"model": model_name, "batch": len(data.labels), "precision": precision,
            "ops": ops, "kernels": kernels}


def format_profiles(profiles) -> str:
    """Each profile as text: the eager step's ops, then the replayed step's kernels."""
    from dptrain.bench.profile import format_rows

    parts = []
    for prof in profiles:
        what = f"{prof['model']} batch {prof['batch']} {prof['precision']}"
        parts.append(format_rows(prof["ops"], f"\nour eager step, {what}: device time per op "
                                              f"(ms per step)"))
        if prof.get("kernels"):
            parts.append(format_rows(prof["kernels"], f"\nour replayed step, {what}: device "
                                                      f"time per kernel (ms per step)"))
    return "\n".join(parts)


def _release(be):
    """A finished row's memory (its step, graph and model: reference cycles) back to the
    device, where PyTorch's rows and the next model's need it (ResNet-50 at 224 px)."""
    gc.collect()
    be.runtime.release_memory()


# ----------------------------------------------------------------------------- set-up


def buildable_models(names, image_shape) -> dict:
    """{name: None} for the models that build for `image_shape`, {name: reason} otherwise."""
    from dptrain.nn import build_model

    result = {}
    for name in names:
        try:
            build_model(name, image_shape, NUM_CLASSES)
            result[name] = None
        except (ValueError, TypeError) as exc:
            result[name] = str(exc)
    return result


def chosen_models(names, image_shape) -> dict:
    """buildable_models of `names` (--models; None: every model); UsageError for an unknown
    name, or for a named model that does not build for `image_shape`."""
    from dptrain.nn import MODELS

    for name in names or ():
        if name not in MODELS:
            raise UsageError(f"--models {name}: unknown model; choose from {', '.join(MODELS)}")
    status = buildable_models(names or list(MODELS), image_shape)
    if names and any(status.values()):
        bad = next(n for n, why in status.items() if why)
        raise UsageError(f"--models {bad}: does not build for {image_shape}: {status[bad]}")
    return status


def peak_tflops(text, gpu_name):
    """{precision: TFLOP/s} from --peak-tflops ("495" for every precision, or
    "tf32=495,bf16=989"), else from PEAK_TFLOPS by `gpu_name`; {} where unknown."""
    if text:
        try:
            if "=" not in text:
                return {p: float(text) for p in ("fp32", "tf32", "bf16", "fp16")}
            return {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(","))}
        except ValueError:
            raise UsageError(f"--peak-tflops {text!r}: expected a number or "
                             f"precision=number pairs such as tf32=495,bf16=989") from None
    for key, peaks in PEAK_TFLOPS:
        if gpu_name and key in gpu_name:
            return dict(peaks)
    return {}


def fill_derived(rows, peaks):
    """vs_best_torch, tflops and pct_of_floor of every row (in place)."""
    best = {}
    for r in rows:
        if r["impl"] == "pytorch" and r["ms"]:
            key = (r["model"], r["batch"], r["precision"])
            best[key] = min(best.get(key, float("inf")), r["ms"])
    for r in rows:
        ms = r["ms"]
        ref = best.get((r["model"], r["batch"], r["precision"]))
        r["vs_best_torch"] = ref / ms if ms and ref else None
        r["tflops"] = r["flops_per_image"] * r["batch"] / (ms * 1e-3) / 1e12 if ms else None
        peak = peaks.get(r["precision"])
        r["pct_of_floor"] = 100 * r["tflops"] / peak if r["tflops"] and peak else None
    return rows


# ----------------------------------------------------------------------------- output


def compile_note(mode, seconds) -> str:
    """The table's note for a compile mode's one-off cost, kept out of ms/step."""
    if seconds is None:
        return ""
    what = "compile + autotune" if mode == "compile-max-autotune" else "compile"
    return f"{what} {seconds:.1f} s"


def _cell(value, fmt):
    return "-" if value is None else format(value, fmt)


def format_table(rows) -> str:
    head = (f"{'model':<10} {'batch':>5} {'prec':>4} {'impl':<7} {'mode':<20} {'ms/step':>8} "
            f"{'images/s':>10} {'vs best torch':>13} {'TFLOP/s':>8} {'% floor':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:<10} {r['batch']:>5} {r['precision']:>4} {r['impl']:<7} "
            f"{r['mode']:<20} {_cell(r['ms'], '8.3f')} {_cell(r['images_per_s'], '10.0f')} "
            f"{_cell(r['vs_best_torch'], '13.2f')} {_cell(r['tflops'], '8.3g')} "
            f"{_cell(r['pct_of_floor'], '7.1f')}" + (f"  ({r['note']})" if r["note"] else ""))
    return "\n".join(lines)


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in FIELDS})


def write_json(path, header, rows, profiles):
    with open(path, "w") as f:
        json.dump({**header, "rows": rows, "profiles": profiles}, f, indent=1)
        f.write("\n")


# ----------------------------------------------------------------------------- main


def _parser():
    from dptrain.cli.argtypes import Parser as _Parser
    from dptrain.cli.argtypes import positive_int as _positive_int

    p = _Parser(prog="python -m dptrain bench train", description=__doc__,
                formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--models", nargs="+", default=None,
                   help="models to run (default: every model that builds for the images)")
    p.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", type=_positive_int,
                   nargs="+", default=[64, 256, 1024])
    p.add_argument("--precisions", nargs="+", default=None,
                   help="our precisions (default: every one the runtime offers)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                   help="sgd: momentum 0.9, lr 0.01; adamw: lr 1e-3, weight decay 0.01")
    p.add_argument("--image-size", type=_positive_int, default=48,
                   help="height and width of the images")
    p.add_argument("--channels", type=int, choices=(1, 3), default=1,
                   help="channels of the images: 1 (grayscale) or 3 (RGB; 3x224x224 is "
                   "ImageNet's shape)")
    p.add_argument("--steps", type=_positive_int, default=30, help="steps per timed run")
    p.add_argument("--warmup", type=_positive_int, default=5, help="steps before timing")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed runs (median)")
    p.add_argument("--no-torch", action="store_true", help="no PyTorch rows")
    p.add_argument("--torch-modes", nargs="+", choices=list(torch_step.MODES),
                   default=list(torch_step.DEFAULT_MODES), metavar="MODE",
                   help="PyTorch's modes to run (GPU; the CPU runs eager only): "
                   + "; ".join(f"{m}: {what}" for m, what in torch_step.MODES.items())
                   + f" (default: {' '.join(torch_step.DEFAULT_MODES)})")
    p.add_argument("--peak-tflops", default=None,
                   help="the device's dense peak, TFLOP/s: one number, or tf32=495,bf16=989")
    p.add_argument("--profile", action="store_true",
                   help="also time each op of our eager step (where the time goes)")
    p.add_argument("--csv", default=None, help="write the rows to this CSV file")
    p.add_argument("--json", default=None, help="write rows and profiles to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None, echo=print) -> int:
    args = _parser().parse_args(argv)
    from dptrain.run import amp
    from dptrain import backend, nn
    from dptrain.engine.rng import manual_seed

    try:
        device = backend.resolve_device(args.device)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    be = backend.get(device)
    offered = tuple(be.runtime.PRECISIONS) + tuple(be.runtime.mixed_precisions())
    # by default the 16-bit rows where the runtime records graphs (the CPU's fp16 is slow)
    precisions = tuple(args.precisions or (offered if be.runtime.records_graphs
                                           else be.runtime.PRECISIONS))
    for p in precisions:
        if p not in offered:
            raise UsageError(f"--precisions {p}: the {device} runtime offers "
                             f"{', '.join(offered)}")
    image_shape = (args.channels, args.image_size, args.image_size)
    status = chosen_models(args.models, image_shape)
    models = [n for n, why in status.items() if why is None]
    graphs = be.runtime.records_graphs
    use_torch = not args.no_torch and torch_step.available()
    gpus = machine.gpu_names() if graphs else []
    gpu = gpus[0] if gpus else ""
    peaks = peak_tflops(args.peak_tflops, gpu)
    from dptrain.run.step import CAPTURE_WARMUP

    # warm-up covers the eager steps and the capture of a graph, so neither is timed
    timing = (args.steps, max(args.warmup, CAPTURE_WARMUP + 1), args.repeats)

    be.runtime.prepare()  # kernels built before anything is timed
    rows, profiles = [], []
    for model_name in models:
        fpi = flop_count.training_flops_per_image(model_name, image_shape, NUM_CLASSES)
        manual_seed(args.seed)
        state = nn.build_model(model_name, image_shape, NUM_CLASSES).state_dict()
        net = None
        if use_torch:
            our_cpu_model = nn.build_model(model_name, image_shape, NUM_CLASSES)
            our_cpu_model.load_state_dict(state)
            net = twin(our_cpu_model)
        for batch in args.batch_sizes:
            data = _batch_data(batch, image_shape, args.seed)

            def row(precision, impl, mode, seconds, note="", compile_s=None):
                rows.append({"model": model_name, "batch": batch, "precision": precision,
                             "impl": impl, "mode": mode,
                             "ms": seconds * 1e3 if seconds else None,
                             "images_per_s": batch / seconds if seconds else None,
                             "flops_per_image": fpi, "compile_s": compile_s, "note": note})

            for precision in precisions:
                matrix = "auto" if precision in amp.COMPUTE_DTYPES else precision
                if precision in amp.COMPUTE_DTYPES and not amp.supports(model_name):
                    row(precision, "dptrain", "graph", None, "no 16-bit path for this model")
                    continue
                with be.runtime.precision_scope(matrix):
                    for mode in (("graph", "eager") if graphs else ("eager",)):
                        step, sync = our_step(be, model_name, state, data, args.optimizer,
                                              graph=mode == "graph", precision=precision)
                        row(precision, "dptrain", mode, time_step(step, sync, *timing))
                        del step
                        _release(be)
                    if graphs:  # the same step through the public API, captured
                        step, sync = api_step(be, model_name, state, data, args.optimizer,
                                              precision)
                        row(precision, "dptrain", "api", time_step(step, sync, *timing))
                        del step
                        _release(be)
                    if args.profile:
                        profiles.append(profile_ours(be, model_name, state, data,
                                                     args.optimizer, precision))
                        _release(be)
            if net is None:
                continue
            for precision, mode in torch_step.rows(precisions, args.torch_modes, graphs):
                try:
                    step, sync, compile_s = torch_step.training_step(
                        net, device, mode, precision, args.optimizer, data.images, data.labels,
                        MEAN, STD)
                    row(precision, "pytorch", mode, time_step(step, sync, *timing),
                        compile_note(mode, compile_s), compile_s)
                except Exception as exc:  # a mode PyTorch cannot run here: say so, go on
                    traceback.print_exc(limit=2, file=sys.stderr)
                    row(precision, "pytorch", mode, None,
                        f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                finally:
                    step = sync = None
                    torch_step.release_memory()  # PyTorch's cache would starve our next rows

    fill_derived(rows, peaks)
    header = {"device": device, "gpu": gpu, "host": platform.node(),
              "date": datetime.date.today().isoformat(), "software": machine.gpu_software(),
              "torch": torch_step.version() if use_torch else None,
              "torch_modes": list(args.torch_modes) if use_torch else [],
              "optimizer": args.optimizer, "image_shape": list(image_shape),
              "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
              "peak_tflops": peaks, "command": "python -m dptrain bench train "
              + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.csv:
        write_csv(args.csv, rows)
    if args.json:
        write_json(args.json, header, rows, profiles)
    if profiles:
        echo(format_profiles(profiles))
    skipped = {n: why for n, why in status.items() if why}
    echo(f"\ntraining step, {'x'.join(map(str, image_shape))} images, {args.optimizer}, "
         f"{device}{' (' + gpu + ')' if gpu else ''}, {header['date']}; median of "
         f"{args.repeats} x {args.steps} steps"
         + (f"; PyTorch {header['torch']}" if use_torch else "; no PyTorch")
         + "".join(f"; skipped {n}: {why}" for n, why in skipped.items()))
    echo(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
