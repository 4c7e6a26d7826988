// kernels.h - the C interface between kernels.cu (nvcc, no torch headers) and binding.cpp (torch).
//
// Every launcher returns 0 on success or a CUDA error code (see trak_error_string); pointers are device
// pointers, sizes are 64-bit, `stream` is a cudaStream_t passed as void* (0 = the legacy default stream).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// input element types
#define TRAK_F32 0
#define TRAK_F16 1
#define TRAK_BF16 2

// matrix kinds
#define TRAK_RADEMACHER 0
#define TRAK_NORMAL 1

// dense algorithms
#define TRAK_ALGO_FMA 0  // float32 FMA on CUDA cores, any GPU, any kind
#define TRAK_ALGO_TC1 1  // tensor cores, x rounded to bf16 (Rademacher, sm_80+)
#define TRAK_ALGO_TC2 2  // tensor cores, x = two bf16 terms (~16 mantissa bits)
#define TRAK_ALGO_TC3 3  // tensor cores, x = three bf16 terms (float32 accuracy)

// rows of the matrix (input coordinates) per split of the dense kernels: a constant, so that the
// summation order, and hence the result, depends on the shapes only (never on the GPU's SM count)
#define TRAK_KSPLIT 32768

// Dense projection, first pass: partial[s, b, n] = sum over coordinates k in split s of
// x[b, k] * R(row0 + k, n), for b < B, n < N, s < ceil(K / ksplit). x is (B, K) with row stride ldx.
// R is the matrix of counter_rng: Rademacher (key_a = sign-word key) or normal (key_a, key_b = u1, u2 keys).
int trak_dense_partial(const void* x, int dtype, int64_t B, int64_t K, int64_t ldx, int64_t N, int64_t row0,
                       uint32_t key_a, uint32_t key_b, int kind, int algo, int64_t ksplit, float* partial,
                       void* stream);

// Dense projection, second pass: out[b, n] += sum_{s = 0..S-1} partial[s, b, n] (in this order).
int trak_reduce_partial(const float* partial, int64_t S, int64_t B, int64_t N, float* out, int64_t ldo,
                        void* stream);

// SJLT: out[b, j] = scale * sum over entries e of column j (in order) of (+/-) xT[i_e, b], where
// xT is the transposed input (K, B) (row stride ldx = B), col_ptr (N + 1) and packed (nnz) the CSR of the
// transposed sign matrix: packed = i * 2 + (sign < 0), sorted by (column, i). Batch tile `bt` in
// {1, 2, 4, 8, 16, 32} lanes.
int trak_sjlt_gather(const void* xT, int dtype, int64_t K, int64_t B, const int64_t* col_ptr,
                     const int64_t* packed, int64_t N, float scale, float* out, int64_t ldo, int bt,
                     void* stream);

// The matrix itself: out[r, n] = R(row0 + r, n) for r < rows, n < N (tests, materialized baselines).
int trak_dense_block(int64_t row0, int64_t rows, int64_t N, uint32_t key_a, uint32_t key_b, int kind,
                     float* out, void* stream);

// out[i] = hash_counter(counters[i], key) (tests: the device hash against the Python definition).
int trak_hash_words(const int64_t* counters, int64_t n, uint32_t key, int64_t* out, void* stream);

// Compute capability of the current device (major * 10 + minor), or -(CUDA error code).
int trak_device_cc(void);

const char* trak_error_string(int code);

int trak_kernels_version(void);

#ifdef __cplusplus
}
#endif
