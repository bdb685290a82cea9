"""Thread-count sweep: how our kernels speed up from 1 GPU thread to 32,768.

For each T in --threads, every kernel launched through the CUDA backend's grid-stride
helper (elementwise, copies, reductions, softmax, pooling, optimizer, data) runs with
T threads: one block of T threads up to 1,024, then blocks of 1,024 threads (T = 2,048
is 2 blocks, ... 32,768 is 32), set with the CUDA backend's launch_shape override. Two
workloads, on one GPU, with the same inputs at every T:
  inference  the reference CNN (fixed initial weights) over --val-images validation images
  training   --steps steps of --batch-size images (dptrain.run.train.train; its train_s;
             eager steps unless --cuda-graph)
The sweep and both workloads are dptrain.bench.threads; this script runs them, adds the
baselines and writes the tables and plots.
Speedup S(T) = t(T0) / t(T) against the fewest threads run T0 (normally 1); efficiency
E(T) = S(T) / (T / T0). Baselines on the same inputs: the default launch shape (256
threads per block, up to 16 blocks per SM), the NumPy CPU backend and PyTorch.

Caveats, so the numbers read right:
  * GEMM and convolution (the CUDA backend's gemm and conv2d launchers, with their
    split-K and weight reorder helpers) keep their fixed tiles: their time does not
    shrink with T, so the speedup levels off at the share of time they take.
  * Kernels whose lanes cooperate (reductions, softmax rows, max-pool backward, the loss
    and accuracy sums) need whole warps: they run with max(32, T rounded down to a
    multiple of 32) threads per block.
Validation accuracy and loss are recorded for every T: they must not change with T.

With --device cpu only the CPU baselines run (NumPy backend, and PyTorch on the CPU if
installed), labelled as such: a smoke test of the script, not a thread sweep.

Examples:
  python -m scaling.threads --out runs/scaling/threads          # meant to take < 3 min on an H100
  python -m scaling.threads --threads 1,32,1024,32768 --steps 2     # quicker
  python -m scaling.threads --device cpu --val-images 32 --train-images 64 --steps 2 --batch-size 16
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `scaling` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dptrain.bench import threads as bench  # noqa: E402
from scaling import common  # noqa: E402
from scaling.common import Panel, ScalingError  # noqa: E402

DEFAULT_THREADS = ",".join(str(2**i) for i in range(16))  # 1 .. 32768
TRAIN_VAL_IMAGES = 16  # train() validates at its end; keep that small (it is not timed)

FIELDS = ["config", "kind", "threads", "blocks", "threads_per_block", "infer_s",
          "infer_speedup", "infer_eff_pct", "infer_images_per_s", "train_s", "train_speedup",
          "train_eff_pct", "train_images_per_s", "val_accuracy", "val_loss", "train_loss", "runs"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m scaling.threads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    pos = common.positive_int
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto: cuda where a GPU is visible; cpu: the CPU baselines only")
    p.add_argument("--threads", default=DEFAULT_THREADS,
                   help="total threads per launch, comma-separated; above 1024 a multiple of "
                   "1024 (default 1,2,4,...,32768)")
    p.add_argument("--val-images", type=pos, default=500, help="images for inference")
    p.add_argument("--train-images", type=pos, default=1024,
                   help="training set the batches are drawn from")
    p.add_argument("--steps", type=pos, default=3, help="training steps per measurement")
    p.add_argument("--batch-size", type=pos, default=64, help="training batch")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay our training step as a CUDA graph, as `dptrain train` does by "
                   "default (its 2 eager steps and the capture are then timed too); default: "
                   "eager steps, like the PyTorch baseline")
    p.add_argument("--repeats", type=pos, default=3,
                   help="measure up to this many times (while under ~2 s in all); report the "
                   "median")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="no PyTorch baseline")
    p.add_argument("--no-numpy", dest="numpy", action="store_false",
                   help="no NumPy CPU baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None,
                   help="dataset cache (default $DPTRAIN_CACHE or ~/.cache/dptrain)")
    p.add_argument("--out", default="runs/scaling/threads",
                   help="output directory (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    return p.parse_args(argv)


def launch_shapes(text: str) -> list[tuple[int, int, int]]:
    """(total threads, blocks, threads per block) for each T of --threads."""
    shapes = []
    for total in common.parse_counts(text, "--threads"):
        try:
            shapes.append(bench.launch_shape_for(total))
        except ValueError as e:
            raise ScalingError(f"--threads {e}") from None
    return shapes


def ours_training(device: str, args):
    """dptrain.bench.threads' training workload with this script's flags."""
    return bench.training(device, steps=args.steps, batch_size=args.batch_size,
                          train_images=args.train_images, val_images=TRAIN_VAL_IMAGES,
                          seed=args.seed, cache_dir=args.cache_dir, cuda_graph=args.cuda_graph)


# ----------------------------------------------------------------------------- PyTorch


def torch_workloads(device: str, args, val, train_set):
    """(inference, training, label) timing functions for PyTorch on the same inputs."""
    import torch

    from dptrain.data import StrideSampler
    from dptrain.optim import LRSchedule
    from dptrain.run.config import TrainConfig
    from scaling import torch_ddp as td

    dev = torch.device("cuda" if device == "cuda" else "cpu")
    if device == "cuda":
        td.set_precision(torch, "auto")
    sync = (lambda: torch.cuda.synchronize(dev)) if device == "cuda" else (lambda: None)
    shape, classes, mean, std = val.image_shape, val.num_classes, val.mean, val.std
    model = td.reference_cnn(torch, shape, classes, args.seed).to(dev)
    val_x, val_y = td.to_device(torch, val, dev)
    train_x, train_y = td.to_device(torch, train_set, dev)
    batches = StrideSampler(len(train_set.labels), args.batch_size, seed=args.seed)
    batches = torch.from_numpy(batches.epoch_batches(0)[: args.steps]).to(dev)
    cfg = TrainConfig()  # dptrain's optimizer defaults, as train() uses them

    def infer():
        sync()
        start = time.perf_counter()
        metrics = td.evaluate(torch, model, val_x, val_y, mean, std)  # ends with a host read
        return time.perf_counter() - start, metrics

    def training():
        net = td.reference_cnn(torch, shape, classes, args.seed).to(dev)
        opt = td.make_optimizer(torch, net.parameters(), cfg)
        schedule = LRSchedule(cfg.lr, cfg.lr_schedule, len(batches), cfg.warmup_steps)
        sync()
        start = time.perf_counter()
        loss = sum(td.train_step(torch, net, opt, train_x, train_y, idx, mean, std, schedule(k))
                   for k, idx in enumerate(batches))
        loss = loss.item() / len(batches)  # waits for the GPU
        return time.perf_counter() - start, {"train_loss": loss}

    return infer, training, f"PyTorch {torch.__version__} ({dev.type})"


# ----------------------------------------------------------------------------- the sweep


def record(rows, config, kind, infer, training, args, shape=(None, None, None), prefix=""):
    (t_inf, metrics, runs_i), (t_train, info, runs_t) = infer, training
    total, blocks, per_block = shape
    row = {"config": config, "kind": kind, "threads": total, "blocks": blocks,
           "threads_per_block": per_block, "infer_s": t_inf,
           "infer_images_per_s": args.val_images / t_inf, "train_s": t_train,
           "train_images_per_s": args.steps * args.batch_size / t_train,
           "val_accuracy": metrics["val_accuracy"], "val_loss": metrics["val_loss"],
           "train_loss": info["train_loss"], "runs": max(runs_i, runs_t)}
    rows.append(row)
    common.note(f"  {prefix + config:<44} inference {t_inf:9.4f} s   training {t_train:9.4f} s   "
                f"val acc {row['val_accuracy']:.4f}")


def sweep_gpu(rows, args, shapes, val):
    try:
        bench.launch_override()
    except RuntimeError as e:
        raise ScalingError(str(e)) from None
    infer, train = bench.inference("cuda", val, args.seed), ours_training("cuda", args)
    common.note("warm-up (compiles the kernels; not recorded)")
    infer(), train()
    record(rows, "default launch (256/block, <= 16 blocks/SM)", "default",
           bench.measure(infer, args.repeats), bench.measure(train, args.repeats), args)
    results = bench.sweep(shapes, (infer, train), args.repeats)
    for i, ((total, blocks, per_block), (t_infer, t_train)) in enumerate(results, 1):
        record(rows, f"T={total} ({blocks} x {per_block})", "sweep", t_infer, t_train, args,
               (total, blocks, per_block), prefix=f"[{i}/{len(shapes)}] ")


def baselines(rows, args, device, val, train_set):
    if args.numpy:
        cores = os.cpu_count()
        record(rows, f"NumPy CPU backend ({cores} cores)", "baseline",
               bench.measure(bench.inference("cpu", val, args.seed), args.repeats),
               bench.measure(ours_training("cpu", args), args.repeats), args)
    if args.torch:
        if importlib.util.find_spec("torch") is None:
            common.warn("PyTorch is not installed: no PyTorch baseline (--no-torch hides this)")
            return
        infer, training, label = torch_workloads(device, args, val, train_set)
        infer(), training()  # warm-up: cuDNN picks its algorithms
        record(rows, label, "baseline", bench.measure(infer, args.repeats),
               bench.measure(training, args.repeats), args)


def add_speedups(rows):
    """Against the sweep's fewest threads: S = t(T0)/t(T), E = S / (T/T0). Other rows get S
    only (how they compare with T0 GPU threads)."""
    sweep = [r for r in rows if r["kind"] == "sweep"]
    if not sweep:
        return
    base = min(sweep, key=lambda r: r["threads"])
    for row in rows:
        for key in ("infer", "train"):
            row[f"{key}_speedup"] = base[f"{key}_s"] / row[f"{key}_s"]
            if row["kind"] == "sweep":
                row[f"{key}_eff_pct"] = 100.0 * row[f"{key}_speedup"] / (
                    row["threads"] / base["threads"])


COLUMNS = [("Configuration", "config", ""), ("Threads", "threads", "d"),
           ("Blocks", "blocks", "d"), ("Threads/block", "threads_per_block", "d"),
           ("Inference (s)", "infer_s", ".4f"), ("Speedup", "infer_speedup", ".2f"),
           ("Efficiency (%)", "infer_eff_pct", ".1f"), ("Training (s)", "train_s", ".4f"),
           ("Speedup", "train_speedup", ".2f"), ("Efficiency (%)", "train_eff_pct", ".1f"),
           ("Val acc", "val_accuracy", ".4f"), ("Val loss", "val_loss", ".4f")]


def write_outputs(out: Path, rows, args, meta):
    common.write_csv(out / "threads.csv", rows, FIELDS)
    sweep = [r for r in rows if r["kind"] == "sweep"]
    others = [r for r in rows if r["kind"] != "sweep"]
    steps = "steps replayed as a CUDA graph" if args.cuda_graph else "eager steps"
    intro = (f"Inference over {args.val_images} validation images; training: {args.steps} "
             f"{steps} of batch {args.batch_size} (train_s). Speedup and efficiency against the "
             "fewest threads; baselines' speedup: how they compare with that. GEMM and "
             "convolution keep fixed tiles at every T; warp-cooperative kernels use at least "
             "32 threads per block.")
    if not sweep:
        intro = ("CPU baselines only (no GPU sweep: --device cpu). " + intro)
    common.write_markdown(out / "threads.md", "Kernel launch shape sweep", meta,
                          [intro, common.markdown_table(COLUMNS, sweep + others)])
    common.write_meta(out / "meta.json", meta)
    written = [out / "threads.csv", out / "threads.md", out / "meta.json"]
    if sweep:
        xs = [r["threads"] for r in sweep]
        hl = {f"{r['config']}, {k}": r[f"{k}_s"] for r in others for k in ("infer", "train")}
        panels = [
            Panel("time", "total threads T", "seconds", {
                "inference": (xs, [r["infer_s"] for r in sweep]),
                "training": (xs, [r["train_s"] for r in sweep])}, hlines=hl, logx=True, logy=True),
            Panel("speedup vs fewest threads", "total threads T", "speedup", {
                "inference": (xs, [r["infer_speedup"] for r in sweep]),
                "training": (xs, [r["train_speedup"] for r in sweep])},
                ideal=(xs, [x / xs[0] for x in xs]), logx=True, logy=True),
            Panel("efficiency", "total threads T", "efficiency (%)", {
                "inference": (xs, [r["infer_eff_pct"] for r in sweep]),
                "training": (xs, [r["train_eff_pct"] for r in sweep])}, logx=True, logy=True)]
    else:
        bars = {f"{r['config']}: {name}": r[f"{key}_s"] for r in others
                for key, name in (("infer", "inference"), ("train", "training"))}
        panels = [Panel("CPU baselines (no GPU sweep)", "", "seconds", bars=bars)]
    if common.plot_panels(out / "threads.png", panels, meta):
        written.append(out / "threads.png")
    return written


def main(argv) -> int:
    args = parse_args(argv)
    shapes = launch_shapes(args.threads)
    gpus = common.gpu_names()
    device = common.resolve_device(args.device, gpus)
    if device == "cuda" and not gpus and not args.dry_run:
        raise ScalingError("--device cuda: no GPU visible (CuPy and nvidia-smi found none)")
    if args.steps * args.batch_size > args.train_images:
        # train() would wrap into a second epoch; keep the steps inside one.
        raise ScalingError(f"--steps {args.steps} x --batch-size {args.batch_size} is more than "
                           f"--train-images {args.train_images}")
    meta = common.machine_meta("threads", argv, device, gpus, gpu_used=gpus[:1])
    work = (f"inference over {args.val_images} images, {args.steps} training steps of batch "
            f"{args.batch_size}")
    common.note(f"threads sweep on {common.describe_machine(meta)}, {device}: {work}")
    plan = []
    if device == "cuda":
        plan.append("default launch shape (after a warm-up run that compiles the kernels)")
        plan += [f"{bench.describe_shape(b, p)}  # T = {t}" for t, b, p in shapes]
    plan += ["baseline: NumPy CPU backend"] if args.numpy else []
    plan += [f"baseline: PyTorch ({device})"] if args.torch else []
    if args.dry_run:
        common.note("dataset: " + common.shell_line(common.dataset_command(
            args.train_images, args.val_images, args.seed, args.cache_dir)))
        for i, line in enumerate(plan, 1):
            common.note(f"[{i}/{len(plan)}] {line}: {work}")
        return 0
    if not plan:
        raise ScalingError("nothing to measure: --device cpu with --no-numpy and --no-torch")
    out = common.check_out_dir(Path(args.out), dry_run=False)

    from dptrain.data import get_dataset

    val = get_dataset("synthetic", "val", args.val_images, args.seed, args.cache_dir)
    train_set = get_dataset("synthetic", "train", args.train_images, args.seed, args.cache_dir)
    get_dataset("synthetic", "val", TRAIN_VAL_IMAGES, args.seed, args.cache_dir)  # cache it now
    rows = []
    if device == "cuda":
        sweep_gpu(rows, args, shapes, val)
    baselines(rows, args, device, val, train_set)
    add_speedups(rows)
    for path in write_outputs(out, rows, args, meta):
        common.note(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("scaling/threads.py", main))
