// kernels.cu - trakflow's GPU projection kernels (CUDA C++, no torch headers: binding.cpp holds those).
//
// The matrices are those of trak_core/counter_rng.py, generated on the fly from counter_hash.h, so the
// GPU computes the same projection as the CPU (same seed => same result up to float rounding).
//
// Dense kernels: out = x @ R with x (B, K), R (K, N) generated tile by tile in shared memory/registers.
//   * split-K over the coordinates in fixed chunks of TRAK_KSPLIT rows, one partial sum per split, reduced
//     by a second kernel in split order: deterministic, and independent of the GPU's SM count;
//   * 64-bit indices everywhere (row * words, b * ldx + k, ...); any N (ragged last tile), any B (batch
//     tiles over grid.y; the host wrapper cuts very large batches into chunks);
//   * FMA path: float32 fused multiply-adds on CUDA cores (Rademacher and normal, every GPU);
//   * tensor-core path (Rademacher, sm_80+): the +/-1 matrix is exact in bf16; x is split into 1, 2 or 3
//     bf16 terms (x = hi + mid + lo, the 3-term split carries float32's 24 mantissa bits), multiplied with
//     mma.sync m16n8k16 and accumulated in float32. The B fragments are built in registers straight from the
//     hash words (one 32-bit word gives 32 columns' signs).
// SJLT kernel: a gather over the CSR of the transposed sparse matrix (built once per model on the GPU by
//   torch ops), one warp per (output column, batch tile), summing in a fixed order: no float atomics.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "counter_hash.h"
#include "kernels.h"

