// philox.cuh: Philox4x32-10 (Salmon et al., SC'11), the counter-based generator of every
// dropout draw (data.cu's dropout_mask, attention.cu's fused attention). A draw at offset o of
// n elements: element e takes word e % 4 of the generator at counter o + e / 4 (a 64-bit number
// in words 0-1), keyed by the 64-bit seed; u = (word >> 8) / 2^24 in [0, 1), kept when u >= p.
// Two kernels that follow this rule draw the same mask for the same (seed, offset, shape).
#pragma once

struct Philox4 {
  unsigned int v[4];
};

__host__ __device__ __forceinline__ unsigned int mulhilo(unsigned int a, unsigned int b,
                                                         unsigned int* hi) {
  const unsigned long long p = (unsigned long long)a * b;
  *hi = (unsigned int)(p >> 32);
  return (unsigned int)p;
}

// Philox4x32 with 10 rounds.
__host__ __device__ __forceinline__ Philox4 philox4x32_10(Philox4 c, unsigned int k0,
                                                         unsigned int k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    unsigned int hi0, hi1;
    const unsigned int lo0 = mulhilo(0xD2511F53u, c.v[0], &hi0);
    const unsigned int lo1 = mulhilo(0xCD9E8D57u, c.v[2], &hi1);
    Philox4 n;
    n.v[0] = hi1 ^ c.v[1] ^ k0;
    n.v[1] = lo1;
    n.v[2] = hi0 ^ c.v[3] ^ k1;
    n.v[3] = lo0;
    c = n;
  }
  return c;
}

// The generator's four words at counter `ctr` (one group of four elements).
__device__ __forceinline__ Philox4 philox_group(unsigned int key0, unsigned int key1,
                                                unsigned long long ctr) {
  Philox4 c;
  c.v[0] = (unsigned int)ctr;
  c.v[1] = (unsigned int)(ctr >> 32);
  c.v[2] = 0u;
  c.v[3] = 0u;
  return philox4x32_10(c, key0, key1);
}

// A generator word as a uniform in [0, 1) (its top 24 bits).
__device__ __forceinline__ float philox_unit(unsigned int word) {
  return float(word >> 8) * (1.0f / 16777216.0f);
}

// The uniform of element e of a draw at `offset` keyed by `seed`.
__device__ __forceinline__ float philox_uniform(unsigned long long seed, unsigned long long offset,
                                                unsigned long long e) {
  const Philox4 r = philox_group((unsigned int)seed, (unsigned int)(seed >> 32), offset + e / 4);
  return philox_unit(r.v[e % 4]);
}
