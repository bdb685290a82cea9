// tma.cuh: Hopper's tensor memory accelerator (sm_90a): one thread copies a whole box of a
// global tensor into shared memory, described by a 128-byte tensor map the host encoded
// (dptrain/backend/cuda/tma.py), zero-filling what lies outside the tensor; completion is
// counted in bytes on an mbarrier (mbar_expect_tx, then mbar_wait as for any phase).
// The maps come as `const __grid_constant__ TmaMap` kernel parameters, so their address is
// the parameter's own (no copy to local memory).

#pragma once

#include "wgmma.cuh"

namespace wgmma_tiles {

struct __align__(64) TmaMap {
  u64 bits[16];
};

__device__ __forceinline__ u64 map_address(const TmaMap& m) {
  return reinterpret_cast<u64>(&m);
}

// Arrives on `bar` (its count of arrivals) and adds `bytes` to the phase's expected
// transaction count: the phase completes once those bytes have landed too.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Box of the 2-D tiled map at element coordinates (x innermost, y) into shared address dst.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap& m, int x, int y, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst), "l"(map_address(m)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// Box of the 3-D tiled map at element coordinates (x innermost, y, z) into dst.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaMap& m, int x, int y, int z,
                                            u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst), "l"(map_address(m)), "r"(x), "r"(y),
      "r"(z), "r"(bar)
      : "memory");
}

// Box of the 4-D tiled map at element coordinates (x innermost, y, z, w) into dst.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap& m, int x, int y, int z, int w,
                                            u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst), "l"(map_address(m)), "r"(x), "r"(y),
      "r"(z), "r"(w), "r"(bar)
      : "memory");
}

// A column of the 4-D (NHWC) im2col map: its pixels from base position (w, h) of image n
// on, channels c.., each read at the base plus the filter offset (ow, oh).
__device__ __forceinline__ void tma_load_im2col_4d(u32 dst, const TmaMap& m, int c, int w,
                                                   int h, int n, int ow, int oh, u32 bar) {
  const unsigned short ow16 = (unsigned short)ow, oh16 = (unsigned short)oh;
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], {%7, %8};\n" ::"r"(dst), "l"(map_address(m)),
      "r"(c), "r"(w), "r"(h), "r"(n), "r"(bar), "h"(ow16), "h"(oh16)
      : "memory");
}

// Shared address src, laid out as the 2-D tiled map's box (swizzled as it says), into the
// box at element coordinates (x innermost, y); what falls outside the tensor is not
// written. Tracked as a bulk group: bulk_commit, then bulk_wait_read / bulk_wait.
__device__ __forceinline__ void tma_store_2d(const TmaMap& m, u32 src, int x, int y) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
               ::"l"(map_address(m)), "r"(src), "r"(x), "r"(y)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// This thread's bulk groups but the newest N have read their shared memory (it may be
// written again) / have completed.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// The mbarriers of a warp-specialized ring of S stages, at shared addresses 8 bytes apart
// in the kernel's `__shared__ unsigned long long bars[2 * S + 2]`: full[s] completes when
// stage s has landed (the producer's arrival and its bytes), empty[s] when the multiplying
// warpgroup (128 threads) that took it has retired its wgmmas, order[2] hands whole tiles
// between the two multiplying warpgroups (Turns). Thread 0 initializes them; the caller
// syncs the block before any thread uses them.
template <int S>
struct Ring {
  u32 full, empty, order;
  __device__ __forceinline__ explicit Ring(unsigned long long* bars)
      : full((u32)__cvta_generic_to_shared(bars)), empty(full + 8 * S), order(empty + 8 * S) {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < S; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 128);  // one warpgroup takes a slab
    }
    mbar_init(order, 1);
    mbar_init(order + 8, 1);
  }
};

// A multiplying warpgroup's side of the ping-pong: tiles go to warpgroups 0 and 1 in turn,
// and one may start its tile's wgmmas only once the other's previous tile has all its
// slabs landed, so the two take the tensor cores in turn while each runs its epilogue.
struct Turns {
  const int wg;
  const bool leader;  // the thread that hands the turn over
  int turn = 0, waits = 0;
  __device__ __forceinline__ Turns() : wg(threadIdx.x >> 7), leader((threadIdx.x & 127) == 0) {}
  // Whether the next tile is this warpgroup's (else the caller skips its slabs).
  __device__ __forceinline__ bool mine() { return (turn++ & 1) == wg; }
  // Before a tile of KT slabs: wait for the turn (the tile before has landed); a tile of
  // none hands it straight on.
  __device__ __forceinline__ void begin(u32 order, int KT) {
    if (turn > 1) mbar_wait(order + 8 * wg, waits++ & 1);
    if (KT == 0 && leader) mbar_arrive(order + 8 * (wg ^ 1));
  }
  // Once slab kt of KT has landed: the last one hands the turn over.
  __device__ __forceinline__ void landed(u32 order, int kt, int KT) {
    if (kt == KT - 1 && leader) mbar_arrive(order + 8 * (wg ^ 1));
  }
};

}  // namespace wgmma_tiles
