// transpose.cu: data movement through strides: transpose, getitem (basic slices) and its
// backward, broadcast_to, concatenate, non-contiguous copies; the tiled transpose of the
// last two axes that the fast paths of the GEMM and convolution launchers copy operands with;
// and an NCHW input laid out channels-last with zero columns and channels (to_channels_last).
// Launchers: dptrain/backend/cuda/transpose.py (copy_: dptrain/backend/cuda/arrays.py).
//
// Conventions
//  * strided_copy writes out[o0] = in[o1] (=) for every row-major index of the Layout; the
//    launcher points `out` and `in` at the first element of each view (offsets already applied),
//    with element strides (0 = broadcast, negative = reversed slice). Results are exact.
//  * The copy works on raw bits: U is an unsigned type of the element's size, so one
//    instantiation serves float32, int32 and uint32 alike; uint4 moves 16-byte vectors of
//    any element type where the launcher found the innermost axis contiguous in whole ones.
//  * take_rows (getitem with one index array on axis 0, e.g. a batch of labels) gathers whole
//    rows; like CuPy's indexing it wraps indices modulo the row count instead of raising.
//  * stride_spread puts a channels-last grid of pixels on every s-th pixel of a larger one and
//    zeros between, rows moved whole (16-byte vectors where they allow).
//  * transpose_many turns a table of 16-bit matrices in one launch (a step's convolution
//    weights into the implicit GEMMs' operands).
//  * index_add (getitem_backward with index arrays) is a gather, not a scatter: each output
//    element sums, in increasing i, the gy[i] whose flat index is its own. No atomics, so the
//    result is deterministic and repeated indices accumulate as np.add.at does.

#include "common.cuh"

template <typename U>
__global__ void strided_copy_kernel(U* out, const U* in, int n, Layout L) {
  GRID_STRIDE_32(i, n) {
    int oo, oi;
    layout_offsets(i, L, oo, oi);
    out[oo] = in[oi];
  }
}

// out[b][c][r] = in[b][r][c] for R x C matrices: 32 x 32 tiles through shared memory, so the
// reads (along c) and the writes (along r) are both contiguous (strided_copy writes one side
// strided, at a third of the bandwidth). Grid (column tiles, row tiles, batch).
template <typename U>
__global__ void tile_transpose_kernel(const U* __restrict__ in, U* __restrict__ out, int R,
                                      int C) {
  __shared__ U tile[32][33];
  const long long base = (long long)blockIdx.z * R * C;
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
  for (int j = threadIdx.y; j < 32; j += 8) {
    const int r = r0 + j, c = c0 + threadIdx.x;
    if (r < R && c < C) tile[j][threadIdx.x] = in[base + (long long)r * C + c];
  }
  __syncthreads();
  for (int j = threadIdx.y; j < 32; j += 8) {
    const int c = c0 + j, r = r0 + threadIdx.x;
    if (r < R && c < C) out[base + (long long)c * R + r] = tile[threadIdx.x][j];
  }
}

// The same for 16-bit elements with R and C even (4-byte-aligned rows): 64 x 64 tiles moved
// as pairs, a 32-bit load of two neighbouring columns and a 32-bit store of two neighbouring
// rows, so each warp request carries 128 bytes instead of 64 (the 32 x 32 kernel reached
// about 1.5 TB/s on 16-bit data). Grid (column tiles of 64, row tiles of 64, batch).
__global__ void tile_transpose_pairs_kernel(const unsigned short* __restrict__ in,
                                            unsigned short* __restrict__ out, int R, int C) {
  __shared__ unsigned short tile[64][66];  // 33 words a row
  const long long base = (long long)blockIdx.z * R * C;
  const int c0 = blockIdx.x * 64, r0 = blockIdx.y * 64, c = c0 + 2 * threadIdx.x;
  for (int j = threadIdx.y; j < 64; j += 8) {
    const int r = r0 + j;
    if (r < R && c < C) {
      const unsigned v = *reinterpret_cast<const unsigned*>(in + base + (long long)r * C + c);
      *reinterpret_cast<unsigned*>(&tile[j][2 * threadIdx.x]) = v;
    }
  }
  __syncthreads();
  const int r = r0 + 2 * threadIdx.x;  // this thread's pair of input rows, output columns
  for (int j = threadIdx.y; j < 64; j += 8) {
    const int cc = c0 + j;
    if (r < R && cc < C) {
      const unsigned v = tile[2 * threadIdx.x][j] | (unsigned)tile[2 * threadIdx.x + 1][j] << 16;
      *reinterpret_cast<unsigned*>(out + base + (long long)cc * R + r) = v;
    }
  }
}

