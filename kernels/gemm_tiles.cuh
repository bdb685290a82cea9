// gemm_tiles.cuh: the tiled main loops shared by gemm.cu and conv2d.cu.
//
// A block computes a BM x BN tile of C = op(A) @ op(B) by walking K in BK-wide slabs.
// Operand tiles go global -> shared memory with cp.async (16-byte chunks where the source is
// contiguous and aligned along the tile's layout, 4-byte elements otherwise), STAGES slabs in
// flight, so loads overlap the arithmetic without staging through registers.
//
// Conventions
//  * Row-major everywhere. Element (mn, k) of an operand tile: mn is the row of A (m) or the
//    column of B (n). A "K-major" tile stores each mn's BK values contiguously ([mn][k]); an
//    "MN-major" tile stores each k's BMN values contiguously ([k][mn]). Rows are padded so the
//    fragment reads below hit 32 distinct banks.
//  * Loaders (DenseLoader here, gathers in conv2d.cu) fill one slab: load(smem, k0, k_end).
//    Elements outside the matrix (mn >= limit, k >= k_end) are written as zeros (cp.async
//    zero-fill), so the main loops never branch on edges; only the epilogue guards its stores.
//  * The TF32 loop reads fragments with ldmatrix (K-major tiles) or 32-bit loads (MN-major)
//    and rounds each register to tf32 with cvt.rna before the mma.
//  * Main loops only accumulate into registers; epilogues decide `=` or `+=`, visiting the
//    accumulators through MmaCoords / SimtCoords::for_each.
//  * Tiles hold float (the TF32 and FP32 loops) or a 16-bit float, __half or __nv_bfloat16
//    (the b16 loop: m16n8k16 tensor-core products with fp32 accumulation, fragments read with
//    ldmatrix, .trans for MN-major tiles). cp.async moves 4 bytes at least, so single 16-bit
//    elements (the gathers' and unaligned operands' path) are loaded by the thread itself.

#pragma once

#include "common.cuh"

// ----------------------------------------------------------------------------- PTX helpers

// 4-byte async copy of one element, or a zero when !ok.
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(ok ? 4 : 0));
}

// One element into a tile, or a zero when !ok: cp.async for float, a plain load for the
// 16-bit types.
__device__ __forceinline__ void put_elem(float* dst, const float* src, bool ok) {
  cp_async4(dst, src, ok);
}
template <typename E>
__device__ __forceinline__ void put_elem(E* dst, const E* src, bool ok) {
  static_assert(sizeof(E) == 2, "16-bit elements");
  *dst = ok ? *src : as<E>(0.f);
}

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// The launcher computes the dynamic shared memory size in Python; a mismatch would corrupt
// memory silently, so stop the kernel loudly instead.
__device__ __forceinline__ void check_smem(unsigned need) {
  if (dynamic_smem_bytes() < need) __trap();
}

// Round to nearest (ties away) to tf32, as the tensor cores would otherwise truncate.
__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// D = A(16x8, row) * B(8x8, col) + D, tf32 inputs, fp32 accumulate.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// to_tf32 of a float held as its bits (what ldmatrix returns).
__device__ __forceinline__ unsigned tf32_bits(unsigned u) { return to_tf32(__uint_as_float(u)); }

// Four 8x4 tiles of 32-bit values (ldmatrix's four 8x8 b16 matrices): lane l passes the
// address of row l%8 of tile l/8 and receives element (l/4, l%4) of tile j in r[j], which is
// exactly the m16n8k8 tf32 fragment layout when the tiles are K-major rows of 4 k values.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// The same with each 8x8 matrix transposed (fragments of MN-major 16-bit tiles).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// Two 8x8 matrices (lanes 0-15 pass the row addresses), plain or transposed.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}

