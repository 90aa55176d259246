// Few-row fp32 linear layer for CPU decode and verify forwards (kernel=avx2, specbench/kernels.py).
//
// y[n, O] = x[n, I] @ W[O, I]^T for small n (a decode step, a verify forward over K+1 tokens).
// The weight is packed once into blocks of 8 output columns, wp[O/8][I][8], so that a block is
// one contiguous stream. Each thread takes a contiguous range of blocks and, per block, runs
// the rows of x through it in one pass of up to 8 rows (one AVX2 accumulator per row): the
// weight is read from memory once per forward and every load of it feeds all those rows, so
// the FMAs overlap the stream instead of following it. More than 8 rows take further passes
// over the block while it is still in L1. The blocks are spread over all of torch's threads
// (MKL's sgemv for one row runs on one core; its sgemm for 2..16 rows repacks the weight on
// every call). One row goes through two blocks at a time: two independent FMA chains.
//
// Every output is one fixed-order sum over k = 0..I-1 (one FMA per k into its own lane), the
// same whichever pass its row lands in: a row's result does not depend on n or on the other
// rows (batch-invariant, bit for bit).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int kCols = 8;
constexpr int kMaxRows = 8;

template <int R>
inline void pass(const float* x, int64_t I, const float* w, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < I; k++) {
    const __m256 wk = _mm256_loadu_ps(w + kCols * k);
    for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * I + k), wk, acc[r]);
  }
  for (int r = 0; r < R; r++) {
    if (cols == kCols) {
      _mm256_storeu_ps(y + r * ldy, acc[r]);
    } else {  // the last block of a layer whose width is not a multiple of 8
      alignas(32) float t[kCols];
      _mm256_store_ps(t, acc[r]);
      std::memcpy(y + r * ldy, t, cols * sizeof(float));
    }
  }
}

inline void row_through_two_blocks(const float* x, int64_t I, const float* w0, const float* w1, float* y) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t k = 0; k < I; k++) {
    const __m256 xk = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w0 + kCols * k), a0);
    a1 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w1 + kCols * k), a1);
  }
  _mm256_storeu_ps(y, a0);
  _mm256_storeu_ps(y + kCols, a1);
}

inline void rows_through_block(const float* x, int64_t n, int64_t I, const float* w, float* y, int64_t O,
                               int64_t cols) {
  int64_t r = 0;
  while (r < n) {  // rows split evenly into passes of at most 8 (12 rows: 6 + 6, not 8 + 4)
    const int64_t left = n - r;
    const int64_t passes = (left + kMaxRows - 1) / kMaxRows;
    const int64_t R = (left + passes - 1) / passes;
    const float* xr = x + r * I;
    float* yr = y + r * O;
    switch (R) {
      case 8: pass<8>(xr, I, w, yr, O, cols); break;
      case 7: pass<7>(xr, I, w, yr, O, cols); break;
      case 6: pass<6>(xr, I, w, yr, O, cols); break;
      case 5: pass<5>(xr, I, w, yr, O, cols); break;
      case 4: pass<4>(xr, I, w, yr, O, cols); break;
      case 3: pass<3>(xr, I, w, yr, O, cols); break;
      case 2: pass<2>(xr, I, w, yr, O, cols); break;
      default: pass<1>(xr, I, w, yr, O, cols); break;
    }
    r += R;
  }
}

}  // namespace

// x: [..., I] fp32 (made contiguous here); wp: [ceil(O/8), I, 8] fp32 contiguous (kernels.pack).
// Returns [..., O]: the leading dimensions are rows, so a layer calls it without reshaping.
torch::Tensor few_rows_linear(const torch::Tensor& x_in, const torch::Tensor& wp, int64_t O) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && x_in.device().is_cpu(),
              "few_rows_linear: x must be an fp32 CPU tensor");
  const auto x = x_in.contiguous();
  const int64_t I = x.size(-1);
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == kCols && wp.size(1) == I && wp.is_contiguous() &&
                  wp.scalar_type() == torch::kFloat && wp.size(0) * kCols >= O && (wp.size(0) - 1) * kCols < O,
              "few_rows_linear: wp must be the [ceil(O/8), in, 8] packing of an fp32 [O, in] weight");
  const int64_t n = I ? x.numel() / I : 0, blocks = wp.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = O;
  auto y = torch::empty(sizes, x.options());
  if (n == 0 || O == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wpp = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    if (n == 1)
      for (; b + 1 < b1 && kCols * (b + 2) <= O; b += 2)
        row_through_two_blocks(xp, I, wpp + b * I * kCols, wpp + (b + 1) * I * kCols, yp + kCols * b);
    for (; b < b1; b++)
      rows_through_block(xp, n, I, wpp + b * I * kCols, yp + kCols * b, O, std::min<int64_t>(kCols, O - kCols * b));
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("few_rows_linear", &few_rows_linear, "y = x @ W^T for a few rows, W packed in 8-column blocks");
}