// The same for narrow matrices (a side under 32, e.g. a convolution weight's C_in x 9 taps
// per output channel, which 32 x 32 tiles would cover a third of): block b moves whole
// matrices b, b + gridDim.x, ..., each read into shared memory and written out, both
// contiguous, the reads in 16-byte pieces when `vec` (every matrix 16-byte aligned). Dynamic
// shared memory of R * C elements (the launcher keeps it within 48 KB).
template <typename U>
__global__ void narrow_transpose_kernel(const U* __restrict__ in, U* __restrict__ out, int nb,
                                        int R, int C, int vec) {
  extern __shared__ __align__(16) unsigned char narrow_raw[];
  U* m = reinterpret_cast<U*>(narrow_raw);
  const int n = R * C;
  constexpr int PER = 16 / sizeof(U);
  for (int b = blockIdx.x; b < nb; b += gridDim.x) {
    const long long base = (long long)b * n;
    if (vec)
      for (int i = threadIdx.x; i < n / PER; i += blockDim.x)
        reinterpret_cast<uint4*>(m)[i] = reinterpret_cast<const uint4*>(in + base)[i];
    else
      for (int i = threadIdx.x; i < n; i += blockDim.x) m[i] = in[base + i];
    __syncthreads();
    for (int o = threadIdx.x; o < n; o += blockDim.x) {  // o = c * R + r
      const int c = o / R, r = o - c * R;
      out[base + o] = m[r * C + c];
    }
    __syncthreads();  // m is refilled for the next matrix
  }
}

// Many 16-bit transposes in one launch (a step's convolution weights reordered ahead,
// conv/ahead.py): job j turns nb matrices of R x C at src into (C, R) at dst, exact bits.
// The jobs' pieces lie end to end along the grid, job j's from first[j] on: a narrow job's
// piece is a whole matrix through shared memory (narrow_transpose_kernel's way, R * C
// elements within the dynamic shared memory), a wide job's a 64 x 64 tile of its one matrix
// moved as pairs (tile_transpose_pairs_kernel's way; R and C even). 256 threads a block.
struct TransposeJob {
  const unsigned short* src;
  unsigned short* dst;
  long long first;  // the job's first piece
  int nb, R, C, tiles_c, wide;
};

__global__ void transpose_many_kernel(const TransposeJob* __restrict__ jobs, int njobs) {
  extern __shared__ __align__(16) unsigned char many_raw[];
  const long long piece = blockIdx.x;
  int lo = 0, hi = njobs - 1;  // the last job whose first piece is at most this one
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (jobs[mid].first <= piece) lo = mid; else hi = mid - 1;
  }
  const TransposeJob job = jobs[lo];
  const int R = job.R, C = job.C, t = threadIdx.x;
  const long long p = piece - job.first;
  if (!job.wide) {
    unsigned short* m = reinterpret_cast<unsigned short*>(many_raw);
    const long long base = p * R * C;
    for (int i = t; i < R * C; i += 256) m[i] = job.src[base + i];
    __syncthreads();
    for (int o = t; o < R * C; o += 256) {  // o = c * R + r
      const int c = o / R, r = o - c * R;
      job.dst[base + o] = m[r * C + c];
    }
    return;
  }
  unsigned short(*tile)[66] = reinterpret_cast<unsigned short(*)[66]>(many_raw);
  const int c0 = (int)(p % job.tiles_c) * 64, r0 = (int)(p / job.tiles_c) * 64;
  const int tx = t & 31, ty = t >> 5;
  for (int j = ty; j < 64; j += 8) {
    const int r = r0 + j, c = c0 + 2 * tx;
    if (r < R && c < C)
      *reinterpret_cast<unsigned*>(&tile[j][2 * tx]) =
          *reinterpret_cast<const unsigned*>(job.src + (long long)r * C + c);
  }
  __syncthreads();
  const int r = r0 + 2 * tx;  // this thread's pair of input rows, output columns
  for (int j = ty; j < 64; j += 8) {
    const int c = c0 + j;
    if (r < R && c < C)
      *reinterpret_cast<unsigned*>(job.dst + (long long)c * R + r) =
          tile[2 * tx][j] | (unsigned)tile[2 * tx + 1][j] << 16;
  }
}

