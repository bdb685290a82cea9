"""`mpirun -n N python -m dptrain bench comm`: bus bandwidth of our gradient exchange
(reduce-scatter + all-gather, in place, as the reducer does it) next to one all-reduce of
the same bytes, through the same NCCL communicator.

The collectives run on the backend's communication stream (``be.runtime.comm_stream()``),
as the reducer issues them; each timing ends when the host has waited for them
(``be.runtime.synchronize()``) and the ranks have met at a barrier.

With ``--timeline OUT.json`` it instead trains a few steps of a model, replayed as a CUDA
graph as `train` runs them (``--eager``: eagerly), and writes the last step's per-bucket
exchange timeline on every rank (dptrain.bench.timeline).

Bus bandwidth follows NCCL's tests: for S bytes on n ranks, an all-reduce and a
reduce-scatter + all-gather pair both move 2(n-1)/n * S per rank, so busbw = 2(n-1)/n * S / t.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mpirun -n N python -m dptrain bench comm",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--csv", default=None, help="write the table as CSV (rank 0)")
    p.add_argument("--timeline", default=None, metavar="OUT.json",
                   help="write one training step's per-bucket exchange timeline instead "
                   "(rank r > 0: OUT.rank{r}.json); draw it with `python -m dptrain plot`")
    p.add_argument("--png", default=None, help="--timeline: also draw rank 0's timeline here")
    p.add_argument("--model", default="cnn", help="--timeline: the model trained")
    p.add_argument("--batch", type=int, default=16, help="--timeline: images per rank")
    p.add_argument("--steps", type=int, default=3, help="--timeline: steps (the last is kept)")
    p.add_argument("--bucket-mb", default="4", help="--timeline: MB, or auto")
    p.add_argument("--grad-exchange", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--precision", default="fp32", help="--timeline: the step's precision")
    p.add_argument("--eager", action="store_true",
                   help="--timeline: run the steps eagerly instead of replaying the captured "
                   "step as `train` does")
    args = p.parse_args(argv)

    from dptrain import backend
    from dptrain import distributed as dist

    device = backend.resolve_device(args.device)
    be = backend.get(device)
    world = dist.init(be)
    comm, n = world.comm, world.size
    rt = be.runtime
    if args.timeline:
        from dptrain.bench.timeline import record

        bucket_mb = "auto" if args.bucket_mb == "auto" else float(args.bucket_mb)
        path = record(world, args.timeline, args.model, args.batch, args.steps, bucket_mb,
                      args.grad_exchange, args.precision, args.png, capture=not args.eager)
        from dptrain.distributed.timeline import read, summarize

        print(f"wrote {path}: {summarize(read(path))}")
        return 0

    def sync():
        rt.synchronize()
        comm.barrier()

    rows = []
    for mb in args.sizes_mb:
        count = int(mb * 2**20 / 4) // n * n
        buf = be.asarray(np.random.default_rng(world.rank).standard_normal(count, dtype=np.float32))
        shard = count // n
        mine = buf[world.rank * shard : (world.rank + 1) * shard]
        rt.synchronize()  # the upload is done before the comm stream reads buf

        def pair():
            with rt.on(rt.comm_stream()):
                comm.reduce_scatter(buf, mine)
                comm.all_gather(mine, buf)

        def allreduce():
            with rt.on(rt.comm_stream()):
                comm.all_reduce(buf, "mean")

        result = {"size_mb": mb, "ranks": n}
        for name, fn in (("rs_ag", pair), ("allreduce", allreduce)):
            fn()
            sync()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - start)
            t = statistics.median(times)
            result[f"{name}_ms"] = t * 1e3
            result[f"{name}_busbw_gbs"] = 2 * (n - 1) / n * count * 4 / t / 1e9 if n > 1 else 0.0
        rows.append(result)

    if world.is_root:
        print(f"gradient exchange over {comm.name}, {n} ranks, {device}")
        print(f"{'MB':>8} {'RS+AG ms':>9} {'RS+AG GB/s':>11} {'AR ms':>8} {'AR GB/s':>9} {'RS+AG/AR':>9}")
        for r in rows:
            print(f"{r['size_mb']:8.1f} {r['rs_ag_ms']:9.3f} {r['rs_ag_busbw_gbs']:11.1f} "
                  f"{r['allreduce_ms']:8.3f} {r['allreduce_busbw_gbs']:9.1f} "
                  f"{r['rs_ag_busbw_gbs'] / max(r['allreduce_busbw_gbs'], 1e-9):9.2f}")
        if args.csv:
            import csv

            with open(args.csv, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
