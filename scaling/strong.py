"""Strong scaling: one training epoch over a fixed dataset on 1, 2, 4, ... GPUs.

The total work is fixed and split over more GPUs. Two batch modes:
  per-gpu  every rank takes --batch-size images per step (the global batch grows with G)
  global   the global batch --global-batch-size is split over the G ranks (the same
           optimisation at every G; fewer images per rank as G grows)
Each run is `mpirun -n G python -m dptrain train ... --epochs 1 --log-dir DIR`; its
DIR/summary.json gives the time (train_s: the epoch's training time, without start-up,
data loading, validation and the warm-up steps), images/s, validation accuracy and loss.
With --torch the same runs are made with PyTorch DDP (scaling/torch_ddp.py under torchrun)
in each execution of --torch-modes (default graph: the whole step as one CUDA graph).

Speedup S(G) = b * R(G) / R(b) from the images/s R against the fewest GPUs b run (normally
1; with the same images timed, b * T(b) / T(G)), efficiency E(G) = S(G) / G. Outputs in
--out: strong.csv, strong.md, strong.png, meta.json and
runs/<framework>-<execution>-<mode>-<G>gpu/ (summary.json, metrics.jsonl, run.log).

Examples:
  python -m scaling.strong --images 1000000 --torch --out runs/scaling/strong
  python -m scaling.strong --model resnet18 --torch --torch-modes eager,compile,graph
  python -m scaling.strong --device cpu --gpus 1,2 --images 512     # smoke test on the CPU
  python -m scaling.strong --dry-run                                 # show the commands
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `scaling` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scaling import common  # noqa: E402
from scaling.common import ScalingError  # noqa: E402

DEFAULTS = {"cuda": {"batch": 256, "global": 1024}, "cpu": {"batch": 32, "global": 64}}
MODES = ("per-gpu", "global")

DEFINITIONS = ("Execution: how the step runs (graph: captured once as a CUDA graph and "
               "replayed; compile: torch.compile; eager: op by op). Time: training seconds of "
               "one epoch (summary.json `train_s`: start-up, data loading, validation and the "
               "warm-up steps excluded). Speedup S = b x R(G) / R(b) from Images/s R against "
               "the fewest GPUs b of the same framework, execution and mode; efficiency "
               "E = S / G. Loss and Val acc: validation loss and accuracy after the epoch.")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m scaling.strong", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=common.positive_int, default=1_000_000,
                   help="training images (the fixed dataset; default 1,000,000)")
    p.add_argument("--global-batch-size", type=common.positive_int, default=None,
                   help="global batch of the 'global' mode; must divide by every count "
                   f"(default {DEFAULTS['cuda']['global']} on GPUs, {DEFAULTS['cpu']['global']} "
                   "on the CPU)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated from per-gpu, global (default both)")
    common.add_sweep_args(p, "strong", f"{DEFAULTS['cuda']['batch']} on GPUs, "
                             f"{DEFAULTS['cpu']['batch']} on the CPU")
    return p.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ScalingError(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    sweep = common.Sweep("strong", argv, args)
    counts, images = sweep.counts, args.images
    defaults = DEFAULTS[sweep.device]
    batch = args.batch_size or defaults["batch"]
    global_batch = args.global_batch_size or defaults["global"]
    val_images = args.val_images or common.default_val_images(images)

    runs = []
    if "per-gpu" in modes:
        if batch * counts[-1] > images:
            raise ScalingError(f"--batch-size {batch} x {counts[-1]} GPUs = {batch * counts[-1]} "
                               f"images per step is more than --images {images}")
        runs += sweep.runs(f"per-gpu batch {batch}", f"per-gpu-b{batch}", lambda g: images,
                           val_images, lambda g: batch, lambda g: ["--batch-size", str(batch)])
    if "global" in modes:
        uneven = [g for g in counts if global_batch % g]
        if uneven:
            raise ScalingError(f"--global-batch-size {global_batch} does not divide by "
                               f"{', '.join(map(str, uneven))} GPUs")
        if global_batch > images:
            raise ScalingError(f"--global-batch-size {global_batch} is more than --images {images}")
        runs += sweep.runs(f"global batch {global_batch}", f"global-b{global_batch}",
                           lambda g: images, val_images, lambda g: global_batch // g,
                           lambda g: ["--global-batch-size", str(global_batch)])
    return sweep.execute(runs, images, val_images, f"Strong scaling: {args.model}, one epoch of "
                         f"{images:,} images", DEFINITIONS, weak=False)


if __name__ == "__main__":
    sys.exit(common.run_main("scaling/strong.py", main))
