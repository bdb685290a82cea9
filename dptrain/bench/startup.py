"""`python -m dptrain bench startup`: what a cold start costs, each figure from a fresh process.

1. Kernel build (``be.runtime.prepare()``: every family) on an empty kernel cache with each
   ``--workers`` count (default 1 and up to 16), then on the cache the last one left (warm):
   whether threads compile in parallel, and what a warm start still pays.
2. Training (``python -m dptrain train``, ``--train-steps`` steps) of each of ``--models``
   on an empty kernel cache, then again on that cache: ``startup_s`` (process start to the
   first timed step), ``prepare_s`` and ``images_per_s`` of each; the two rates should agree
   within noise. A run builds only the kernels its trace of the model names and the step's
   own (``DataParallel(input_shapes=...)``), so its cold start is not the full build of 1.
A first training run on a cache of its own generates the dataset beforehand, so neither
measured run pays for it. Every process gets its kernel cache through ``CUPY_CACHE_DIR``.

    python -m dptrain bench startup [--device auto] [--workers 1 16] [--train-steps 300]
                                    [--models cnn resnet18 vit mlp] [--json F.json]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dptrain import switches

_PREPARE = ("import json, sys; from dptrain import backend; "
            "print(json.dumps(backend.get(sys.argv[1]).runtime.prepare()))")


def _env(cache, extra=None):
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, CUPY_CACHE_DIR=str(cache), **(extra or {}))


def prepare_in_fresh_process(device, cache, workers) -> dict:
    env = _env(cache, {switches.var("COMPILE_WORKERS"): str(workers)})
    out = subprocess.run([sys.executable, "-c", _PREPARE, device], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def train_in_fresh_process(device, cache, data_cache, log_dir, steps, model="cnn") -> dict:
    cmd = [sys.executable, "-m", "dptrain", "train", "--model", model, "--device", device,
           "--max-steps",
           str(steps), "--epochs", "1000", "--train-images", "16384", "--val-images", "1024",
           "--no-progress", "--log-every", "50", "--cache-dir", str(data_cache),
           "--log-dir", str(log_dir)]
    subprocess.run(cmd, env=_env(cache), check=True, capture_output=True, text=True)
    return json.loads((Path(log_dir) / "summary.json").read_text())


def main(argv=None, echo=print) -> int:
    from dptrain import backend
    from dptrain.cli.argtypes import Parser as _Parser
    from dptrain.cli.argtypes import positive_int as _positive_int

    p = _Parser(prog="python -m dptrain bench startup", description=__doc__,
                formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--workers", type=_positive_int, nargs="+",
                   default=[1, min(16, os.cpu_count() or 1)],
                   help="thread counts to build with, each on an empty cache")
    p.add_argument("--train-steps", type=_positive_int, default=300,
                   help="steps of each training run")
    p.add_argument("--models", nargs="+", default=["cnn"], metavar="MODEL",
                   help="models to train, each on an empty and then a warm cache "
                        "(default: cnn)")
    p.add_argument("--no-train", action="store_true", help="only the kernel build")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    device = backend.resolve_device(args.device)

    result = {"device": device, "build": [], "train": []}
    with tempfile.TemporaryDirectory(prefix="dptrain-startup-") as tmp:
        tmp = Path(tmp)
        for i, workers in enumerate(args.workers):
            r = prepare_in_fresh_process(device, tmp / f"kernels{i}", workers)
            result["build"].append({"cache": "empty", **r})
        r = prepare_in_fresh_process(device, tmp / f"kernels{len(args.workers) - 1}",
                                     args.workers[-1])
        result["build"].append({"cache": "warm", **r})
        if not args.no_train:
            train_in_fresh_process(device, tmp / "kernels-data", tmp / "data", tmp / "L0",
                                   args.train_steps)  # generates the dataset
            for model in args.models:
                for name in ("empty", "warm"):
                    s = train_in_fresh_process(device, tmp / f"kernels-{model}", tmp / "data",
                                               tmp / f"L-{model}-{name}", args.train_steps,
                                               model)
                    result["train"].append({
                        "model": model, "cache": name, "precision": s["config"]["precision"],
                        **{k: s[k] for k in ("startup_s", "prepare_s", "prepare_modules",
                                             "images_per_s", "steps", "warmup_steps_excluded")}})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    echo(f"kernel build, {device}: each line a fresh process")
    echo(f"  {'cache':<6} {'workers':>7} {'files':>5} {'built':>5} {'seconds':>8}")
    for r in result["build"]:
        echo(f"  {r['cache']:<6} {r['workers']:>7} {r['files']:>5} {r['built']:>5} "
             f"{r['seconds']:8.2f}")
    if result["train"]:
        echo(f"training, {args.train_steps} steps: each line a fresh process")
        echo(f"  {'model':<9} {'precision':<9} {'cache':<6} {'startup_s':>9} {'prepare_s':>9} "
             f"{'modules':>7} {'images/s':>10}")
        for r in result["train"]:
            echo(f"  {r['model']:<9} {r['precision']:<9} {r['cache']:<6} {r['startup_s']:9.2f} "
                 f"{r['prepare_s']:9.2f} {r['prepare_modules']:>7} {r['images_per_s']:10.0f}")
    slow = [r for r in result["build"] if r.get("slowest") and r["cache"] == "empty"]
    if slow:
        echo("longest module builds (file, part, seconds) of the " + slow[-1]["cache"]
             + " build with " + str(slow[-1]["workers"]) + " workers: "
             + "; ".join(f"{f} {part} {s:.1f}" for f, part, s in slow[-1]["slowest"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