// out[b, :] = in[idx[b] mod M, :], rows of `row` elements.
template <typename U, typename L>
__global__ void take_rows_kernel(U* out, const U* in, const L* idx, int B, long long M, long long row) {
  const long long n = (long long)B * row;
  GRID_STRIDE(i, n) {
    const long long b = i / row;
    long long r = (long long)idx[b] % M;
    if (r < 0) r += M;
    out[i] = in[r * row + (i - b * row)];
  }
}

// out[b, y, x, :] = in[b, i, j, :] where y + ph = sh * i and x + pw = sw * j (i < Hi, j < Wi),
// else zeros: a channels-last grid spread onto every sh-th row and sw-th column of (B, H, W)
// pixels. The backward-data of a strided 1x1 convolution, from the dense product at the
// pixels its filter reaches (conv/passes.py's _spread). A block per output image row (grid B*H):
// a row no tap reaches is all zeros; pixel rows of `row` U's.
template <typename U>
__global__ void stride_spread_kernel(U* __restrict__ out, const U* __restrict__ in, int row, int H,
                                     int W, int Hi, int Wi, int sh, int sw, int ph, int pw) {
  const int y = blockIdx.x % H + ph, n = W * row;
  const bool reached = y % sh == 0 && y / sh < Hi;
  const U* src = in + ((long long)(blockIdx.x / H) * Hi + y / sh) * Wi * row;
  U* dst = out + (long long)blockIdx.x * n;
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    U v{};
    const int p = e / row, x = p + pw;
    if (reached && x % sw == 0 && x / sw < Wi) v = src[(x / sw) * row + e - p * row];
    dst[e] = v;
  }
}

// gx[j] = sum of gy[i] over i with idx[i] == j (j < n, i < m). O(n*m): getitem_backward with
// index arrays only, which stays outside the training hot path.
template <typename T>
__global__ void index_add_kernel(T* gx, const T* gy, const long long* idx, int m, int n) {
  GRID_STRIDE_32(j, n) {
    T acc = T(0);
    for (int i = 0; i < m; ++i)
      if (idx[i] == j) acc += gy[i];
    gx[j] = acc;
  }
}

// NCHW x laid out channels-last as the stem convolution's native kernels read it, in one pass
// (the transpose, the zero columns and the zero channels were three copies):
// out[n][h][u][g * C + c] = in[n][c][h][G * u + g - L] for g < G and a column inside the
// image, zero for every other slot s < S of the pixel. G = 2 lays out pairs of columns (a
// stride-2 convolution run over them, nn.layers.column_pairs). A thread writes V neighbouring
// slots: 16 bytes where S allows (V * sizeof(U) = 16), else one.
template <typename U, int V>
__global__ void channels_last_input_kernel(U* __restrict__ out, const U* __restrict__ in,
                                           int n, int C, int H, int W, int Wo, int S, int G,
                                           int L) {
  const int per_pixel = S / V;
  GRID_STRIDE_32(i, n) {
    const int pixel = i / per_pixel, s0 = (i - pixel * per_pixel) * V;
    const int u = pixel % Wo, h = (pixel / Wo) % H, b = pixel / (Wo * H);
    Pack<U, V> pk;
    // slot s0 + k's column and channel, counted on: a division a slot took ResNet-50's batch
    // of 256 (fp16, H200) 104.6 us, this 86.4
    int g = s0 / C, c = s0 - g * C;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int w = G * u + g - L;
      pk.v[k] = g < G && w >= 0 && w < W ? in[(((long long)b * C + c) * H + h) * W + w] : U(0);
      if (++c == C) c = 0, ++g;
    }
    if (V == 1) out[i] = pk.v[0];
    else reinterpret_cast<Pack<U, V>*>(out)[i] = pk;
  }
}

// instantiate: strided_copy_kernel<{unsigned char, unsigned short, unsigned int, unsigned long long, uint4}>
// instantiate: take_rows_kernel<{unsigned char, unsigned short, unsigned int, unsigned long long}, {int, long long}>
// instantiate: index_add_kernel<{float, double}>
// instantiate: tile_transpose_kernel<{unsigned short, unsigned int}>
// instantiate: tile_transpose_pairs_kernel
// instantiate: narrow_transpose_kernel<{unsigned short, unsigned int}>
// instantiate: transpose_many_kernel
// instantiate: stride_spread_kernel<{uint4, unsigned short, unsigned int}>
// instantiate: channels_last_input_kernel<unsigned short, {1, 8}>
// instantiate: channels_last_input_kernel<unsigned int, {1, 4}>
// instantiate: channels_last_input_kernel<unsigned long long, {1, 2}>
