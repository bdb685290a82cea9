"""Benchmarks: every piece of code that measures our kernels.

Suites run as ``python -m dptrain bench <suite>``, each a module with main(argv): ``ops``
(kernels against cuBLAS / cuDNN / CuPy and the NumPy backend), ``train`` (training-step
throughput against PyTorch), ``comm`` (gradient-exchange bandwidth, under mpirun). Library
modules the scaling scripts call: ``threads`` (the launch-shape sweep and its workloads),
``machine`` (what a result records about the GPU). Imports of CuPy here are lazy, inside
functions, and only for timing (CUDA events) and references (cuBLAS through CuPy); our own
ops always run through the backend.
"""
