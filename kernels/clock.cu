// clock.cu: the device's own clock, for a step's timeline (dptrain.distributed.timeline), eager or
// replayed as a CUDA graph. Launcher: dptrain/backend/cuda/runtime.py (Clock).
//
// clock_stamp_kernel writes the GPU's global nanosecond timer (%globaltimer) into
// stamps[slot]. As a kernel node of a captured graph it rewrites its slot at every replay,
// where a CUDA event recorded during capture cannot be read back. One thread: it marks when
// the work before it on its stream has finished, at the cost of one launch.

#include "common.cuh"

__global__ void clock_stamp_kernel(unsigned long long* stamps, int slot) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  stamps[slot] = t;
}

// instantiate: clock_stamp_kernel
