"""Replay a whole training step as one CUDA graph.

The step (batch gather, forward, backward, gradient exchange, optimizer update, metric
sums) never synchronises with the host, so after two eager warm-up steps it is captured
once and then replayed with a single launch per step. Per-step inputs reach the graph
through buffers it reads: the batch indices are copied into a fixed device array, and
the optimizer's scalars (learning rate, bias corrections) are written to its ``hyper``
array, both before each replay.

Everything the capture allocates comes from a memory pool private to the graph, so no
later allocation outside the graph can be handed memory that a replay writes to; the
pool lives as long as the graph.
"""
from __future__ import annotations

import numpy as np


class GraphedStep:
    WARMUP = 2  # eager steps before capture: kernels compiled, pool sized

    def __init__(self, step, batch_size: int):
        import cupy

        self.cupy, self.step = cupy, step
        self.indices = cupy.zeros((batch_size,), dtype=np.int64)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()
        self.graph, self.calls = None, 0

    def __call__(self, batch_indices):
        cupy = self.cupy
        self._order(cupy.cuda.get_current_stream(), self.stream)  # after metric resets, evals
        with self.stream:
            self.indices.set(np.asarray(batch_indices, dtype=np.int64), stream=self.stream)
            if self.calls < self.WARMUP:
                self.step(self.indices)
            else:
                if self.graph is None:
                    self._capture()
                self.graph.launch(self.stream)
        self.calls += 1
        # Later work on the caller's stream (metric reads, evaluation) must see this step.
        self._order(self.stream, cupy.cuda.get_current_stream())

    def _order(self, first, then):
        """Make stream `then` wait for the work already issued on stream `first`."""
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(first)
        then.wait_event(event)

    def _capture(self):
        cupy = self.cupy
        self.stream.synchronize()
        with cupy.cuda.using_allocator(self.pool.malloc):
            self.stream.begin_capture()
            try:
                self.step(self.indices)
            finally:
                self.graph = self.stream.end_capture()