// D = A(16x16, row) * B(16x8, col) + D, fp16 or bf16 inputs (E), fp32 accumulate.
template <typename E>
__device__ __forceinline__ void mma_b16(float (&d)[4], const unsigned (&a)[4],
                                        const unsigned (&b)[2]) {
  if constexpr (same_type<E, __half>::value)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ----------------------------------------------------------------------------- tile layouts

template <int BMN, int BK, bool KMAJOR, int PAD, typename E = float>
struct TileLayout {
  using Elem = E;  // float or a 16-bit float; sizes and offsets count elements
  static constexpr int kBMN = BMN;
  static constexpr int kBK = BK;
  static constexpr bool kKMajor = KMAJOR;
  static constexpr int kStride = KMAJOR ? BK + PAD : BMN + PAD;
  static constexpr int kSize = KMAJOR ? BMN * kStride : BK * kStride;
  static_assert(kStride % (16 / sizeof(E)) == 0, "rows must stay 16-byte aligned");
  __device__ static __forceinline__ int off(int mn, int k) {
    return KMAJOR ? mn * kStride + k : k * kStride + mn;
  }
};

// ----------------------------------------------------------------------------- dense loader

// Operand element (mn, k) of a row-major matrix: p[mn * ld + k] when SRC_KMAJOR, else
// p[k * ld + mn]. `vec` (decided by the launcher: ld a multiple of 16 bytes and p 16-byte
// aligned) allows 16-byte copies when the smem layout keeps the source's contiguous direction.
template <class L, bool SRC_KMAJOR, int THREADS>
struct DenseLoader {
  using Layout = L;
  using E = typename L::Elem;
  const E* p;
  int ld;
  int mn0, mn_end;
  bool vec;

  __device__ __forceinline__ void load(E* s, int k0, int k_end) const {
    constexpr int BMN = L::kBMN, BK = L::kBK, V = 16 / sizeof(E);  // V: elements per chunk
    constexpr int CEXT = SRC_KMAJOR ? BK : BMN;  // tile extent along the contiguous direction
    constexpr int OEXT = SRC_KMAJOR ? BMN : BK;
    if (SRC_KMAJOR == L::kKMajor && vec) {
      constexpr int CPR = CEXT / V;  // chunks per contiguous row
      constexpr int CHUNKS = CPR * OEXT;
#pragma unroll
      for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS;
        if (CHUNKS % THREADS != 0 && idx >= CHUNKS) break;
        const int c = (idx % CPR) * V, o = idx / CPR;
        const int mn = SRC_KMAJOR ? o : c, k = SRC_KMAJOR ? c : o;
        const int gmn = mn0 + mn, gk = k0 + k;
        const int left = SRC_KMAJOR ? k_end - gk : mn_end - gmn;  // valid elements from here
        const bool row_ok = SRC_KMAJOR ? gmn < mn_end : gk < k_end;
        const int n = row_ok ? max(0, min(V, left)) : 0;
        const E* src =
            n ? p + (SRC_KMAJOR ? (long long)gmn * ld + gk : (long long)gk * ld + gmn) : p;
        cp_async16(s + L::off(mn, k), src, n * (int)sizeof(E));
      }
    } else {
      constexpr int ELEMS = CEXT * OEXT;
      static_assert(ELEMS % THREADS == 0, "tile must divide among the threads");
      auto one = [&](int i) {
        const int idx = threadIdx.x + i * THREADS;
        const int c = idx % CEXT, o = idx / CEXT;  // lanes run along the contiguous direction
        const int mn = SRC_KMAJOR ? o : c, k = SRC_KMAJOR ? c : o;
        const int gmn = mn0 + mn, gk = k0 + k;
        const bool ok = gmn < mn_end && gk < k_end;
        const E* src = ok ? p + (long long)gmn * (SRC_KMAJOR ? ld : 1) +
                                (long long)gk * (SRC_KMAJOR ? 1 : ld)
                          : p;
        put_elem(s + L::off(mn, k), src, ok);
      };
      if constexpr (SRC_KMAJOR != L::kKMajor && ELEMS / THREADS <= 8) {
#pragma unroll  // the FP32 kernel's transposing path: its main path, keep it unrolled
        for (int i = 0; i < ELEMS / THREADS; ++i) one(i);
      } else {
        // Not unrolled: hoisted addresses would crowd out the main loop's registers (both
        // kernels spilled), and this path mostly serves unaligned operands.
#pragma unroll 1
        for (int i = 0; i < ELEMS / THREADS; ++i) one(i);
      }
    }
  }

  // The staged interface of mma16_mainloop: cp.async needs no registers, so fetch is load.
  struct Regs {};
  __device__ __forceinline__ void fetch(Regs&, E* s, int k0, int k_end) const { load(s, k0, k_end); }
  __device__ __forceinline__ void put(E*, const Regs&) const {}
};

