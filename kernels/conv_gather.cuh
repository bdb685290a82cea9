// conv_gather.cuh: backward-weight loaders that gather one element per K lane (KL lanes
// along the GEMM's K = the batch's output pixels), shared by conv2d.cu (NCHW backward-weight)
// and conv2d_nhwc.cu (its FFMA kernel's gy operand).
#pragma once

#include "gemm_tiles.cuh"

// What the two backward-weight loaders share: thread t holds PER elements of a K slab, at
// k = t % KL of tile rows t / KL + i * RSTEP (i < PER); Derived::gather(k0, k_end, f) calls
// f(i, src, ok) for each. load() stores them at once (cp.async for float); fetch() and put()
// stage them through registers for the b16 loop (mma16_mainloop).
template <class Derived, class L, int THREADS, int KL>
struct KLaneLoader {
  using Layout = L;
  using E = typename L::Elem;
  static constexpr int RSTEP = THREADS / KL, PER = L::kBMN / RSTEP;
  static_assert(L::kBK == KL && L::kBMN % RSTEP == 0, "bad backward-weight tile");

  // one(i) for i < PER: fully unrolled where the elements go to registers.
  template <bool UNROLL, class F>
  __device__ __forceinline__ static void each(F&& one) {
    if constexpr (UNROLL) {
#pragma unroll
      for (int i = 0; i < PER; ++i) one(i);
    } else {
#pragma unroll 4
      for (int i = 0; i < PER; ++i) one(i);
    }
  }

  __device__ __forceinline__ static int slot(int i) {
    return L::off(threadIdx.x / KL + i * RSTEP, threadIdx.x % KL);
  }

  __device__ __forceinline__ const Derived& self() const {
    return static_cast<const Derived&>(*this);
  }

  __device__ __forceinline__ void load(E* s, int k0, int k_end) const {
    self().template gather<false>(k0, k_end,
                                  [&](int i, const E* p, bool ok) { put_elem(s + slot(i), p, ok); });
  }

  struct Regs { E v[PER]; };
  __device__ __forceinline__ void fetch(Regs& r, E*, int k0, int k_end) const {
    self().template gather<true>(k0, k_end,
                                 [&](int i, const E* p, bool ok) { r.v[i] = ok ? *p : as<E>(0.f); });
  }
  __device__ __forceinline__ void put(E* s, const Regs& r) const {
#pragma unroll
    for (int i = 0; i < PER; ++i) s[slot(i)] = r.v[i];
  }
};

// A operand: gy[n, co, p] as (m = co, k = q) with q = n*Ho*Wo + p. KL lanes run along q.
template <class L, int THREADS, int KL>
struct GyLoader : KLaneLoader<GyLoader<L, THREADS, KL>, L, THREADS, KL> {
  using Base = KLaneLoader<GyLoader, L, THREADS, KL>;
  using E = typename Base::E;
  const E* gy;
  int M, m0, hw;

  __device__ __forceinline__ GyLoader(const E* gy_, int M_, int m0_, int hw_)
      : gy(gy_), M(M_), m0(m0_), hw(hw_) {}

  template <bool UNROLL, class F>
  __device__ __forceinline__ void gather(int k0, int k_end, F&& f) const {
    const int kk = threadIdx.x % KL, r0 = threadIdx.x / KL;
    const int q = k0 + kk;
    const bool qok = q < k_end;
    const int n = qok ? q / hw : 0, p = qok ? q - n * hw : 0;
    const E* base = gy + ((long long)n * M + m0 + r0) * hw + p;
    Base::template each<UNROLL>([&](int i) {
      const bool ok = qok && m0 + r0 + i * Base::RSTEP < M;
      f(i, ok ? base + (long long)i * Base::RSTEP * hw : gy, ok);
    });
  }
};

