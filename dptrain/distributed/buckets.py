"""``--bucket-mb auto``: gradient bucket sizes from the link and the backward's per-layer times.

The rule. Backward produces the parameters' gradients last layer first; parameter k's is
complete at time r_k (the sum of the backward times of the layers up to it). A bucket's
reduce-scatter can start when its last gradient is complete and the previous bucket's has
finished (one communication stream), and takes
    t(S) = alpha + (n - 1) / n * S / B
for S bytes over n ranks (alpha: the fixed cost of one collective, B: the bus bandwidth).
The exposed time is when the last reduce-scatter ends minus when backward ends. ``plan``
simulates this for every body size S in powers of two from MIN_BYTES up to the whole
gradient, and for a first bucket (backward's first, the last layers) of S, S/2, S/4 or S/8,
so the first reduce-scatter starts early without many small collectives later; it keeps
the pair with the least exposed time (ties: the larger sizes, fewer collectives).

Defaults, measured (BENCHMARKS.md, scaling/results): alpha = 27 us and B = 252 GB/s, the
straight line through reduce-scatter + all-gather on 2 x H200 over NVLink
(scaling/results/comm-h200x2.csv, 1-256 MB, as scaling.model fits it); backward time 0.6 ms,
2/3 of the reference CNN's bf16 step at batch 256 on one H200 (0.907 ms). Where no per-layer
times are given, the backward time is shared over the parameters in proportion to their
sizes (a coarse stand-in: measure per-layer times with ``bench train --profile`` for better).
"""
from __future__ import annotations

ALPHA_S = 27e-6
BUS_BYTES_S = 252e9
BACKWARD_S = 0.6e-3
MIN_BYTES = 256 * 1024
FIRST_FRACTIONS = (1, 2, 4, 8)


def exposed_s(sizes, ready_s, first_bytes, body_bytes, n, alpha_s=ALPHA_S, bus=BUS_BYTES_S):
    """Exposed reduce-scatter seconds of buckets cut greedily (as dptrain.distributed.flat does) from
    parameters of `sizes` bytes, in backward order, complete at `ready_s`."""
    if n <= 1:
        return 0.0
    comm_free, filled, limit, last_ready = 0.0, 0, first_bytes, 0.0

    def send(nbytes, ready):
        nonlocal comm_free
        comm_free = max(comm_free, ready) + alpha_s + (n - 1) / n * nbytes / bus

    for size, ready in zip(sizes, ready_s):
        if filled and filled + size > limit:
            send(filled, last_ready)
            filled, limit = 0, body_bytes
        filled, last_ready = filled + size, ready
    send(filled, last_ready)
    return max(0.0, comm_free - ready_s[-1])


def plan(sizes, n, layer_s=None, backward_s=BACKWARD_S, alpha_s=ALPHA_S,
         bus=BUS_BYTES_S) -> tuple[int, int, float]:
    """(first bucket bytes, body bucket bytes, exposed seconds) of the least exposed plan.

    `sizes`: each parameter's gradient bytes in backward order (last layer first);
    `layer_s`: the backward seconds each takes (default: `backward_s` shared by size)."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    if layer_s is None:
        layer_s = [backward_s * s / total for s in sizes]
    ready, clock = [], 0.0
    for t in layer_s:
        clock += t
        ready.append(clock)
    best = None
    body = MIN_BYTES
    while True:
        for frac in FIRST_FRACTIONS:
            first = max(MIN_BYTES, body // frac)
            cost = exposed_s(sizes, ready, first, body, n, alpha_s, bus)
            key = (round(cost, 9), -body, -first)  # ties: larger buckets, fewer collectives
            if best is None or key < best[0]:
                best = (key, first, body, cost)
        if body >= total:
            break
        body *= 2
    return best[1], best[2], best[3]