// ----------------------------------------------------------------------------- slab pipeline

// The cp.async ring both main loops run: STAGES slots, each one K slab of the A tile followed
// by the B tile. pipeline_start issues the first STAGES - 1 slabs and returns the slab count;
// pipeline_next(kt) waits until slab kt has landed for every thread, issues slab
// kt + STAGES - 1 into the slot slab kt - 1 used, and returns slab kt's A tile (its B tile
// follows at + LA::Layout::kSize). One commit group per slab, issued or not, so the group
// count stays in step with kt. After the loop: cp_async_wait<0>().
template <class LA, class LB, typename E>
__device__ __forceinline__ void load_slab(const LA& la, const LB& lb, E* s, int k0, int k_end) {
  la.load(s, k0, k_end);
  lb.load(s + LA::Layout::kSize, k0, k_end);
}

template <int BK, int STAGES, class LA, class LB, typename E>
__device__ __forceinline__ int pipeline_start(const LA& la, const LB& lb, E* smem,
                                              int k_begin, int k_end) {
  constexpr int STAGE = LA::Layout::kSize + LB::Layout::kSize;
  const int ntiles = k_end > k_begin ? (k_end - k_begin + BK - 1) / BK : 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) load_slab(la, lb, smem + s * STAGE, k_begin + s * BK, k_end);
    cp_async_commit();
  }
  return ntiles;
}

template <int BK, int STAGES, class LA, class LB, typename E>
__device__ __forceinline__ const E* pipeline_next(const LA& la, const LB& lb, E* smem, int kt,
                                                  int ntiles, int k_begin, int k_end) {
  constexpr int STAGE = LA::Layout::kSize + LB::Layout::kSize;
  cp_async_wait<STAGES - 2>();  // slab kt has landed (this thread's copies) ...
  __syncthreads();              // ... and everyone's; slab kt-1 is no longer being read
  const int nk = kt + STAGES - 1;
  if (nk < ntiles) load_slab(la, lb, smem + (nk % STAGES) * STAGE, k_begin + nk * BK, k_end);
  cp_async_commit();  // always, so the group count stays in step with kt
  return smem + (kt % STAGES) * STAGE;
}

// ----------------------------------------------------------------------------- TF32 main loop

// BM x BN block tile, WARPS_M x WARPS_N warps, each a (BM/WARPS_M) x (BN/WARPS_N) warp tile of
// m16n8k8 tensor-core products.
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct MmaCfg {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_;
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
  static constexpr int MT = WM / 16, NT = WN / 8;
  static_assert(MT >= 1 && NT >= 1 && WM % 16 == 0 && WN % 8 == 0 && BK % 8 == 0, "bad tile");
};

// Row/column of accumulator element e (0..3) of fragment (mt, nt), relative to the block tile.
template <class Cfg>
struct MmaCoords {
  int wm0, wn0, gid, tig;
  __device__ __forceinline__ MmaCoords() {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    wm0 = (warp / Cfg::WARPS_N) * Cfg::WM;
    wn0 = (warp % Cfg::WARPS_N) * Cfg::WN;
    gid = lane >> 2;
    tig = lane & 3;
  }
  __device__ __forceinline__ int row(int mt, int e) const { return wm0 + mt * 16 + gid + (e >> 1) * 8; }
  __device__ __forceinline__ int col(int nt, int e) const { return wn0 + nt * 8 + tig * 2 + (e & 1); }

  // The epilogue's loops (see SimtCoords for the same interface): cols(g) calls g(col, slot)
  // once for each of the COLS columns this thread holds; for_each(acc, f) calls
  // f(row, col, slot, value) for every accumulator, slot naming its column among the COLS.
  static constexpr int COLS = Cfg::NT * 2;
  template <class G> __device__ __forceinline__ void cols(G&& g) const {
#pragma unroll
    for (int nt = 0; nt < Cfg::NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) g(col(nt, j), nt * 2 + j);
  }
  template <class F>
  __device__ __forceinline__ void for_each(const float (&acc)[Cfg::MT][Cfg::NT][4], F&& f) const {
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < Cfg::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(row(mt, e), col(nt, e), nt * 2 + (e & 1), acc[mt][nt][e]);
  }
};

