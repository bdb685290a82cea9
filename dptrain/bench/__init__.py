"""Benchmarks: every piece of code that measures our kernels.

Suites run as ``python -m dptrain bench <suite>``, each a module with main(argv): ``ops``
(kernels against cuBLAS / cuDNN / CuPy and the NumPy backend), ``train`` (training-step
throughput against PyTorch), ``comm`` (gradient-exchange bandwidth, under mpirun), ``startup``
(cold start: kernel compilation serial and parallel, time to the first step), ``data`` (the
streaming input pipeline's images/s, 1 and N processes, warm and cold page cache, against a
training step's consumption). Library
modules the scaling scripts call: ``threads`` (the launch-shape sweep and its workloads),
``machine`` (what a result records about the GPU). Our ops run through the backend; the
references they are measured against (cuBLAS, CuPy's kernels) and CUDA-event timing come
from ``dptrain.backend.cuda.vendor``.

May import any package of dptrain; none imports it (``python -m dptrain bench`` loads it by
name), nor does anything outside bench/, scaling/ and tests/.
"""
from __future__ import annotations

SUITES = ("ops", "train", "comm", "startup", "data")


def main(argv) -> int:
    """`python -m dptrain bench SUITE ...`: run one suite's main()."""
    import importlib

    from dptrain.cli.argtypes import Parser as _Parser

    p = _Parser(prog="python -m dptrain bench", description="Benchmarks.")
    p.add_argument("suite", choices=SUITES,
                   help="ops: kernels against references; train: training throughput against "
                   "PyTorch; comm: gradient-exchange bandwidth (under mpirun); startup: "
                   "kernel compilation and time to the first step, cold and warm cache; data: the "
                   "streaming input pipeline's images/s against a step's consumption")
    if argv and argv[0] in SUITES:  # the suite parses the rest, --help included
        return importlib.import_module(f"dptrain.bench.{argv[0]}").main(list(argv[1:])) or 0
    p.parse_args(argv)  # --help, or a one-line error naming the missing or unknown suite
    return 2
