// data.cu: device-side batch assembly and randomness. Launchers: dptrain/backend/cuda/data.py.
//
// Conventions
//  * gather_normalize: out[b] = T(float(images[idx[b]]) * scale[c] - shift[c]), with scale =
//    1/(255*std) and shift = mean/std per channel c (one channel: the same pair everywhere),
//    rounded to float32 on the host, as the CPU backend does; they travel by value in a
//    ChannelAffine (at most DP_MAX_CHANNELS channels). Element r of a row (chw elements) is
//    in channel (r / hw) where hw = H*W. The multiply
//    and the subtract are rounded separately (__fmul_rn / __fsub_rn: no fused multiply-add) so
//    the result equals NumPy's bit for bit; T (float32, or the model's 16 bits) rounds it once,
//    as a cast after it would. A row index outside [0, M) yields NaN rows. `=`.
//  * gather_normalize_cl_kernel: the same values laid out channels-last as the stem
//    convolution reads them (transpose.cu's channels_last_input_kernel of the above: zero
//    columns, pairs of columns, zero channels), bit for bit, in one pass. `=`.
//  * Random state lives on the device: state = [seed, offset] (unsigned 64-bit), the runtime's
//    rng_state. dropout_mask: Philox4x32-10 (Salmon et al., SC'11), keyed by the 64-bit seed;
//    element group i (4 elements) uses counter (offset + i) as a 64-bit number in words 0-1.
//    After each draw the launcher runs rng_advance_kernel, which adds the draw's group count
//    to the offset on the device, so no two draws share random numbers, also when a captured
//    CUDA graph replays them. A uniform u in [0, 1) comes from the top 24 bits; keep when
//    u >= p. Outputs are written with `=`: scale (= 1/(1-p) rounded to T on the host) or 0.
//  * augment_crop_flip: out of place on a float batch (B, C, H, W), its elements moved as raw
//    bits (T: the unsigned type of their size; 0 bits are +0.0); state = [seed, counter]
//    (unsigned 64-bit), owned by the caller (the device loader), advanced by one after each
//    call by rng_advance_kernel. Image b's draws: h = splitmix64(idx + splitmix64(splitmix64(
//    seed) + counter)) with idx = first + b * stride (all mod 2^64); dy = (h & 0xFFFFFF) %
//    (2*pad+1), dx = ((h >> 24) & 0xFFFFFF) % (2*pad+1), flip = (h >> 48) & 1 -- the same
//    integer arithmetic as the CPU backend's augment_draws, so both draw the same crops.
//    out[b,c,i,j] = x[b, c, i+dy-pad, j'+dx-pad], j' = flip ? W-1-j : j; 0 outside. `=`.
//  * rrc_boxes_kernel + resized_crop_kernel: random-resized-crop, flip and normalisation of
//    uint8 images straight into the model's input (T = float, __half, __nv_bfloat16; NHWC or
//    NCHW). The definition, draws and float rounding included, is the CPU backend's
//    dptrain/backend/cpu/augment.py: every operation is one IEEE operation rounded once
//    (__d*_rn / __f*_rn, so no fused multiply-add), and exp is the same +,*,/ polynomial, so
//    boxes are exact and values equal NumPy's bit for bit. boxes: int32 rows of BOX_INTS =
//    top, left, h, w, virtual_h, virtual_w, off_y, off_x, flip; resized_crop_kernel reads row
//    b (box_stride BOX_INTS) or one shared row (box_stride 0: evaluation's centre crop).
//    The state's counter is advanced by rng_advance_kernel after the box draw. `=`.

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
// V values per thread (8 or 4 where the launcher found rows and planes in whole 8- or 4-byte
// words: a word loaded, its values stored as one vector; a plane never splits one), each
// computed as one value is. (ResNet-50's 3x224x224 batch of 256 in fp16, 115 MB moved on an
// H200: 80.6 us at 4 a thread, 46.9 at 8.)
template <typename L, int V, typename T>
__global__ void gather_normalize_kernel(T* out, const unsigned char* images, const L* idx,
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
    T* dst = out + (long long)b * chw;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) * V; r < chw;
         r += gridDim.x * blockDim.x * V) {
      const int c = r / hw;
      const auto value = [&](unsigned char q) {
        return as<T>(valid ? __fsub_rn(__fmul_rn(float(q), scale[c]), shift[c])
                           : quiet_nan<float>());
      };
      if constexpr (V > 1) {
        using Word = Lanes<unsigned char, V>;
        const Word q = *reinterpret_cast<const Word*>(src + r);
        Lanes<T, V> out;
#pragma unroll
        for (int k = 0; k < V; ++k) out.v[k] = value(q.v[k]);
        *reinterpret_cast<Lanes<T, V>*>(dst + r) = out;
      } else {
        dst[r] = value(src[r]);
      }
    }
  }
}