template <class Cfg>
__device__ __forceinline__ void zero_acc(float (&acc)[Cfg::MT][Cfg::NT][4]) {
#pragma unroll
  for (int i = 0; i < Cfg::MT; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

template <class Cfg, class LA, class LB>
__device__ __forceinline__ void mma_mainloop(float (&acc)[Cfg::MT][Cfg::NT][4], const LA& la,
                                             const LB& lb, float* smem, int k_begin, int k_end) {
  using SA = typename LA::Layout;
  using SB = typename LB::Layout;
  constexpr int BK = Cfg::BK, STAGES = Cfg::STAGES;
  static_assert(SA::kBMN == Cfg::BM && SB::kBMN == Cfg::BN && SA::kBK == BK && SB::kBK == BK,
                "loader tiles must match the block tile");

  zero_acc<Cfg>(acc);

  const int ntiles = pipeline_start<BK, STAGES>(la, lb, smem, k_begin, k_end);
  const MmaCoords<Cfg> at;
  const int lane = threadIdx.x & 31;
  for (int kt = 0; kt < ntiles; ++kt) {
    const float* sA = pipeline_next<BK, STAGES>(la, lb, smem, kt, ntiles, k_begin, k_end);
    const float* sB = sA + SA::kSize;
#pragma unroll
    for (int ks = 0; ks < BK; ks += 8) {
      // B fragments for the whole warp tile, then one A fragment at a time (fewer live
      // registers). K-major tiles: one ldmatrix.x4 per fragment pair; MN-major: 32-bit loads.
      // Every register is rounded to tf32 (cvt.rna) as it is used; rounding once in place
      // after the copy landed measured 20% slower (it sits between the wait and the barrier).
      unsigned bf[Cfg::NT][2];
      if constexpr (SB::kKMajor && Cfg::NT % 2 == 0) {
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; nt += 2) {
          unsigned r[4];
          const int n = at.wn0 + nt * 8 + (lane & 7) + ((lane >> 4) << 3);
          ldmatrix_x4(r, sB + SB::off(n, ks + ((lane >> 3) & 1) * 4));
          bf[nt][0] = tf32_bits(r[0]), bf[nt][1] = tf32_bits(r[1]);
          bf[nt + 1][0] = tf32_bits(r[2]), bf[nt + 1][1] = tf32_bits(r[3]);
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; ++nt) {
          const int n = at.wn0 + nt * 8 + at.gid, k = ks + at.tig;
          bf[nt][0] = to_tf32(sB[SB::off(n, k)]);
          bf[nt][1] = to_tf32(sB[SB::off(n, k + 4)]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < Cfg::MT; ++mt) {
        unsigned af[4];
        if constexpr (SA::kKMajor) {
          const int m = at.wm0 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          ldmatrix_x4(af, sA + SA::off(m, ks + (lane >> 4) * 4));
#pragma unroll
          for (int e = 0; e < 4; ++e) af[e] = tf32_bits(af[e]);
        } else {
          const int m = at.wm0 + mt * 16 + at.gid, k = ks + at.tig;
          af[0] = to_tf32(sA[SA::off(m, k)]);
          af[1] = to_tf32(sA[SA::off(m + 8, k)]);
          af[2] = to_tf32(sA[SA::off(m, k + 4)]);
          af[3] = to_tf32(sA[SA::off(m + 8, k + 4)]);
        }
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; ++nt) mma_tf32(acc[mt][nt], af, bf[nt]);
      }
    }
  }
  cp_async_wait<0>();
}

// ----------------------------------------------------------------------------- b16 main loop

// The TF32 loop's structure on 16-bit tiles (__half or __nv_bfloat16): m16n8k16 products,
// fragments straight from ldmatrix (K-major tiles) or ldmatrix.trans (MN-major), no
// per-register rounding. An odd number of 8-wide B fragments ends with ldmatrix.x2.
// Loads are staged: each loader's fetch(regs, slot, k0, k_end) issues slab kt + STAGES - 1's
// global reads (cp.async straight into its slot, or plain loads into registers for 2-byte
// gathers, which cp.async cannot move) before the math on slab kt, and put(slot, regs) stores
// the registers after it, so a gather's latency hides behind the math as cp.async's does. The
// slot was last read by slab kt - 1, which every thread finished before this iteration's
// barrier.
template <class Cfg, class LA, class LB, typename E>
__device__ __forceinline__ void mma16_mainloop(float (&acc)[Cfg::MT][Cfg::NT][4], const LA& la,
                                               const LB& lb, E* smem, int k_begin, int k_end) {
  static_assert(sizeof(E) == 2, "16-bit tiles");
  using SA = typename LA::Layout;
  using SB = typename LB::Layout;
  constexpr int BK = Cfg::BK, STAGES = Cfg::STAGES;
  static_assert(SA::kBMN == Cfg::BM && SB::kBMN == Cfg::BN && SA::kBK == BK && SB::kBK == BK,
                "loader tiles must match the block tile");
  static_assert(BK % 16 == 0, "k steps of 16");

  zero_acc<Cfg>(acc);

  constexpr int STAGE = SA::kSize + SB::kSize;
  const int ntiles = pipeline_start<BK, STAGES>(la, lb, smem, k_begin, k_end);
  const MmaCoords<Cfg> at;
  const int lane = threadIdx.x & 31, j8 = lane >> 3, r8 = lane & 7;
  for (int kt = 0; kt < ntiles; ++kt) {
    cp_async_wait<STAGES - 2>();  // slab kt has landed (this thread's copies) ...
    __syncthreads();              // ... and everyone's; slab kt-1 is no longer being read
    const int nk = kt + STAGES - 1;
    E* next = smem + (nk % STAGES) * STAGE;
    typename LA::Regs ra;
    typename LB::Regs rb;
    if (nk < ntiles) {
      la.fetch(ra, next, k_begin + nk * BK, k_end);
      lb.fetch(rb, next + SA::kSize, k_begin + nk * BK, k_end);
    }
    cp_async_commit();  // always, so the group count stays in step with kt
    const E* sA = smem + (kt % STAGES) * STAGE;
    const E* sB = sA + SA::kSize;
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
      // B: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) give
      // fragments nt and nt + 1; lane l addresses row l % 8 of matrix l / 8.
      unsigned bf[Cfg::NT][2];
#pragma unroll
      for (int nt = 0; nt + 1 < Cfg::NT; nt += 2) {
        unsigned r[4];
        const int n0 = at.wn0 + nt * 8 + (j8 >> 1) * 8;
        if constexpr (SB::kKMajor) ldmatrix_x4(r, sB + SB::off(n0 + r8, ks + (j8 & 1) * 8));
        else ldmatrix_x4_trans(r, sB + SB::off(n0, ks + r8 + (j8 & 1) * 8));
        bf[nt][0] = r[0], bf[nt][1] = r[1], bf[nt + 1][0] = r[2], bf[nt + 1][1] = r[3];
      }
      if constexpr (Cfg::NT % 2 == 1) {
        constexpr int nt = Cfg::NT - 1;
        const int n0 = at.wn0 + nt * 8, jj = (lane >> 3) & 1;
        if constexpr (SB::kKMajor) ldmatrix_x2<false>(bf[nt], sB + SB::off(n0 + r8, ks + jj * 8));
        else ldmatrix_x2<true>(bf[nt], sB + SB::off(n0, ks + r8 + jj * 8));
      }
#pragma unroll
      for (int mt = 0; mt < Cfg::MT; ++mt) {
        // A: matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15).
        unsigned af[4];
        const int m0 = at.wm0 + mt * 16 + (j8 & 1) * 8, k0 = ks + (j8 >> 1) * 8;
        if constexpr (SA::kKMajor) ldmatrix_x4(af, sA + SA::off(m0 + r8, k0));
        else ldmatrix_x4_trans(af, sA + SA::off(m0, k0 + r8));
#pragma unroll
        for (int nt = 0; nt < Cfg::NT; ++nt) mma_b16<E>(acc[mt][nt], af, bf[nt]);
      }
    }
    if (nk < ntiles) {
      la.put(next, ra);
      lb.put(next + SA::kSize, rb);
    }
  }
  cp_async_wait<0>();
}

// ----------------------------------------------------------------------------- FP32 main loop

// 256 threads as (256 / TX) x TX (16 x 16, or 8 x 32 for 256-wide tiles of few rows); each
// owns a TM x TN register tile split into two halves along each axis (rows ty*TM/2 + i and
// BM/2 + ty*TM/2 + i), so a warp's smem reads are contiguous vectors. Both operand tiles must
// be MN-major ([k][mn]).
template <int BM_, int BN_, int BK_, int STAGES_, int TX_ = 16>
struct SimtCfg {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_;
  static constexpr int THREADS = 256, TX = TX_, TY = THREADS / TX;
  static constexpr int TM = BM / TY, TN = BN / TX;
  static_assert(TM * TY == BM && TN * TX == BN, "the thread grid must divide the tile");
  static_assert(TM >= 2 && TN >= 2 && TM <= 8 && TN <= 8, "thread tile 2..8 per axis");
};

template <int N>
__device__ __forceinline__ void lds_vec(float* d, const float* s) {
  if constexpr (N == 4) {
    const float4 v = *reinterpret_cast<const float4*>(s);
    d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
  } else if constexpr (N == 2) {
    const float2 v = *reinterpret_cast<const float2*>(s);
    d[0] = v.x, d[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) d[i] = s[i];
  }
}

template <class Cfg>
struct SimtCoords {
  int ty, tx;
  __device__ __forceinline__ SimtCoords() : ty(threadIdx.x / Cfg::TX), tx(threadIdx.x % Cfg::TX) {}
  __device__ __forceinline__ int row(int i) const {
    return (i / (Cfg::TM / 2)) * (Cfg::BM / 2) + ty * (Cfg::TM / 2) + i % (Cfg::TM / 2);
  }
  __device__ __forceinline__ int col(int j) const {
    return (j / (Cfg::TN / 2)) * (Cfg::BN / 2) + tx * (Cfg::TN / 2) + j % (Cfg::TN / 2);
  }

  // The epilogue's loops, as in MmaCoords: the thread's column j is its slot.
  static constexpr int COLS = Cfg::TN;
  template <class G> __device__ __forceinline__ void cols(G&& g) const {
#pragma unroll
    for (int j = 0; j < Cfg::TN; ++j) g(col(j), j);
  }
  template <class F>
  __device__ __forceinline__ void for_each(const float (&acc)[Cfg::TM][Cfg::TN], F&& f) const {
#pragma unroll
    for (int i = 0; i < Cfg::TM; ++i)
#pragma unroll
      for (int j = 0; j < Cfg::TN; ++j) f(row(i), col(j), j, acc[i][j]);
  }
};

template <class Cfg, class LA, class LB>
__device__ __forceinline__ void simt_mainloop(float (&acc)[Cfg::TM][Cfg::TN], const LA& la,
                                              const LB& lb, float* smem, int k_begin,
                                              int k_end) {
  using SA = typename LA::Layout;
  using SB = typename LB::Layout;
  constexpr int BK = Cfg::BK, STAGES = Cfg::STAGES, TM = Cfg::TM, TN = Cfg::TN;
  static_assert(!SA::kKMajor && !SB::kKMajor, "the FP32 loop reads [k][mn] tiles");
  static_assert(SA::kBMN == Cfg::BM && SB::kBMN == Cfg::BN && SA::kBK == BK && SB::kBK == BK,
                "loader tiles must match the block tile");

#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

  const int ntiles = pipeline_start<BK, STAGES>(la, lb, smem, k_begin, k_end);
  const SimtCoords<Cfg> at;
  for (int kt = 0; kt < ntiles; ++kt) {
    const float* sA = pipeline_next<BK, STAGES>(la, lb, smem, kt, ntiles, k_begin, k_end);
    const float* sB = sA + SA::kSize;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float a[TM], b[TN];
      lds_vec<TM / 2>(a, sA + SA::off(at.ty * (TM / 2), k));
      lds_vec<TM / 2>(a + TM / 2, sA + SA::off(Cfg::BM / 2 + at.ty * (TM / 2), k));
      lds_vec<TN / 2>(b, sB + SB::off(at.tx * (TN / 2), k));
      lds_vec<TN / 2>(b + TN / 2, sB + SB::off(Cfg::BN / 2 + at.tx * (TN / 2), k));
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }
  cp_async_wait<0>();
}

// ----------------------------------------------------------------------------- epilogue

// bias_mode: 0 none, 1 bias[n] (per column), 2 bias[m] (per row); + EPI_RELU: ReLU after the
// bias (Linear + ReLU in one pass), as relu's kernel: v < 0 -> 0, NaN kept.
constexpr int EPI_RELU = 4;

// alpha * acc + bias, then ReLU where bias_mode asks: one output's value before rounding.
template <typename B>
__device__ __forceinline__ float epilogue_value(float acc, float alpha, const B* bias,
                                                int bias_mode, int m, int n) {
  float v = alpha * acc;
  if ((bias_mode & 3) == 1) v += as<float>(bias[n]);
  if ((bias_mode & 3) == 2) v += as<float>(bias[m]);
  return (bias_mode & EPI_RELU) && v < 0.f ? 0.f : v;
}

// ----------------------------------------------------------------------------- split-K reduce

// C[b] = alpha * sum_s ws[s][b] (+ bias) (+ beta * C[b]), summed in split order so results do
// not depend on scheduling. ws is dense [splits][batch][M][N] (float partials W for 16-bit
// outputs); C rows are ldc apart. bias_mode as epilogue_value's (beta != 0 takes no ReLU).
// Loads go 8 at a time ahead of their additions (same order), so a thread waits for memory
// once per 8 splits rather than once per split.
template <typename T, typename W>
__device__ __forceinline__ void splitk_store(T* __restrict__ C, const T* __restrict__ bias,
                                             float acc, long long b, int m, int n, int ldc,
                                             long long sC, float alpha, float beta,
                                             int bias_mode) {
  float v = epilogue_value(acc, alpha, bias, bias_mode, m, n);
  T* c = C + b * sC + (long long)m * ldc + n;
  if (beta != 0.f) v += beta * as<float>(*c);
  *c = as<T>(v);
}

// sum_{s = s0, s0 + ds, ... < splits} p[s * step], in that order.
template <typename W>
__device__ __forceinline__ float splitk_sum(const W* __restrict__ p, long long step, int s0,
                                            int ds, int splits) {
  float acc = 0.f;
  int s = s0;
  for (; s + 7 * ds < splits; s += 8 * ds) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = as<float>(p[(s + u * ds) * step]);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += v[u];
  }
  for (; s < splits; s += ds) acc += as<float>(p[s * step]);
  return acc;
}

