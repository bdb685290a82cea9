"""Weak scaling: fixed work per GPU, the dataset growing with the GPU count.

Run G trains one epoch over --images-per-gpu x G images, each rank taking --batch-size
images per step, so every rank does the same number of steps at every G. Each run is
`mpirun -n G python -m dptrain train ... --epochs 1 --log-dir DIR` (with --torch also
PyTorch DDP under torchrun, in each execution of --torch-modes, default graph);
DIR/summary.json gives the time (train_s: the epoch's training time, without start-up,
data loading, validation and the warm-up steps), images/s, validation accuracy and loss.

Efficiency E(G) = b x R(G) / (G x R(b)) from the images/s R against the fewest GPUs b run
(normally 1; with the same steps timed, T(b) / T(G)); speedup S(G) = G x E(G), the
throughput gained (ideal: G). Outputs in --out: weak.csv, weak.md, weak.png, meta.json and
runs/<framework>-<execution>-<mode>-<G>gpu/.

Examples:
  python -m scaling.weak --images-per-gpu 125000 --torch --out runs/scaling/weak
  python -m scaling.weak --model resnet18 --torch --torch-modes eager,compile,graph
  python -m scaling.weak --device cpu --gpus 1,2 --images 512     # smoke test on the CPU
  python -m scaling.weak --dry-run
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `scaling` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scaling import common  # noqa: E402
from scaling.common import ScalingError  # noqa: E402

DEFAULT_BATCH = {"cuda": 256, "cpu": 32}

DEFINITIONS = ("Images: the training set, --images-per-gpu x GPUs. Execution: how the step "
               "runs (graph: captured once as a CUDA graph and replayed; compile: "
               "torch.compile; eager: op by op). Time: training seconds of one epoch "
               "(summary.json `train_s`: start-up, data loading, validation and the warm-up "
               "steps excluded). Efficiency E = b x R(G) / (G x R(b)) from Images/s R against "
               "the fewest GPUs b of the same framework and execution; speedup S = G x E "
               "(throughput; ideal G). Loss and Val acc: validation loss and accuracy after "
               "the epoch.")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m scaling.weak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images-per-gpu", "--images", dest="images_per_gpu",
                   type=common.positive_int, default=125_000,
                   help="training images per GPU: run G uses this x G (default 125,000, "
                   "so 1,000,000 at 8 GPUs)")
    common.add_sweep_args(p, "weak", f"{DEFAULT_BATCH['cuda']} on GPUs, "
                                     f"{DEFAULT_BATCH['cpu']} on the CPU")
    return p.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    sweep = common.Sweep("weak", argv, args)
    per_gpu = args.images_per_gpu
    batch = args.batch_size or DEFAULT_BATCH[sweep.device]
    if batch > per_gpu:
        raise ScalingError(f"--batch-size {batch} is more than --images-per-gpu {per_gpu}")
    # One validation set for every count: the same yardstick for accuracy.
    val_images = args.val_images or common.default_val_images(per_gpu)
    runs = sweep.runs(f"per-gpu batch {batch}", f"per-gpu-b{batch}", lambda g: per_gpu * g,
                      val_images, lambda g: batch, lambda g: ["--batch-size", str(batch)])
    largest = per_gpu * sweep.counts[-1]
    return sweep.execute(runs, largest, val_images, f"Weak scaling: {args.model}, {per_gpu:,} "
                         "images per GPU", DEFINITIONS, weak=True)


if __name__ == "__main__":
    sys.exit(common.run_main("scaling/weak.py", main))
