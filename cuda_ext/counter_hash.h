// counter_hash.h - trakflow's counter-based RNG, the integer part, for host and device.
//
// This is a transcription of trak_core/counter_rng.py (the definition of every projection matrix):
// one header, compiled by nvcc into the kernels (as __host__ __device__ functions) and by a plain C++
// compiler into the host check that tests/test_cuda_ext.py runs against the Python definition. Keys are
// 32-bit words; Python computes them with counter_rng.stream_key and passes them to the kernels, the
// same function is here only so the host check can test it too.
//
// No CUDA or torch header is needed: the file compiles with g++ as well as with nvcc.
#pragma once

#include <stdint.h>
#include <math.h>

#if defined(__CUDACC__)
#define TRAKFLOW_HD __host__ __device__ __forceinline__
#else
#define TRAKFLOW_HD inline
#endif

namespace trakflow {

// constants of counter_rng.py
constexpr uint32_t kMix1 = 0x7FEB352Du;
constexpr uint32_t kMix2 = 0x846CA68Bu;
constexpr uint32_t kGolden = 0x9E3779B9u;
constexpr uint32_t kModelSalt = 0x85EBCA6Bu;

// stream identifiers of counter_rng.py
constexpr uint32_t kStreamSignWords = 1;
constexpr uint32_t kStreamNormalU1 = 2;
constexpr uint32_t kStreamNormalU2 = 3;
constexpr uint32_t kStreamSjltRow = 4;
constexpr uint32_t kStreamSjltSign = 5;

// Wellons' lowbias32 mixer (counter_rng.mix32_int)
TRAKFLOW_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMix1;
  x ^= x >> 15;
  x *= kMix2;
  x ^= x >> 16;
  return x;
}

// counter_rng.stream_key
TRAKFLOW_HD uint32_t stream_key(uint64_t seed, uint64_t model_id, uint32_t stream) {
  uint32_t k = mix32(static_cast<uint32_t>(seed) ^ kGolden);
  k = mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = mix32(k ^ static_cast<uint32_t>(model_id) ^ kModelSalt);
  k = mix32(k ^ static_cast<uint32_t>(model_id >> 32));
  return mix32(k + stream * kGolden);
}

// counter_rng.hash_counter: 32 random bits of a 64-bit counter under a key
TRAKFLOW_HD uint32_t hash_counter(uint64_t counter, uint32_t key) {
  const uint32_t lo = static_cast<uint32_t>(counter);
  const uint32_t hi = static_cast<uint32_t>(counter >> 32);
  const uint32_t h = mix32(lo ^ key);
  return mix32(h ^ hi ^ (key * kMix2));
}

// Dense Rademacher (counter_rng.rademacher_block): row i uses ceil(cols / 32) words; bit b of word w is
// column 32 w + b; a set bit is -1.
TRAKFLOW_HD uint64_t rademacher_words_per_row(uint64_t cols) { return (cols + 31) >> 5; }

TRAKFLOW_HD uint32_t rademacher_word(uint64_t row, uint64_t word, uint64_t words_per_row, uint32_t key) {
  return hash_counter(row * words_per_row + word, key);
}

TRAKFLOW_HD float rademacher_entry(uint64_t row, uint64_t col, uint64_t cols, uint32_t key) {
  const uint32_t w = rademacher_word(row, col >> 5, rademacher_words_per_row(cols), key);
  return ((w >> (col & 31)) & 1u) ? -1.0f : 1.0f;
}

// Dense normal (counter_rng.normal_block): counter row * cols + col; u1 in (0, 1], u2 in [0, 1) from 24-bit
// mantissas; z = sqrt(-2 log u1) cos(2 pi u2) in float32 (2 pi rounded to float, as torch does).
TRAKFLOW_HD float normal_from_hashes(uint32_t h1, uint32_t h2) {
  const float u1 = static_cast<float>((h1 >> 8) + 1u) * (1.0f / 16777216.0f);
  const float u2 = static_cast<float>(h2 >> 8) * (1.0f / 16777216.0f);
  const float r = sqrtf(-2.0f * logf(u1));
  return r * cosf(6.28318548202514648f * u2);
}

TRAKFLOW_HD float normal_entry(uint64_t counter, uint32_t key_u1, uint32_t key_u2) {
  return normal_from_hashes(hash_counter(counter, key_u1), hash_counter(counter, key_u2));
}

// SJLT (counter_rng.sjlt_block): coordinate i, nonzero r < c: counter i * c + r; column
// (hash(counter, key_row) * proj_dim) >> 32; the sign is negative when the top bit of hash(counter, key_sign)
// is set. Values are sign * sqrt(proj_dim / c); repeated columns of one coordinate add up.
TRAKFLOW_HD uint32_t sjlt_column(uint64_t counter, uint32_t key_row, uint64_t proj_dim) {
  return static_cast<uint32_t>((static_cast<uint64_t>(hash_counter(counter, key_row)) * proj_dim) >> 32);
}

TRAKFLOW_HD bool sjlt_negative(uint64_t counter, uint32_t key_sign) {
  return (hash_counter(counter, key_sign) >> 31) != 0u;
}

}  // namespace trakflow