template <typename T, typename W = T>
__global__ void splitk_reduce_kernel(const W* __restrict__ ws, T* __restrict__ C,
                                     const T* __restrict__ bias, int splits, int batch, int M,
                                     int N, int ldc, long long sC, float alpha, float beta,
                                     int bias_mode) {
  const long long mn = (long long)M * N, total = mn * batch;
  GRID_STRIDE(i, total) {
    const long long b = i / mn, r = i - b * mn;
    const int m = (int)(r / N), n = (int)(r - (long long)m * N);
    const float acc = splitk_sum(ws + i, total, 0, 1, splits);
    splitk_store<T, W>(C, bias, acc, b, m, n, ldc, sC, alpha, beta, bias_mode);
  }
}

// The same for few outputs and many splits (a backward-weight's small filter over a long
// batch): a warp per output, lane l summing splits l, l + 32, ... in order, then the lanes
// in a fixed tree. Still independent of scheduling; a different order than the kernel above.
template <typename T, typename W = T>
__global__ void splitk_reduce_warp_kernel(const W* __restrict__ ws, T* __restrict__ C,
                                          const T* __restrict__ bias, int splits, int batch,
                                          int M, int N, int ldc, long long sC, float alpha,
                                          float beta, int bias_mode) {
  const long long mn = (long long)M * N, total = mn * batch;
  const int lane = threadIdx.x & 31;
  for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; i < total;
       i += ((long long)gridDim.x * blockDim.x) >> 5) {
    float acc = splitk_sum(ws + i, total, lane, 32, splits);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(FULL_MASK, acc, o);
    if (lane == 0) {
      const long long b = i / mn, r = i - b * mn;
      const int m = (int)(r / N), n = (int)(r - (long long)m * N);
      splitk_store<T, W>(C, bias, acc, b, m, n, ldc, sC, alpha, beta, bias_mode);
    }
  }
}