// gather_normalize laid out channels-last in the same pass (the two passes it replaces took
// 46.9 + 86.4 us for ResNet-50's fp16 batch of 256 on an H200, NOTES-gemm row 69; that step
// 31.955 -> 31.881 ms with it):
// out[b][h][u][g * C + c] = gather_normalize's value of images[idx[b]][c][h][G * u + g - L]
// for g < G and a column inside the image, zero for every other slot s < S of the pixel; NaN
// in the image's slots where idx[b] is outside [0, M). A thread writes V neighbouring slots:
// 16 bytes where S allows (V * sizeof(T) = 16; the 3-channel stem in pairs of columns, padded
// to 8 slots in 16 bits: one store a pixel), else one. Per-channel pairs from shared memory,
// as in gather_normalize_kernel.
template <typename L, int V, typename T>
__global__ void gather_normalize_cl_kernel(T* __restrict__ out,
                                           const unsigned char* __restrict__ images,
                                           const L* __restrict__ idx, long long M, int n, int C,
                                           int H, int W, int Wo, int S, int G, int left,
                                           ChannelAffine a) {
  __shared__ float scale[DP_MAX_CHANNELS], shift[DP_MAX_CHANNELS];
  if (threadIdx.x < DP_MAX_CHANNELS) {
    scale[threadIdx.x] = a.scale[threadIdx.x];
    shift[threadIdx.x] = a.shift[threadIdx.x];
  }
  __syncthreads();
  const int per_pixel = S / V;
  const long long plane = (long long)H * W;
  GRID_STRIDE_32(i, n) {
    const int pixel = i / per_pixel, s0 = (i - pixel * per_pixel) * V;
    const int u = pixel % Wo, h = (pixel / Wo) % H, b = pixel / (Wo * H);
    const long long row = (long long)idx[b];
    const bool valid = row >= 0 && row < M;
    // row h of the image's first plane (never read for an invalid row)
    const unsigned char* src = images + (valid ? row : 0) * C * plane + (long long)h * W;
    Lanes<T, V> pk;
    // slot s0 + k's column and channel, counted on (as channels_last_input_kernel)
    int g = s0 / C, c = s0 - g * C;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int w = G * u + g - left;
      float v = 0.0f;
      if (g < G && w >= 0 && w < W) {
        v = valid ? __fsub_rn(__fmul_rn(float(src[c * plane + w]), scale[c]), shift[c])
                  : quiet_nan<float>();
      }
      pk.v[k] = as<T>(v);
      if (++c == C) c = 0, ++g;
    }
    reinterpret_cast<Lanes<T, V>*>(out)[i] = pk;
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

// ---- random-resized-crop (dptrain/backend/cpu/augment.py is the definition)
#define DP_BOX_INTS 9

// e**x from +, *, / rounded once each: halve to |x| <= 1/8, degree-12 Horner, square back.
__device__ __forceinline__ double det_exp(double x) {
  int n = 0;
  while (fabs(x) > 0.125) {
    x = __dmul_rn(x, 0.5);
    ++n;
  }
  double p = 1.0;
  for (int k = 12; k >= 1; --k) p = __dadd_rn(1.0, __dmul_rn(__ddiv_rn(x, (double)k), p));
  for (int i = 0; i < n; ++i) p = __dmul_rn(p, p);
  return p;
}

__device__ __forceinline__ double unit53(unsigned long long r) {
  return __dmul_rn((double)(r >> 11), 1.1102230246251565e-16);  // 2^-53
}

// One thread per image: torchvision's RandomResizedCrop.get_params with our draws.
__global__ void rrc_boxes_kernel(int* boxes, long long B, int H, int W, int size, double s0,
                                 double s1, double l0, double l1, double r0, double r1,
                                 const unsigned long long* state, unsigned long long first,
                                 unsigned long long stride) {
  const unsigned long long base = splitmix64(splitmix64(state[0]) + state[1]);
  GRID_STRIDE(b, B) {
    const unsigned long long key = splitmix64(first + (unsigned long long)b * stride + base);
    const double area = (double)H * (double)W;
    long long top = -1, left = 0, h = 0, w = 0;
    for (int a = 0; a < 10 && top < 0; ++a) {
      const double target =
          __dmul_rn(area, __dadd_rn(s0, __dmul_rn(__dsub_rn(s1, s0), unit53(splitmix64(key + 2 * a)))));
      const double aspect =
          det_exp(__dadd_rn(l0, __dmul_rn(__dsub_rn(l1, l0), unit53(splitmix64(key + 2 * a + 1)))));
      const long long cw = (long long)rint(__dsqrt_rn(__dmul_rn(target, aspect)));
      const long long ch = (long long)rint(__dsqrt_rn(__ddiv_rn(target, aspect)));
      if (0 < cw && cw <= W && 0 < ch && ch <= H) {
        w = cw;
        h = ch;
        top = (long long)(splitmix64(key + 20) % (unsigned long long)(H - h + 1));
        left = (long long)(splitmix64(key + 21) % (unsigned long long)(W - w + 1));
      }
    }
    if (top < 0) {  // torchvision's fallback: the whole image clamped to the ratio range
      const double in_ratio = __ddiv_rn((double)W, (double)H);
      h = H;
      w = W;
      if (in_ratio < r0) {
        h = (long long)rint(__ddiv_rn((double)W, r0));
      } else if (in_ratio > r1) {
        w = (long long)rint(__dmul_rn((double)H, r1));
      }
      top = (H - h) / 2;
      left = (W - w) / 2;
    }
    int* box = boxes + b * DP_BOX_INTS;
    box[0] = (int)top;
    box[1] = (int)left;
    box[2] = (int)h;
    box[3] = (int)w;
    box[4] = size;
    box[5] = size;
    box[6] = 0;
    box[7] = 0;
    box[8] = (int)(splitmix64(key + 22) & 1ull);
  }
}

// Bilinear source of output o (PyTorch's upsample_bilinear2d, align_corners=False).
struct Tap {
  int lo, hi;
  float lam;
};
__device__ __forceinline__ Tap bilinear_tap(int o, int in, int virt) {
  const float scale = __fdiv_rn((float)in, (float)virt);
  const float src = fmaxf(__fsub_rn(__fmul_rn(__fadd_rn((float)o, 0.5f), scale), 0.5f), 0.0f);
  Tap t;
  t.lo = (int)src;
  t.hi = t.lo + (t.lo < in - 1 ? 1 : 0);
  t.lam = fminf(__fsub_rn(src, (float)t.lo), 1.0f);
  return t;
}

// One output element per thread: out (B, C, S, S), or (B, S, S, C) when NHWC.
template <typename T, bool NHWC>
__global__ void resized_crop_kernel(T* out, const unsigned char* images, const long long* idx,
                                    long long B, long long M, int C, int H, int W, int S,
                                    const int* boxes, int box_stride, ChannelAffine a) {
  __shared__ float scale[DP_MAX_CHANNELS], shift[DP_MAX_CHANNELS];
  if (threadIdx.x < DP_MAX_CHANNELS) {
    scale[threadIdx.x] = a.scale[threadIdx.x];
    shift[threadIdx.x] = a.shift[threadIdx.x];
  }
  __syncthreads();
  GRID_STRIDE(i, B * C * S * S) {
    long long t = i;
    int c, ox, oy;
    if (NHWC) {
      c = (int)(t % C);
      t /= C;
      ox = (int)(t % S);
      t /= S;
      oy = (int)(t % S);
      t /= S;
    } else {
      ox = (int)(t % S);
      t /= S;
      oy = (int)(t % S);
      t /= S;
      c = (int)(t % C);
      t /= C;
    }
    const long long b = t;
    const long long row = idx[b];
    if (row < 0 || row >= M) {
      out[i] = quiet_nan<T>();
      continue;
    }
    const int* box = boxes + b * box_stride;
    const Tap ty = bilinear_tap(oy + box[6], box[2], box[4]);
    const Tap tx = bilinear_tap((box[8] ? S - 1 - ox : ox) + box[7], box[3], box[5]);
    const unsigned char* plane = images + (row * C + c) * (long long)H * W;
    const unsigned char* r0 = plane + (long long)(box[0] + ty.lo) * W + box[1];
    const unsigned char* r1 = plane + (long long)(box[0] + ty.hi) * W + box[1];
    const float wx1 = tx.lam, wx0 = __fsub_rn(1.0f, tx.lam);
    const float wy1 = ty.lam, wy0 = __fsub_rn(1.0f, ty.lam);
    const float top = __fadd_rn(__fmul_rn(wx0, (float)r0[tx.lo]), __fmul_rn(wx1, (float)r0[tx.hi]));
    const float bot = __fadd_rn(__fmul_rn(wx0, (float)r1[tx.lo]), __fmul_rn(wx1, (float)r1[tx.hi]));
    const float v = __fadd_rn(__fmul_rn(wy0, top), __fmul_rn(wy1, bot));
    out[i] = as<T>(__fsub_rn(__fmul_rn(v, scale[c]), shift[c]));
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

// instantiate: gather_normalize_kernel<{int, long long}, {1, 4, 8}, {float, __half, __nv_bfloat16}>
// instantiate: gather_normalize_cl_kernel<{int, long long}, {1, 4}, float>
// instantiate: gather_normalize_cl_kernel<{int, long long}, {1, 8}, {__half, __nv_bfloat16}>
// instantiate: dropout_mask_kernel<{float, double, __half, __nv_bfloat16}>
// instantiate: rng_advance_kernel
// instantiate: augment_crop_flip_kernel<{unsigned short, unsigned int, unsigned long long}>
// instantiate: rrc_boxes_kernel
// instantiate: resized_crop_kernel<{float, __half, __nv_bfloat16}, {false, true}>
