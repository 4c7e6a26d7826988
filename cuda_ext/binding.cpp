// binding.cpp - torch bindings of kernels.cu (compiled by the host compiler; kernels.cu by nvcc).
//
// Only torch/extension.h is included here (no CUDA header): the CUDA stream comes from Python as an integer
// (torch.cuda.current_stream().cuda_stream) and the caller makes the tensors' device current. This keeps the
// file compilable against any torch build, also the CPU-only one of the development machine.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace {

int dtype_code(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return TRAK_F32;
    case at::kHalf: return TRAK_F16;
    case at::kBFloat16: return TRAK_BF16;
    default: TORCH_CHECK(false, "cuda_ext: input must be float32, float16 or bfloat16, got ", x.scalar_type());
  }
  return -1;
}

void check(int err, const char* what) {
  TORCH_CHECK(err == 0, "cuda_ext: ", what, " failed: ", trak_error_string(err), " (CUDA error ", err, ")");
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "cuda_ext: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 2, "cuda_ext: ", name, " must be 2-D, got ", t.dim(), " dims");
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, "cuda_ext: ", name, " must have unit column stride");
}

}  // namespace

// out (B, N) float32 += x (B, K) @ R[row0 : row0 + K]; returns the number of splits used.
int64_t dense_project(at::Tensor x, at::Tensor out, int64_t row0, int64_t key_a, int64_t key_b,
                      int64_t kind, int64_t algo, int64_t ksplit, int64_t max_partial_bytes, int64_t stream) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "cuda_ext: out must be float32");
  TORCH_CHECK(out.size(0) == x.size(0), "cuda_ext: out has ", out.size(0), " rows, x has ", x.size(0));
  TORCH_CHECK(x.device() == out.device(), "cuda_ext: x and out are on different devices");
  TORCH_CHECK(ksplit > 0 && ksplit % 64 == 0, "cuda_ext: ksplit must be a positive multiple of 64");
  const int64_t B = x.size(0), K = x.size(1), N = out.size(1);
  if (B == 0 || K == 0 || N == 0) return 0;
  const int code = dtype_code(x);
  const int64_t S = (K + ksplit - 1) / ksplit;
  // rows per batch chunk: the partial buffer (S, rows, N) stays under max_partial_bytes (at least one tile)
  const int64_t per_row = S * N * static_cast<int64_t>(sizeof(float));
  int64_t rows = std::max<int64_t>(1, max_partial_bytes / per_row);
  if (rows >= 32) rows -= rows % 32;
  rows = std::max<int64_t>(rows, std::min<int64_t>(B, 32));
  rows = std::min<int64_t>(rows, std::min<int64_t>(B, int64_t(65535) * 32));
  at::Tensor partial = at::empty({S * rows * N}, out.options());
  for (int64_t b0 = 0; b0 < B; b0 += rows) {
    const int64_t bc = std::min(rows, B - b0);
    at::Tensor xb = x.narrow(0, b0, bc);
    at::Tensor ob = out.narrow(0, b0, bc);
    check(trak_dense_partial(xb.data_ptr(), code, bc, K, x.stride(0), N, row0, static_cast<uint32_t>(key_a),
                             static_cast<uint32_t>(key_b), static_cast<int>(kind), static_cast<int>(algo), ksplit,
                             partial.data_ptr<float>(), as_stream(stream)),
          "dense projection kernel");
    check(trak_reduce_partial(partial.data_ptr<float>(), S, bc, N, ob.data_ptr<float>(), out.stride(0),
                              as_stream(stream)),
          "split reduction kernel");
  }
  return S;
}

// out (B, N) float32 = scale * SJLT(x), from xT (K, B) contiguous and the CSR (col_ptr, packed).
void sjlt_project(at::Tensor xT, at::Tensor col_ptr, at::Tensor packed, at::Tensor out,
                  double scale, int64_t bt, int64_t stream) {
  check_rows(xT, "xT");
  check_rows(out, "out");
  TORCH_CHECK(xT.is_contiguous(), "cuda_ext: xT must be contiguous");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "cuda_ext: out must be float32");
  TORCH_CHECK(col_ptr.is_cuda() && packed.is_cuda() && col_ptr.scalar_type() == at::kLong &&
                  packed.scalar_type() == at::kLong && col_ptr.is_contiguous() && packed.is_contiguous(),
              "cuda_ext: col_ptr and packed must be contiguous int64 CUDA tensors");
  const int64_t K = xT.size(0), B = xT.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == B, "cuda_ext: out has ", out.size(0), " rows, x has ", B);
  TORCH_CHECK(col_ptr.numel() == N + 1, "cuda_ext: col_ptr must have proj_dim + 1 entries");
  if (B == 0 || N == 0) return;
  check(trak_sjlt_gather(xT.data_ptr(), dtype_code(xT), K, B, col_ptr.data_ptr<int64_t>(),
                         packed.data_ptr<int64_t>(), N, static_cast<float>(scale), out.data_ptr<float>(),
                         out.stride(0), static_cast<int>(bt), as_stream(stream)),
        "SJLT gather kernel");
}

// out (rows, N) float32 = R[row0 : row0 + rows]
void dense_block(int64_t row0, at::Tensor out, int64_t key_a, int64_t key_b, int64_t kind, int64_t stream) {
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "cuda_ext: out must be contiguous float32");
  if (out.numel() == 0) return;
  check(trak_dense_block(row0, out.size(0), out.size(1), static_cast<uint32_t>(key_a), static_cast<uint32_t>(key_b),
                         static_cast<int>(kind), out.data_ptr<float>(), as_stream(stream)),
        "matrix block kernel");
}

// hash_counter on the GPU: int64 counters -> int64 words in [0, 2**32)
at::Tensor hash_words(at::Tensor counters, int64_t key, int64_t stream) {
  TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kLong, "cuda_ext: counters must be int64 CUDA");
  at::Tensor c = counters.contiguous();
  at::Tensor out = at::empty_like(c);
  check(trak_hash_words(c.data_ptr<int64_t>(), c.numel(), static_cast<uint32_t>(key), out.data_ptr<int64_t>(),
                        as_stream(stream)),
        "hash kernel");
  return out;
}

int64_t device_cc() { return trak_device_cc(); }

int64_t kernels_version() { return trak_kernels_version(); }

int64_t ksplit_rows() { return TRAK_KSPLIT; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "trakflow projection kernels (see cuda_ext/kernels.cu)";
  m.def("dense_project", &dense_project, "out += x @ R[row0:row0+K] (split-K, deterministic)");
  m.def("sjlt_project", &sjlt_project, "out = scale * SJLT(x) from the transposed input and the CSR");
  m.def("dense_block", &dense_block, "a block of rows of the dense matrix");
  m.def("hash_words", &hash_words, "hash_counter on the GPU");
  m.def("device_cc", &device_cc, "compute capability of the current device (major*10+minor)");
  m.def("kernels_version", &kernels_version, "version of kernels.cu");
  m.def("ksplit_rows", &ksplit_rows, "rows per split of the dense kernels");
}
