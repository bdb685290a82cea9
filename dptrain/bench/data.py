"""`python -m dptrain bench data`: the images/s the streaming input pipeline sustains alone,
next to what a training step consumes, and which of the two bounds a run.

The pipeline is `--data-on host`'s (dptrain.data.stream): `--data-workers` threads gather each
batch's uint8 rows from the store's memory map into pinned buffers, `--prefetch-depth`
batches ahead, copy them on a copy stream and into the loader's fixed buffer; each step
then normalises the batch on the device (and with ``--augment`` crops and flips it, as the
step would), with no model behind it. It runs in 1 process and in N processes of this host
(``--procs 1 4``: spawned processes, each its own stride shard of one permutation and, on
GPUs, its own GPU), all timed after a barrier; the rate of N is all images over the slowest
process's time.

Page cache: ``warm`` reads the store's file once before the run (skipped, and said so, when
it is larger than the memory available); ``cold`` (``--cold``) first asks the kernel to drop
the file's cached pages with posix_fadvise(POSIX_FADV_DONTNEED), which drops only clean pages
no process maps; the row says when it could not be asked (no posix_fadvise here).

The step's consumption: ``--model NAME`` times our captured training step (bench train's
``our_step``, SGD) at the batch and image shape on this device, or ``--step-images-per-s R``
takes it as given. N processes consume N times one GPU's rate. ``bound`` is the slower side.

The store: ``--data-dir`` (a `data pack` output; its train split), else random uint8 images
(``--images``, ``--channels``, ``--image-size``) written to a temporary file and removed after.

    python -m dptrain bench data [--data-dir STORE | --images N --image-size S --channels C]
        [--batch-size 256] [--steps 50] [--procs 1 4] [--prefetch-depth 3]
        [--data-workers 2] [--augment] [--cold] [--model resnet18 --precision bf16 |
        --step-images-per-s R] [--device auto|cpu|cuda] [--json F.json]
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from dptrain.errors import UsageError

FIELDS = ("procs", "cache", "images_per_s", "per_process", "step_images_per_s", "bound", "note")


# ----------------------------------------------------------------------------- the page cache


def drop_cache(path) -> str:
    """Ask the kernel to drop `path`'s cached pages; what was done, for the row's note."""
    if not hasattr(os, "posix_fadvise"):
        return "NOT dropped: posix_fadvise is not available here"
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"NOT dropped: {exc}"
    return "dropped (posix_fadvise DONTNEED)"


def warm_cache(path, available: int) -> str:
    """Read `path` once so its pages are cached; "" when done, else why not."""
    size = os.path.getsize(path)
    if available and size > available:
        return (f"{path} ({size / 2**30:.1f} GiB) exceeds the memory available "
                f"({available / 2**30:.1f} GiB): it cannot be all in the page cache")
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass
    return ""


# ----------------------------------------------------------------------------- one process


def _shard_rate(spec: dict, barrier=None, results=None) -> dict:
    """In one process: stream `spec`'s shard for warmup + steps batches; {images, seconds}."""
    from dptrain import backend
    from dptrain.data import DeviceLoader, StrideSampler
    from dptrain.data.stream import planned_batches

    be = backend.get(spec["device"])
    rank, world = spec["rank"], spec["procs"]
    if be.runtime.device_count() > 1:
        be.runtime.select_device(rank % be.runtime.device_count())
    images = np.load(spec["path"], mmap_mode="r")
    data = SimpleNamespace(images=images, labels=np.zeros(len(images), np.int64),
                           num_classes=1, mean=0.5, std=0.25)
    batch, total = spec["batch"], spec["warmup"] + spec["steps"]
    loader = DeviceLoader(data, be, batch, augment=spec["augment"], shard=(rank, world),
                          data_on="host", prefetch_depth=spec["depth"],
                          data_workers=spec["workers"])
    sampler = StrideSampler(len(images), batch, world, rank, seed=spec["seed"])
    # planned past the last timed step, so the ring is as full at the end as at the start
    loader.plan(planned_batches(sampler, 0, total + spec["depth"]))
    per_epoch, start = len(sampler), None
    try:
        for step in range(total):
            if step == spec["warmup"]:
                be.runtime.synchronize()
                if barrier is not None:
                    barrier.wait()
                start = time.perf_counter()
            loader.set_batch(sampler.epoch_batches(step // per_epoch)[step % per_epoch])
            loader.batch()
        be.runtime.synchronize()
    finally:
        loader.close()
    out = {"rank": rank, "images": spec["steps"] * batch,
           "seconds": time.perf_counter() - start}
    if results is not None:
        results.put(out)
    return out


def pipeline_rate(spec: dict) -> dict:
    """{images_per_s, per_process}: `spec["procs"]` processes (spawned when more than one)."""
    procs = spec["procs"]
    if procs == 1:
        runs = [_shard_rate({**spec, "rank": 0})]
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(procs), ctx.Queue()
        workers = [ctx.Process(target=_shard_rate, args=({**spec, "rank": r}, barrier, results))
                   for r in range(procs)]
        for w in workers:
            w.start()
        runs = []
        for _ in range(procs):
            if not any(w.is_alive() for w in workers) and results.empty():
                break
            try:
                runs.append(results.get(timeout=600))
            except Exception:  # noqa: BLE001 - a process died: said below
                break
        for w in workers:
            w.join(timeout=60)
        if len(runs) < procs:
            codes = [w.exitcode for w in workers]
            raise RuntimeError(f"bench data: {procs - len(runs)} of {procs} processes gave no "
                               f"result (exit codes {codes})")
    slowest = max(r["seconds"] for r in runs)
    runs.sort(key=lambda r: r["rank"])
    return {"images_per_s": sum(r["images"] for r in runs) / slowest,
            "per_process": [r["images"] / r["seconds"] for r in runs]}


# ----------------------------------------------------------------------------- the step


def step_rate(device, model, precision, batch, image_shape, seed=0) -> float:
    """Images/s of our captured training step (SGD) of `model` at `batch` on one device."""
    from dptrain import backend, nn
    from dptrain.bench.train import NUM_CLASSES, _batch_data, our_step, time_step
    from dptrain.run import amp

    be = backend.get(device)
    data = _batch_data(batch, image_shape, seed)
    state = nn.build_model(model, image_shape, NUM_CLASSES).state_dict()
    matrix = "auto" if precision in amp.COMPUTE_DTYPES else precision
    with be.runtime.precision_scope(matrix):
        step, sync = our_step(be, model, state, data, "sgd", graph=be.runtime.records_graphs,
                              precision=precision)
        seconds = time_step(step, sync, steps=10, warmup=4, repeats=3)
    return batch / seconds


# ----------------------------------------------------------------------------- the command


def _parser():
    import argparse

    from dptrain.cli.argtypes import Parser, positive_float, positive_int

    p = Parser(prog="python -m dptrain bench data", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="a `data pack` output (its train split)")
    p.add_argument("--images", type=positive_int, default=4096,
                   help="without --data-dir: random images in a temporary store")
    p.add_argument("--image-size", type=positive_int, default=64)
    p.add_argument("--channels", type=int, choices=(1, 3), default=3)
    p.add_argument("--batch-size", type=positive_int, default=256, help="per process")
    p.add_argument("--steps", type=positive_int, default=50, help="timed batches per process")
    p.add_argument("--warmup", type=positive_int, default=5, help="batches before timing")
    p.add_argument("--procs", type=positive_int, nargs="+", default=[1],
                   help="process counts to run (each its own shard and GPU)")
    p.add_argument("--prefetch-depth", type=positive_int, default=3)
    p.add_argument("--data-workers", type=positive_int, default=2)
    p.add_argument("--augment", action="store_true", help="also crop and flip on the device")
    p.add_argument("--cold", action="store_true", help="also run with the page cache dropped")
    p.add_argument("--model", default=None, help="time this model's training step")
    p.add_argument("--precision", default=None,
                   help="--model's precision (default: bf16 where the device has it, else fp32)")
    p.add_argument("--step-images-per-s", type=positive_float, default=None,
                   help="one device's step consumption, instead of --model")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    return p


def _store(args, tmp) -> str:
    """The images' .npy file: the packed store's train split, or random images in `tmp`."""
    if args.data_dir:
        from dptrain.data.formats.packed import load_split

        images, _, _ = load_split(args.data_dir, "train", verify=False)
        return str(images.filename)
    shape = (args.images, args.channels, args.image_size, args.image_size)
    path = os.path.join(tmp, "images.npy")
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)
    rng = np.random.default_rng(args.seed)
    for start in range(0, args.images, 1024):
        rows = out[start:start + 1024]
        rows[...] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    out.flush()
    del out
    return path


def _consumption(args, device, shape) -> tuple[float | None, str]:
    if args.step_images_per_s is not None:
        return args.step_images_per_s, "as given"
    if args.model is None:
        return None, ""
    from dptrain import backend

    rt = backend.get(device).runtime
    precision = args.precision or ("bf16" if "bf16" in rt.mixed_precisions() else "fp32")
    rate = step_rate(device, args.model, precision, args.batch_size, shape, args.seed)
    return rate, f"{args.model} {precision} batch {args.batch_size}"


def format_table(rows, header) -> str:
    lines = [header, f"{'procs':>5}  {'cache':<5}  {'pipeline img/s':>14}  "
                     f"{'step img/s':>10}  {'bound':<8}  note"]
    for r in rows:
        step = f"{r['step_images_per_s']:.0f}" if r["step_images_per_s"] else "-"
        lines.append(f"{r['procs']:>5}  {r['cache']:<5}  {r['images_per_s']:>14.0f}  "
                     f"{step:>10}  {r['bound'] or '-':<8}  {r['note']}")
    return "\n".join(lines)


def main(argv=None, echo=print) -> int:
    args = _parser().parse_args(argv)
    from dptrain import backend

    if args.prefetch_depth < 2:
        raise UsageError(f"--prefetch-depth {args.prefetch_depth}: must be an integer >= 2")
    if args.model is not None and args.step_images_per_s is not None:
        raise UsageError("--model and --step-images-per-s: give one of them")
    try:
        device = backend.resolve_device(args.device)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    tmp = tempfile.mkdtemp(prefix="dptrain-bench-data-")
    try:
        path = _store(args, tmp)
        count, *shape = np.load(path, mmap_mode="r").shape
        shape = tuple(shape)
        if args.batch_size * max(args.procs) > count:
            raise UsageError(f"--batch-size {args.batch_size} x {max(args.procs)} processes is "
                             f"more than the store's {count} images")
        step, step_note = _consumption(args, device, shape)
        rows = _measure(args, device, path, step)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    header = (f"bench data: {device}, {path if args.data_dir else 'random store'} "
              f"({'x'.join(map(str, shape))} uint8), batch {args.batch_size} per process, "
              f"depth {args.prefetch_depth}, {args.data_workers} workers"
              f"{', augment' if args.augment else ''}"
              f"{'; step: ' + step_note if step_note else ''}")
    echo(format_table(rows, header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return 0


def _measure(args, device, path, step) -> list[dict]:
    from dptrain import backend

    available = int(backend.get("cpu").runtime.memory_info()[0])
    rows = []
    for procs in args.procs:
        for cache in ("warm", "cold") if args.cold else ("warm",):
            note = warm_cache(path, available) if cache == "warm" else drop_cache(path)
            spec = dict(device=device, path=path, procs=procs, batch=args.batch_size,
                        steps=args.steps, warmup=args.warmup, depth=args.prefetch_depth,
                        workers=args.data_workers, augment=args.augment, seed=args.seed)
            rate = pipeline_rate(spec)
            consumed = step * procs if step else None
            bound = None if consumed is None else (
                "pipeline" if rate["images_per_s"] < consumed else "step")
            rows.append({"procs": procs, "cache": cache, "images_per_s": rate["images_per_s"],
                         "per_process": rate["per_process"], "step_images_per_s": consumed,
                         "bound": bound, "note": note})
    return rows
