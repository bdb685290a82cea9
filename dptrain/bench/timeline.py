"""`bench comm --timeline OUT.json`: one training step's exchange timeline on every rank.

Trains a model of dptrain.nn through dptrain.DataParallel on random images for a few steps,
captured and replayed as `train` runs them (or eagerly, ``capture=False``), and writes the
last step's timeline (dptrain.distributed.timeline): per-bucket reduce-scatter and all-gather spans
on the communication stream, compute-stream marks. The stamps of a captured step are kernel
nodes of its graph, rewritten by every replay. Rank 0 writes OUT, rank r OUT's stem with
`.rank{r}`; `python -m dptrain plot OUT -o OUT.png` draws it (done here with --png).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGE_SHAPE, CLASSES = (1, 48, 48), 7


def rank_path(out, rank: int) -> Path:
    out = Path(out)
    return out if rank == 0 else out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def record(world, out, model="cnn", batch=16, steps=3, bucket_mb=4.0, grad_exchange="fp32",
           precision="fp32", png=None, capture=True) -> Path:
    """Train `steps` steps at `batch` images per rank; write the last step's timeline."""
    import dptrain as dp
    from dptrain.distributed.timeline import Timeline
    from dptrain.engine import functional as F
    from dptrain.nn import build_model
    from dptrain.run.step import CAPTURE_WARMUP

    be = world.be
    dp.manual_seed(0)
    ddp = dp.DataParallel(build_model(model, IMAGE_SHAPE, CLASSES), "sgd", world=world,
                          precision=precision, bucket_mb=bucket_mb,
                          grad_exchange=grad_exchange, lr=0.01)
    timeline = Timeline(be.runtime, world.rank, world.size, device=be.runtime.name,
                        exchange=grad_exchange, model=model, batch_per_rank=batch,
                        precision=precision, replayed=bool(capture and be.runtime.records_graphs))
    ddp.reducer.timeline = timeline
    step = ddp.compile(lambda b: F.cross_entropy(ddp(b[0]), b[1]), capture=capture)
    rng = np.random.default_rng(world.rank)
    x = rng.standard_normal((batch, *IMAGE_SHAPE)).astype(np.float32)
    y = rng.integers(0, CLASSES, batch)
    replayed = timeline.meta["replayed"]
    for i in range(max(steps, CAPTURE_WARMUP + 2) if replayed else steps):
        if not replayed or i <= CAPTURE_WARMUP:  # call CAPTURE_WARMUP records the graph
            timeline.clear()
        step((x, y))
        be.runtime.synchronize()
        world.comm.barrier()  # the ranks start each step together
    path = rank_path(out, world.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    timeline.write(path, ddp.flat.buckets)
    if png and world.is_root:
        from dptrain.cli.plot_timeline import plot_timeline

        plot_timeline(path, png)
    return path
