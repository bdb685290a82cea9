// data.cu: device-side batch assembly and randomness. Launchers: dptrain/backend/cuda/data.py.
//
// Conventions
//  * gather_normalize: out[b] = float(images[idx[b]]) * scale[c] - shift[c], with scale =
//    1/(255*std) and shift = mean/std per channel c (one channel: the same pair everywhere),
//    rounded to float32 on the host, as the CPU backend does; they travel by value in a
//    ChannelAffine (at most DP_MAX_CHANNELS channels). Element r of a row (chw elements) is
//    in channel (r / hw) where hw = H*W. The multiply
//    and the subtract are rounded separately (__fmul_rn / __fsub_rn: no fused multiply-add) so
//    the result equals NumPy's bit for bit. A row index outside [0, M) yields NaN rows. `=`.
//  * Random state lives on the device: state = [seed, offset] (unsigned 64-bit), the runtime's
//    rng_state. dropout_mask: Philox4x32-10 (Salmon et al., SC'11), keyed by the 64-bit seed;
//    element group i (4 elements) uses counter (offset + i) as a 64-bit number in words 0-1.
//    After each draw the launcher runs rng_advance_kernel, which adds the draw's group count
//    to the offset on the device, so no two draws share random numbers, also when a captured
//    CUDA graph replays them. A uniform u in [0, 1) comes from the top 24 bits; keep when
//    u >= p. Outputs are written with `=`: scale (= 1/(1-p) rounded to T on the host) or 0.
//  * augment_crop_flip: out of place on a float batch (B, C, H, W); state = [seed, counter]
//    (unsigned 64-bit), owned by the caller (the device loader), advanced by one after each
//    call by rng_advance_kernel. Image b's draws: h = splitmix64(idx + splitmix64(splitmix64(
//    seed) + counter)) with idx = first + b * stride (all mod 2^64); dy = (h & 0xFFFFFF) %
//    (2*pad+1), dx = ((h >> 24) & 0xFFFFFF) % (2*pad+1), flip = (h >> 48) & 1 -- the same
//    integer arithmetic as the CPU backend's augment_draws, so both draw the same crops.
//    out[b,c,i,j] = x[b, c, i+dy-pad, j'+dx-pad], j' = flip ? W-1-j : j; 0 outside. `=`.

#include "common.cuh"
#include "philox.cuh"

#define DP_MAX_CHANNELS 16

// Per-channel scale and shift, passed by value (dptrain/backend/cuda/data.py: CHANNEL_AFFINE).
struct ChannelAffine {
  float scale[DP_MAX_CHANNELS];
  float shift[DP_MAX_CHANNELS];
};

// Image b of the batch along grid y (striding over the batch), its chw values along grid x:
// no 64-bit division per element, and the per-channel pairs read from shared memory (indexing
// the by-value struct with a computed channel would copy it to local memory in every thread).
// V values per thread (4 where the launcher found rows and planes in whole 4-byte words: a
// word loaded, 16 bytes stored; a plane never splits one), each computed as one value is.
template <typename L, int V>
__global__ void gather_normalize_kernel(float* out, const unsigned char* images, const L* idx,
                                        int B, long long M, int chw, int hw, ChannelAffine a) {
  __shared__ float scale[DP_MAX_CHANNELS], shift[DP_MAX_CHANNELS];
  if (threadIdx.x < DP_MAX_CHANNELS) {
    scale[threadIdx.x] = a.scale[threadIdx.x];
    shift[threadIdx.x] = a.shift[threadIdx.x];
  }
  __syncthreads();
  for (int b = blockIdx.y; b < B; b += gridDim.y) {
    const long long row = (long long)idx[b];
    const bool valid = row >= 0 && row < M;
    const unsigned char* src = images + (valid ? row : 0) * chw;
    float* dst = out + (long long)b * chw;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) * V; r < chw;
         r += gridDim.x * blockDim.x * V) {
      const int c = r / hw;
      const auto value = [&](unsigned char q) {
        return valid ? __fsub_rn(__fmul_rn(float(q), scale[c]), shift[c]) : quiet_nan<float>();
      };
      if constexpr (V == 4) {
        const uchar4 q = *reinterpret_cast<const uchar4*>(src + r);
        *reinterpret_cast<float4*>(dst + r) = make_float4(value(q.x), value(q.y), value(q.z),
                                                          value(q.w));
      } else {
        dst[r] = value(src[r]);
      }
    }
  }
}

// splitmix64 (Steele, Lea, Flood, OOPSLA'14), all arithmetic modulo 2^64.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__global__ void augment_crop_flip_kernel(T* out, const T* x, long long B, int C, int H, int W,
                                         int pad, const unsigned long long* state,
                                         unsigned long long first, unsigned long long stride) {
  const unsigned long long base = splitmix64(splitmix64(state[0]) + state[1]);
  const unsigned long long span = 2ull * (unsigned long long)pad + 1ull;
  GRID_STRIDE(i, B * C * H * W) {
    long long t = i;
    const int j = (int)(t % W);
    t /= W;
    const int r = (int)(t % H);
    t /= H;  // t = b * C + c
    const long long b = t / C;
    const unsigned long long h = splitmix64(first + (unsigned long long)b * stride + base);
    const int dy = (int)((h & 0xFFFFFFull) % span);
    const int dx = (int)(((h >> 24) & 0xFFFFFFull) % span);
    const bool flip = ((h >> 48) & 1ull) != 0ull;
    const int sr = r + dy - pad;
    const int sc = (flip ? W - 1 - j : j) + dx - pad;
    out[i] = (sr >= 0 && sr < H && sc >= 0 && sc < W) ? x[(t * H + sr) * W + sc] : T(0);
  }
}

template <typename T>
__global__ void dropout_mask_kernel(T* out, long long n, const unsigned long long* state, float p,
                                    compute_t<T> scale) {
  const unsigned long long seed = state[0], offset = state[1];
  const unsigned int key0 = (unsigned int)seed, key1 = (unsigned int)(seed >> 32);
  const long long groups = (n + 3) / 4;
  GRID_STRIDE(i, groups) {
    const Philox4 r = philox_group(key0, key1, offset + (unsigned long long)i);
    for (int j = 0; j < 4; ++j) {
      const long long e = 4 * i + j;
      if (e < n) {
        out[e] = as<T>(philox_unit(r.v[j]) >= p ? scale : compute_t<T>(0));
      }
    }
  }
}

// state[1] += groups (mod 2^64): one thread, launched right after a draw on the same stream.
__global__ void rng_advance_kernel(unsigned long long* state, unsigned long long groups) {
  state[1] += groups;
}

// instantiate: gather_normalize_kernel<{int, long long}, {1, 4}>
// instantiate: dropout_mask_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: rng_advance_kernel
// instantiate: augment_crop_flip_kernel<{float, double}>