namespace {

using trakflow::hash_counter;
using trakflow::normal_entry;

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// +1.0f or -1.0f from bit `bit` of `w` (a set bit is -1), without a conversion instruction
__device__ __forceinline__ float sign_from_bit(uint32_t w, int bit) {
  return __uint_as_float(0x3f800000u | ((w << (31 - bit)) & 0x80000000u));
}

// ------------------------------------------------------------------------------------------------------
// Dense, FMA path: block tile kFmaB batch rows x kFmaN columns, kFmaK coordinates per step, 256 threads,
// each thread 4 batch rows x 4 columns.
constexpr int kFmaB = 32;
constexpr int kFmaN = 128;
constexpr int kFmaK = 32;
constexpr int kFmaThreads = 256;
constexpr int kFmaXPerThread = kFmaB * kFmaK / kFmaThreads;  // 4

template <typename T, int KIND>
__global__ void __launch_bounds__(kFmaThreads)
dense_fma_kernel(const T* __restrict__ x, int64_t B, int64_t K, int64_t ldx, int64_t N, int64_t row0,
                 uint32_t key_a, uint32_t key_b, int64_t ksplit, int64_t ncol_tiles,
                 float* __restrict__ partial) {
  __shared__ __align__(16) float xs[kFmaB][kFmaK];
  __shared__ __align__(16) float rs[kFmaK][kFmaN];

  const int tid = threadIdx.x;
  const int64_t lin = blockIdx.x;
  const int64_t split = lin / ncol_tiles;
  const int64_t n0 = (lin % ncol_tiles) * kFmaN;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * kFmaB;
  const int64_t kb = split * ksplit;
  const int64_t ke = (K < kb + ksplit) ? K : kb + ksplit;
  const uint64_t words = trakflow::rademacher_words_per_row(static_cast<uint64_t>(N));
  const int cg = tid & 31;  // columns n0 + 4 cg .. + 3
  const int bg = tid >> 5;  // batch rows b0 + 4 bg .. + 3 (one warp = one batch group: smem broadcast)

  float acc[4][4];
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;

  // x tile loads: thread reads column xcol of rows xrow + r * kFmaRowStep (coalesced along k)
  constexpr int kFmaRowStep = kFmaThreads / kFmaK;
  const int xrow = tid / kFmaK;
  const int xcol = tid % kFmaK;
  float xr[kFmaXPerThread];
  auto load_x = [&](int64_t k0) {
    const int64_t gk = k0 + xcol;
    const T* p = x + (b0 + xrow) * ldx + gk;
#pragma unroll
    for (int r = 0; r < kFmaXPerThread; ++r) {
      const bool ok = gk < ke && b0 + xrow + r * kFmaRowStep < B;
      xr[r] = ok ? to_f32(p[static_cast<int64_t>(r * kFmaRowStep) * ldx]) : 0.f;
    }
  };

  load_x(kb);
  for (int64_t k0 = kb; k0 < ke; k0 += kFmaK) {
#pragma unroll
    for (int r = 0; r < kFmaXPerThread; ++r) xs[xrow + r * kFmaRowStep][xcol] = xr[r];
    if (KIND == TRAK_RADEMACHER) {
      // 32 rows x 8 groups of 16 columns: one hash word per thread (half of it used)
      const int kk = tid >> 3;
      const int grp = tid & 7;
      const uint64_t col = static_cast<uint64_t>(n0 + grp * 16);
      const uint64_t row = static_cast<uint64_t>(row0 + k0 + kk);
      const uint32_t w = hash_counter(row * words + (col >> 5), key_a) >> (col & 31);
      float4* dst = reinterpret_cast<float4*>(&rs[kk][grp * 16]);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        dst[q] = make_float4(sign_from_bit(w, 4 * q), sign_from_bit(w, 4 * q + 1), sign_from_bit(w, 4 * q + 2),
                             sign_from_bit(w, 4 * q + 3));
    } else {
#pragma unroll 4
      for (int r = 0; r < kFmaK * kFmaN / kFmaThreads; ++r) {
        const int e = tid + r * kFmaThreads;
        const int kk = e / kFmaN;
        const int nn = e % kFmaN;
        const uint64_t counter = static_cast<uint64_t>(row0 + k0 + kk) * static_cast<uint64_t>(N) +
                                 static_cast<uint64_t>(n0 + nn);
        rs[kk][nn] = normal_entry(counter, key_a, key_b);
      }
    }
    __syncthreads();
    if (k0 + kFmaK < ke) load_x(k0 + kFmaK);  // in flight during the products below

#pragma unroll
    for (int kk = 0; kk < kFmaK; kk += 4) {
      float4 xv[4], rv[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) xv[m] = *reinterpret_cast<const float4*>(&xs[bg * 4 + m][kk]);
#pragma unroll
      for (int q = 0; q < 4; ++q) rv[q] = *reinterpret_cast<const float4*>(&rs[kk + q][cg * 4]);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float xm[4] = {xv[m].x, xv[m].y, xv[m].z, xv[m].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[m][0] = fmaf(xm[q], rv[q].x, acc[m][0]);
          acc[m][1] = fmaf(xm[q], rv[q].y, acc[m][1]);
          acc[m][2] = fmaf(xm[q], rv[q].z, acc[m][2]);
          acc[m][3] = fmaf(xm[q], rv[q].w, acc[m][3]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int64_t gb = b0 + bg * 4 + m;
    if (gb >= B) continue;
    float* dst = partial + (split * B + gb) * N;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t gn = n0 + cg * 4 + c;
      if (gn < N) dst[gn] = acc[m][c];
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// Dense Rademacher, tensor-core path (sm_80+): block tile 32 batch rows x 256 columns, 64 coordinates per
// step, 4 warps; each warp owns 64 columns (two hash words per row) for all 32 rows: 2 m16 tiles x 8 n8
// tiles of mma.m16n8k16 (A = x in bf16 terms, row-major; B = signs, "col"; C float32).
constexpr int kTcB = 32;
constexpr int kTcN = 256;
constexpr int kTcK = 64;
constexpr int kTcThreads = 128;
constexpr int kTcLd = kTcK + 8;   // bf16 row stride of the x tile (144 bytes: conflict-free fragment loads)
constexpr int kTcWordsLd = kTcN / 32 + 1;  // padded row of hash words
constexpr int kTcXPerThread = kTcB * kTcK / kTcThreads;  // 16

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two bf16 signs (+/-1.0 = 0x3F80 / 0xBF80) packed low/high from bit 8u of w_lo / w_hi (already shifted).
template <int U>
__device__ __forceinline__ uint32_t pack_signs(uint32_t w_lo, uint32_t w_hi) {
  constexpr int p = 8 * U;
  const uint32_t lo = (p <= 15 ? (w_lo << (15 - p)) : (w_lo >> (p - 15))) & 0x00008000u;
  const uint32_t hi = (w_hi << (31 - p)) & 0x80000000u;
  return 0x3F803F80u | lo | hi;
}

template <typename T, int TERMS>
__global__ void __launch_bounds__(kTcThreads)
dense_tc_kernel(const T* __restrict__ x, int64_t B, int64_t K, int64_t ldx, int64_t N, int64_t row0,
                uint32_t key, int64_t ksplit, int64_t ncol_tiles, float* __restrict__ partial) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ __align__(16) __nv_bfloat16 xs[TERMS][kTcB][kTcLd];
  __shared__ uint32_t ws[kTcK][kTcWordsLd];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // groupID of the fragment layouts
  const int t = lane & 3;   // thread in group
  const int64_t lin = blockIdx.x;
  const int64_t split = lin / ncol_tiles;
  const int64_t n0 = (lin % ncol_tiles) * kTcN;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * kTcB;
  const int64_t kb = split * ksplit;
  const int64_t ke = (K < kb + ksplit) ? K : kb + ksplit;
  const uint64_t words = trakflow::rademacher_words_per_row(static_cast<uint64_t>(N));
  const bool two_m = (B - b0) > 16;  // block-uniform: skip the second m16 tile for small batches

  float acc[2][8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

  // x tile loads: thread reads column xcol of rows xrow + r * kTcRowStep (coalesced along k)
  constexpr int kTcRowStep = kTcThreads / kTcK;
  const int xrow = tid / kTcK;
  const int xcol = tid % kTcK;
  float xr[kTcXPerThread];
  auto load_x = [&](int64_t k0) {
    const int64_t gk = k0 + xcol;
    const T* p = x + (b0 + xrow) * ldx + gk;
#pragma unroll
    for (int r = 0; r < kTcXPerThread; ++r) {
      const bool ok = gk < ke && b0 + xrow + r * kTcRowStep < B;
      xr[r] = ok ? to_f32(p[static_cast<int64_t>(r * kTcRowStep) * ldx]) : 0.f;
    }
  };

  load_x(kb);
  for (int64_t k0 = kb; k0 < ke; k0 += kTcK) {
    // x tile -> TERMS bf16 terms (each residual is exact in float32)
#pragma unroll
    for (int r = 0; r < kTcXPerThread; ++r) {
      float v = xr[r];
#pragma unroll
      for (int term = 0; term < TERMS; ++term) {
        const __nv_bfloat16 h = __float2bfloat16_rn(v);
        xs[term][xrow + r * kTcRowStep][xcol] = h;
        v -= __bfloat162float(h);
      }
    }
    // hash words of this step: kTcK rows x 8 word columns
#pragma unroll
    for (int r = 0; r < kTcK * (kTcN / 32) / kTcThreads; ++r) {
      const int e = tid + r * kTcThreads;
      const int kk = e >> 3;
      const int wc = e & 7;
      const uint64_t row = static_cast<uint64_t>(row0 + k0 + kk);
      ws[kk][wc] = hash_counter(row * words + static_cast<uint64_t>(n0 >> 5) + wc, key);
    }
    __syncthreads();
    if (k0 + kTcK < ke) load_x(k0 + kTcK);  // in flight during the products below

#pragma unroll
    for (int ks = 0; ks < kTcK; ks += 16) {
      uint32_t a[TERMS][2][4];
#pragma unroll
      for (int term = 0; term < TERMS; ++term)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const __nv_bfloat16* base = &xs[term][mt * 16][ks + 2 * t];
          a[term][mt][0] = *reinterpret_cast<const uint32_t*>(base + g * kTcLd);
          a[term][mt][1] = *reinterpret_cast<const uint32_t*>(base + (g + 8) * kTcLd);
          a[term][mt][2] = *reinterpret_cast<const uint32_t*>(base + g * kTcLd + 8);
          a[term][mt][3] = *reinterpret_cast<const uint32_t*>(base + (g + 8) * kTcLd + 8);
        }
#pragma unroll
      for (int wcol = 0; wcol < 2; ++wcol) {
        const int wc = warp * 2 + wcol;
        // rows 2t, 2t+1 (b0 of the B fragment) and 2t+8, 2t+9 (b1); column g of each n8 tile
        const uint32_t w0 = ws[ks + 2 * t][wc] >> g;
        const uint32_t w1 = ws[ks + 2 * t + 1][wc] >> g;
        const uint32_t w2 = ws[ks + 2 * t + 8][wc] >> g;
        const uint32_t w3 = ws[ks + 2 * t + 9][wc] >> g;
        uint32_t bf[4][2];
        bf[0][0] = pack_signs<0>(w0, w1); bf[0][1] = pack_signs<0>(w2, w3);
        bf[1][0] = pack_signs<1>(w0, w1); bf[1][1] = pack_signs<1>(w2, w3);
        bf[2][0] = pack_signs<2>(w0, w1); bf[2][1] = pack_signs<2>(w2, w3);
        bf[3][0] = pack_signs<3>(w0, w1); bf[3][1] = pack_signs<3>(w2, w3);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int nt = wcol * 4 + u;
#pragma unroll
          for (int term = 0; term < TERMS; ++term) {
            mma_bf16_16816(acc[0][nt], a[term][0], bf[u][0], bf[u][1]);
            if (two_m) mma_bf16_16816(acc[1][nt], a[term][1], bf[u][0], bf[u][1]);
          }
        }
      }
    }
    __syncthreads();
  }

  // C fragment: c0, c1 at (row g, cols 2t, 2t+1), c2, c3 at (row g + 8, same cols)
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t gb = b0 + mt * 16 + g + half * 8;
      if (gb >= B) continue;
      float* dst = partial + (split * B + gb) * N;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int64_t gn = n0 + warp * 64 + nt * 8 + 2 * t;
        if (gn < N) dst[gn] = acc[mt][nt][half * 2];
        if (gn + 1 < N) dst[gn + 1] = acc[mt][nt][half * 2 + 1];
      }
    }
#else
  __trap();  // the host side never launches this below sm_80
#endif
}

// ------------------------------------------------------------------------------------------------------
__global__ void reduce_partial_kernel(const float* __restrict__ partial, int64_t S, int64_t B, int64_t N,
                                      float* __restrict__ out, int64_t ldo) {
  const int64_t total = B * N;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = idx / N;
    const int64_t n = idx - b * N;
    float acc = 0.f;
    const float* p = partial + idx;
#pragma unroll 8
    for (int64_t s = 0; s < S; ++s) acc += p[s * total];
    out[b * ldo + n] += acc;
  }
}

// ------------------------------------------------------------------------------------------------------
// SJLT gather: one warp per (column j, batch tile of BT lanes); the 32 / BT lane groups take interleaved
// entries of the column and are summed by a fixed butterfly at the end.
template <typename T, int BT>
__global__ void __launch_bounds__(256)
sjlt_gather_kernel(const T* __restrict__ xT, int64_t K, int64_t B, const int64_t* __restrict__ col_ptr,
                   const int64_t* __restrict__ packed, int64_t N, float scale, float* __restrict__ out,
                   int64_t ldo) {
  constexpr int G = 32 / BT;
  const int lane = threadIdx.x & 31;
  const int64_t nbt = (B + BT - 1) / BT;
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (wid >= N * nbt) return;  // warp-uniform
  const int64_t j = wid / nbt;
  const int64_t bt = wid - j * nbt;
  const int bl = lane % BT;
  const int eg = lane / BT;
  const int64_t b = bt * BT + bl;
  const bool bvalid = b < B;
  const int64_t start = col_ptr[j];
  const int64_t end = col_ptr[j + 1];

  float acc = 0.f;
  for (int64_t e0 = start; e0 < end; e0 += 32) {
    const long long pk = (e0 + lane < end) ? static_cast<long long>(packed[e0 + lane]) : 0LL;
    const int64_t cnt = (end - e0 < 32) ? end - e0 : 32;
#pragma unroll
    for (int s = 0; s < BT; ++s) {
      const int q = s * G + eg;
      const long long p = __shfl_sync(0xffffffffu, pk, q);
      if (q < cnt && bvalid) {
        const float v = to_f32(xT[static_cast<int64_t>(p >> 1) * B + b]);
        acc += (p & 1) ? -v : v;
      }
    }
  }
#pragma unroll
  for (int off = BT; off < 32; off <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (eg == 0 && bvalid) out[b * ldo + j] = acc * scale;
}

// ------------------------------------------------------------------------------------------------------
template <int KIND>
__global__ void dense_block_kernel(int64_t row0, int64_t rows, int64_t N, uint32_t key_a, uint32_t key_b,
                                   float* __restrict__ out) {
  const int64_t total = rows * N;
  const uint64_t words = trakflow::rademacher_words_per_row(static_cast<uint64_t>(N));
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / N;
    const int64_t n = idx - r * N;
    const uint64_t row = static_cast<uint64_t>(row0 + r);
    if (KIND == TRAK_RADEMACHER) {
      const uint32_t w = hash_counter(row * words + (static_cast<uint64_t>(n) >> 5), key_a);
      out[idx] = sign_from_bit(w, static_cast<int>(n & 31));
    } else {
      out[idx] = normal_entry(row * static_cast<uint64_t>(N) + static_cast<uint64_t>(n), key_a, key_b);
    }
  }
}

__global__ void hash_words_kernel(const int64_t* __restrict__ counters, int64_t n, uint32_t key,
                                  int64_t* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = static_cast<int64_t>(hash_counter(static_cast<uint64_t>(counters[i]), key));
}

unsigned grid_for(int64_t total, int threads) {
  int64_t blocks = (total + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > (1 << 20)) blocks = 1 << 20;  // grid-stride loops cover the rest
  return static_cast<unsigned>(blocks);
}

int last_error() { return static_cast<int>(cudaGetLastError()); }

template <typename T>
int launch_dense(const T* x, int64_t B, int64_t K, int64_t ldx, int64_t N, int64_t row0, uint32_t key_a,
                 uint32_t key_b, int kind, int algo, int64_t ksplit, float* partial, cudaStream_t stream) {
  const int64_t splits = (K + ksplit - 1) / ksplit;
  if (algo == TRAK_ALGO_FMA) {
    if (ksplit % kFmaK != 0) return static_cast<int>(cudaErrorInvalidValue);
    const int64_t ncol = (N + kFmaN - 1) / kFmaN;
    const int64_t nbt = (B + kFmaB - 1) / kFmaB;
    if (ncol * splits >= (int64_t(1) << 31) || nbt > 65535) return static_cast<int>(cudaErrorInvalidConfiguration);
    dim3 grid(static_cast<unsigned>(ncol * splits), static_cast<unsigned>(nbt));
    if (kind == TRAK_RADEMACHER)
      dense_fma_kernel<T, TRAK_RADEMACHER><<<grid, kFmaThreads, 0, stream>>>(x, B, K, ldx, N, row0, key_a, key_b,
                                                                            ksplit, ncol, partial);
    else
      dense_fma_kernel<T, TRAK_NORMAL><<<grid, kFmaThreads, 0, stream>>>(x, B, K, ldx, N, row0, key_a, key_b,
                                                                        ksplit, ncol, partial);
    return last_error();
  }
  if (kind != TRAK_RADEMACHER || algo < TRAK_ALGO_TC1 || algo > TRAK_ALGO_TC3)
    return static_cast<int>(cudaErrorInvalidValue);
  if (ksplit % kTcK != 0) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t ncol = (N + kTcN - 1) / kTcN;
  const int64_t nbt = (B + kTcB - 1) / kTcB;
  if (ncol * splits >= (int64_t(1) << 31) || nbt > 65535) return static_cast<int>(cudaErrorInvalidConfiguration);
  dim3 grid(static_cast<unsigned>(ncol * splits), static_cast<unsigned>(nbt));
  if (algo == TRAK_ALGO_TC1)
    dense_tc_kernel<T, 1><<<grid, kTcThreads, 0, stream>>>(x, B, K, ldx, N, row0, key_a, ksplit, ncol, partial);
  else if (algo == TRAK_ALGO_TC2)
    dense_tc_kernel<T, 2><<<grid, kTcThreads, 0, stream>>>(x, B, K, ldx, N, row0, key_a, ksplit, ncol, partial);
  else
    dense_tc_kernel<T, 3><<<grid, kTcThreads, 0, stream>>>(x, B, K, ldx, N, row0, key_a, ksplit, ncol, partial);
  return last_error();
}

template <typename T, int BT>
void launch_sjlt_bt(const T* xT, int64_t K, int64_t B, const int64_t* col_ptr, const int64_t* packed, int64_t N,
                    float scale, float* out, int64_t ldo, cudaStream_t stream) {
  const int64_t warps = N * ((B + BT - 1) / BT);
  const int64_t blocks = (warps + 7) / 8;
  sjlt_gather_kernel<T, BT><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(xT, K, B, col_ptr, packed, N,
                                                                             scale, out, ldo);
}

template <typename T>
int launch_sjlt(const T* xT, int64_t K, int64_t B, const int64_t* col_ptr, const int64_t* packed, int64_t N,
                float scale, float* out, int64_t ldo, int bt, cudaStream_t stream) {
  const int64_t warps = N * ((B + bt - 1) / bt);
  if ((warps + 7) / 8 >= (int64_t(1) << 31)) return static_cast<int>(cudaErrorInvalidConfiguration);
  switch (bt) {
    case 1: launch_sjlt_bt<T, 1>(xT, K, B, col_ptr, packed, N, scale, out, ldo, stream); break;
    case 2: launch_sjlt_bt<T, 2>(xT, K, B, col_ptr, packed, N, scale, out, ldo, stream); break;
    case 4: launch_sjlt_bt<T, 4>(xT, K, B, col_ptr, packed, N, scale, out, ldo, stream); break;
    case 8: launch_sjlt_bt<T, 8>(xT, K, B, col_ptr, packed, N, scale, out, ldo, stream); break;
    case 16: launch_sjlt_bt<T, 16>(xT, K, B, col_ptr, packed, N, scale, out, ldo, stream); break;
    case 32: launch_sjlt_bt<T, 32>(xT, K, B, col_ptr, packed, N, scale, out, ldo, stream); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return last_error();
}

}  // namespace

extern "C" {

int trak_dense_partial(const void* x, int dtype, int64_t B, int64_t K, int64_t ldx, int64_t N, int64_t row0,
                       uint32_t key_a, uint32_t key_b, int kind, int algo, int64_t ksplit, float* partial,
                       void* stream) {
  if (B <= 0 || K <= 0 || N <= 0 || ksplit <= 0 || row0 < 0) return static_cast<int>(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case TRAK_F32:
      return launch_dense(static_cast<const float*>(x), B, K, ldx, N, row0, key_a, key_b, kind, algo, ksplit,
                          partial, s);
    case TRAK_F16:
      return launch_dense(static_cast<const __half*>(x), B, K, ldx, N, row0, key_a, key_b, kind, algo, ksplit,
                          partial, s);
    case TRAK_BF16:
      return launch_dense(static_cast<const __nv_bfloat16*>(x), B, K, ldx, N, row0, key_a, key_b, kind, algo,
                          ksplit, partial, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

int trak_reduce_partial(const float* partial, int64_t S, int64_t B, int64_t N, float* out, int64_t ldo,
                        void* stream) {
  if (B <= 0 || N <= 0 || S <= 0) return static_cast<int>(cudaErrorInvalidValue);
  reduce_partial_kernel<<<grid_for(B * N, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(partial, S, B, N,
                                                                                           out, ldo);
  return last_error();
}

int trak_sjlt_gather(const void* xT, int dtype, int64_t K, int64_t B, const int64_t* col_ptr,
                     const int64_t* packed, int64_t N, float scale, float* out, int64_t ldo, int bt,
                     void* stream) {
  if (B <= 0 || K <= 0 || N <= 0) return static_cast<int>(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case TRAK_F32:
      return launch_sjlt(static_cast<const float*>(xT), K, B, col_ptr, packed, N, scale, out, ldo, bt, s);
    case TRAK_F16:
      return launch_sjlt(static_cast<const __half*>(xT), K, B, col_ptr, packed, N, scale, out, ldo, bt, s);
    case TRAK_BF16:
      return launch_sjlt(static_cast<const __nv_bfloat16*>(xT), K, B, col_ptr, packed, N, scale, out, ldo, bt, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

int trak_dense_block(int64_t row0, int64_t rows, int64_t N, uint32_t key_a, uint32_t key_b, int kind, float* out,
                     void* stream) {
  if (rows <= 0 || N <= 0 || row0 < 0) return static_cast<int>(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned grid = grid_for(rows * N, 256);
  if (kind == TRAK_RADEMACHER)
    dense_block_kernel<TRAK_RADEMACHER><<<grid, 256, 0, s>>>(row0, rows, N, key_a, key_b, out);
  else if (kind == TRAK_NORMAL)
    dense_block_kernel<TRAK_NORMAL><<<grid, 256, 0, s>>>(row0, rows, N, key_a, key_b, out);
  else
    return static_cast<int>(cudaErrorInvalidValue);
  return last_error();
}

int trak_hash_words(const int64_t* counters, int64_t n, uint32_t key, int64_t* out, void* stream) {
  if (n <= 0) return 0;
  hash_words_kernel<<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(counters, n, key, out);
  return last_error();
}

int trak_device_cc(void) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return -static_cast<int>(e);
  int major = 0, minor = 0;
  e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) return -static_cast<int>(e);
  return major * 10 + minor;
}

const char* trak_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int trak_kernels_version(void) { return 1; }

}  // extern "C"
