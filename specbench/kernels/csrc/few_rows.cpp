// Few-row fp32 linear layer for CPU decode and verify forwards (kernel=native, specbench/kernels/native.py).
//
// y[n, O] = x[n, I] @ W[O, I]^T for small n (a decode step, a verify forward over K+1 tokens).
// The weight is packed once into panels of c output columns, wp[O/c][I][c], so that a panel is
// one contiguous stream (c = 8, one AVX2 vector; 48, three AVX-512 vectors, where the CPU has it). The blocks are spread over all of torch's threads (MKL's sgemv for one
// row runs on one core; its sgemm for 2..16 rows repacks the weight on every call), and each
// thread runs the rows of x through its blocks in register tiles of R rows x C blocks: per k,
// C loads of the weight and R broadcasts of x feed R*C FMAs into R*C vector accumulators, so the
// weight is read from memory once per forward and every load of it feeds several rows. One row
// goes through 4 blocks at a time (4 independent FMA chains; a decode step is bound by the
// stream), and so do 2 or 3 rows (8 or 12 accumulators); 4 or more rows through 3 blocks in
// passes of at most 4 rows (12 accumulators, the most that 16 registers hold beside the loads:
// enough independent FMAs to hide their latency); with AVX-512's 32 registers, up to 9 rows in
// one pass (27 accumulators).
// Every loop over registers is fully unrolled: a rolled one kept the accumulators in memory (a
// store per FMA) and ran at half the FMA rate.
//
// Every output is one fixed-order sum over k = 0..I-1 (one FMA per k into its own lane, partial
// sums kept in fp32 between chunks), the same whichever tile or pass its row lands in: a row's
// result does not depend on n or on the other rows (batch-invariant, bit for bit).
//
// Below it, the other steps of the fused Llama layer (native._fused_llama_forward): RMSNorm,
// RoPE in place, and the attention of a decode step over the KV cache.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kCols = 8;
constexpr int kGroup = 16;  // rows whose partial sums are kept while the blocks stream by
constexpr int kChunk = 48;  // k per step when the rows take several passes (64: ~3% slower at 5-8 rows)
constexpr int64_t kSlab = 256;  // rows per sweep over the weight
constexpr int kAhead = 16;  // k ahead that a single or first pass prefetches (512 bytes per block)

// A hint for the line `floats` past p, non-temporal (the weights are read once). Past a block's
// end it lands on the next block's start, past the packing's end on nothing: a prefetch never
// faults (the address is computed as an integer, not as a pointer past the tensor).
inline void prefetch_nta(const float* p, int64_t floats) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + floats * sizeof(float)), _MM_HINT_NTA);
}

// Whether the tiles prefetch the weights in software: on AMD cores (the scheme below was tuned on
// them), not on an Intel CPU, where (a 2-core Xeon) the non-temporal prefetches doubled a whole
// forward at 2-8 rows with either tile width (docs/benchmarks/2026-11-27-methods-2026-cpu.md).
bool cpu_is_intel() {
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
}

inline bool software_prefetch() { return !cpu_is_intel(); }

// The tiles, for AVX2 (blocks of 8 columns, each its own stream) and for AVX-512 (panels of 48
// columns: three 16-column vectors per k, side by side), from linear_tiles.h. A packing's width
// says which runs (extension.pack makes 48-column panels where the CPU has AVX-512F). Both compute
// every output as the same chain of FMAs in k order, so the same bits: the width changes how many
// columns one instruction takes, not the sums.
struct Ymm {
  using T = __m256;
  static constexpr int W = 8, S = 1;
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T load(const float* p) { return _mm256_load_ps(p); }
  static inline T loadu(const float* p) { return _mm256_loadu_ps(p); }
  static inline T set1(const float* p) { return _mm256_broadcast_ss(p); }
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline void store(float* p, T v) { _mm256_store_ps(p, v); }
};

namespace ymm {
using V = Ymm;
constexpr int kOneC = 4;      // one row through 4 blocks (4 independent FMA chains: a decode step is bound by the stream)
constexpr int kFewC = 4;      // 2 or 3 rows: 8 or 12 accumulators (3 blocks: ~0.6-0.9 ms slower per forward)
constexpr int kManyC = 3;     // 4 or more rows: 3 blocks x 4 rows (12 accumulators, the most that 16
constexpr int kManyRmax = 4;  // registers hold beside the loads: enough independent FMAs to hide their latency)
constexpr int64_t kNoAheadFrom = kGroup + 1;  // a single pass always prefetches (2 or more rows)
#include "linear_tiles.h"
}  // namespace ymm

#pragma GCC push_options
#pragma GCC target("avx512f")
struct Zmm {
  using T = __m512;
  static constexpr int W = 16, S = 3;
  static inline T zero() { return _mm512_setzero_ps(); }
  static inline T load(const float* p) { return _mm512_load_ps(p); }
  static inline T loadu(const float* p) { return _mm512_loadu_ps(p); }
  static inline T set1(const float* p) { return _mm512_set1_ps(*p); }
  static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline void store(float* p, T v) { _mm512_store_ps(p, v); }
};

// With 32 registers, 4 to 8 rows go through 3 blocks of 16 columns in one pass (24 accumulators),
// each weight vector loaded once for all of them, where AVX2 takes two passes of 4 rows x 3 blocks
// of 8. Measured on a 2-core Zen 4 (the model's 121 linears back to back, interleaved, bits
// equal), with blocks of 16 packed like AVX2's (each block its own stream): 0.95x AVX2's time at
// 4 rows, 0.90x at 8, equal at 1 and 2. Packed as 48-column panels, every tile (1 to 8 rows)
// takes one panel, and each thread reads its weights as one stream: against the 16-column blocks,
// 0.82-0.92x the time at 1 row, 0.72-0.78x at 2, 0.79x at 4 and 0.84x at 8 in a quick host state
// (55 GB/s), 1.00 / 0.93 / 0.94 / 0.89x in a slow one (35 GB/s). A single pass of 4 or more rows
// is left to the hardware prefetcher (software prefetch there: 1.05-1.08x the time at 4 rows).
// Up to 9 rows take one pass (27 accumulators, 3 weight vectors, x broadcast from memory: no
// spill): 9 rows in 0.77-0.83x the time of two passes (5 + 4), 8 and 10 rows unchanged.
namespace zmm {
using V = Zmm;
constexpr int kOneC = 3;
constexpr int kFewC = 3;
constexpr int kManyC = 3;
constexpr int kManyRmax = 9;
constexpr int64_t kNoAheadFrom = 4;
#include "linear_tiles.h"
}  // namespace zmm
#pragma GCC pop_options

bool cpu_has_avx512() { return __builtin_cpu_supports("avx512f"); }

}  // namespace

// x: [..., I] fp32 (made contiguous here); wp: [ceil(O/c), I, c] fp32 contiguous (extension.pack).
// Returns [..., O]: the leading dimensions are rows, so a layer calls it without reshaping.
torch::Tensor few_rows_linear(const torch::Tensor& x_in, const torch::Tensor& wp, int64_t O) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && x_in.device().is_cpu(),
              "few_rows_linear: x must be an fp32 CPU tensor");
  const auto x = x_in.contiguous();
  const int64_t I = x.size(-1);
  const int64_t cols = wp.dim() == 3 ? wp.size(2) : 0;
  TORCH_CHECK((cols == 8 || cols == 48) && wp.size(1) == I && wp.is_contiguous() &&
                  wp.scalar_type() == torch::kFloat && wp.size(0) * cols >= O && (wp.size(0) - 1) * cols < O,
              "few_rows_linear: wp must be the [ceil(O/c), in, c] packing (c = 8 or 48) of an fp32 [O, in] weight");
  TORCH_CHECK(cols == 8 || cpu_has_avx512(), "few_rows_linear: a 48-column packing needs AVX-512F, which this "
              "CPU lacks; pack with cols=8");
  const int64_t n = I ? x.numel() / I : 0, blocks = wp.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = O;
  auto y = torch::empty(sizes, x.options());
  if (n == 0 || O == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wpp = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Many rows (a prefill) go kSlab at a time, so the rows that each thread reruns against every
  // group of blocks stay in cache; the weight is streamed once per slab.
  for (int64_t s = 0; s < n; s += kSlab) {
    const int64_t m = std::min(kSlab, n - s);
    const float* xs = xp + s * I;
    float* ys = yp + s * O;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      if (cols == 48)
        zmm::rows_range(xs, m, I, wpp, ys, O, b0, b1);
      else
        ymm::rows_range(xs, m, I, wpp, ys, O, b0, b1);
    });
  }
  return y;
}

// The small steps of a fused Llama layer (native._fused_llama_forward): one call each instead of
// the several torch ops (~3 us apiece at decode sizes) that Hugging Face's modules run.

// RMSNorm over the last dimension: y = w * (x * (1 / sqrt(mean(x^2) + eps))), fp32 throughout, as
// LlamaRMSNorm in fp32 (only the order of the sum of squares differs).
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && x_in.device().is_cpu() &&
                  w_in.scalar_type() == torch::kFloat && w_in.dim() == 1 && w_in.size(0) == x_in.size(-1),
              "rms_norm: x must be fp32 [..., D] and w fp32 [D]");
  const auto x = x_in.contiguous();
  const auto w = w_in.contiguous();
  auto y = torch::empty_like(x);
  const int64_t D = x.size(-1), n = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* xr = xp + r * D;
      float* yr = yp + r * D;
      __m256 acc = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + kCols <= D; k += kCols) {
        const __m256 v = _mm256_loadu_ps(xr + k);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      alignas(32) float t[kCols];
      _mm256_store_ps(t, acc);
      float ss = 0.f;
      for (int i = 0; i < kCols; i++) ss += t[i];
      for (; k < D; k++) ss += xr[k] * xr[k];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      for (k = 0; k < D; k++) yr[k] = wp[k] * (xr[k] * inv);
    }
  });
  return y;
}

// Rotary embedding in place on the first `heads` heads of x [B, n, H, d] (d contiguous), with
// cos, sin [B, n, d] (or [1, n, d], shared by the batch): x * cos + rotate_half(x) * sin, the same products and sums as Hugging
// Face's apply_rotary_pos_emb (the extension is built with -ffp-contract=off: no FMA here).
void rope_(torch::Tensor x, const torch::Tensor& cos_in, const torch::Tensor& sin_in, int64_t heads) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == torch::kFloat && x.stride(3) == 1 && heads <= x.size(2) &&
                  x.size(3) % 2 == 0,
              "rope_: x must be fp32 [B, n, H, d] with d contiguous and even");
  const auto cos = cos_in.to(torch::kFloat).contiguous(), sin = sin_in.to(torch::kFloat).contiguous();
  const int64_t B = x.size(0), n = x.size(1), d = x.size(3), half = d / 2;
  TORCH_CHECK(cos.numel() == sin.numel() && (cos.numel() == B * n * d || cos.numel() == n * d),
              "rope_: cos and sin must be [B, n, d] or [1, n, d]");
  const int64_t cb = cos.numel() == n * d ? 0 : n * d;  // one position row shared by the batch
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < n; t++) {
      const float* c = cp + b * cb + t * d;
      const float* s = sp + b * cb + t * d;
      for (int64_t h = 0; h < heads; h++) {
        float* v = xp + b * x.stride(0) + t * x.stride(1) + h * x.stride(2);
        for (int64_t i = 0; i < half; i++) {
          const float lo = v[i], hi = v[i + half];
          v[i] = lo * c[i] + (-hi) * s[i];
          v[i + half] = hi * c[i + half] + lo * s[i + half];
        }
      }
    }
}

namespace {

// e^x for 8 floats (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, 2^n through the
// exponent bits; about 1 ulp). Inputs below -87.3 give 0 (an additive mask's -3.4e38 included).
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365f);
  const __m256 zero_out = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3762f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero_out, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The dot products of q with 8 keys (rows ks floats apart), d a multiple of 8: the 8 partial
// vectors reduced together (two rounds of hadd, then the two 128-bit halves), in key order.
inline __m256 dots8(const float* q, const float* k, int64_t ks, int64_t d) {
  __m256 a[8];
#pragma GCC unroll 8
  for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; e += kCols) {
    const __m256 qe = _mm256_loadu_ps(q + e);
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k + u * ks + e), a[u]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax(__m256 v) {
  alignas(32) float t[kCols];
  _mm256_store_ps(t, v);
  float m = t[0];
  for (int i = 1; i < kCols; i++) m = std::max(m, t[i]);
  return m;
}

inline float hsum(__m256 v) {
  alignas(32) float t[kCols];
  _mm256_store_ps(t, v);
  float s = 0.f;
  for (int i = 0; i < kCols; i++) s += t[i];
  return s;
}

}  // namespace

// Attention of a decode or verify forward: n queries per row against the row's L cached keys,
// heads grouped over the KV heads (GQA: query head h reads KV head h / (H / Hkv)), without
// repeating the cache. q [B, H, n, d], k and v [B, Hkv, L, d] (any strides, d contiguous);
// mask: additive [B or 1, 1, n, L], or empty for causal (query i sees keys up to L - n + i).
// Returns [B, n, H, d]. Scores in fp32, softmax with its max, in two passes over the cache.
//
// A task takes a few of the g * n queries that read one KV head (the g query heads of its group,
// n queries each) and walks the cache in blocks of kBlock keys, every query of the task through a
// block before the next: a block of K (then of V) is read from memory or L2 once per task and
// from L1 by each query (one query per task read the whole cache once per query: at 5-8 queries
// per row, bound by L2). Each query's arithmetic is the same as on its own: scores 8 keys at a
// time from key 0 (then single keys), the max, e^(s - max) and the sum in that order, and each
// output lane one sum over the keys in order (its partial sums kept between blocks): a query's
// output does not depend on n, on the other queries or on how they are split into tasks.
namespace {
constexpr int64_t kBlock = 64;  // keys per block: 16 KB of K or V at d = 64
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& mask_in, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == torch::kFloat &&
                  k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat && q.stride(3) == 1 &&
                  k.stride(3) == 1 && v.stride(3) == 1 && q.size(3) == k.size(3) && k.sizes() == v.sizes() &&
                  q.size(0) == k.size(0) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "attention: q [B, H, n, d], k and v [B, Hkv, L, d], fp32, d contiguous, H a multiple of Hkv");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), d = q.size(3), Hkv = k.size(1), L = k.size(2);
  const int64_t g = H / Hkv;
  const bool masked = mask_in.numel() > 0;
  torch::Tensor mask;
  int64_t mb = 0;
  if (masked) {
    mask = mask_in.to(torch::kFloat).contiguous();
    TORCH_CHECK(mask.dim() == 4 && mask.size(1) == 1 && mask.size(2) == n && mask.size(3) == L &&
                    (mask.size(0) == B || mask.size(0) == 1),
                "attention: mask must be additive [B, 1, n, L]");
    mb = mask.size(0) == 1 ? 0 : n * L;
  }
  auto out = torch::empty({B, n, H, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = masked ? mask.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // queries per task: about 4 tasks per thread (load balance), at most a KV head's g * n
  const int64_t Q = g * n;
  const int64_t per = std::max<int64_t>(1, std::min<int64_t>(
      Q, (B * H * n + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads())));
  const int64_t chunks = (Q + per - 1) / per;
  at::parallel_for(0, B * Hkv * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(per * L);
    std::vector<float> acc(per * std::max<int64_t>(d, 8 * kCols));
    std::vector<int64_t> seen(per), full(per);
    std::vector<float> inv(per);
    std::vector<const float*> qv(per);
    std::vector<float*> ov(per);
    std::vector<const float*> mv(per);
    for (int64_t t = t0; t < t1; t++) {
      const int64_t b = t / (Hkv * chunks), j = (t / chunks) % Hkv, c = t % chunks;
      const int64_t r0 = c * per, nr = std::min(per, Q - r0);
      const float* kb = kp + b * k.stride(0) + j * k.stride(1);
      const float* vb = vp + b * v.stride(0) + j * v.stride(1);
      const int64_t ks = k.stride(2), vs = v.stride(2);
      int64_t most = 0;
      for (int64_t r = 0; r < nr; r++) {  // query r0 + r of the group: head j * g + (r0 + r) / n, query (r0 + r) % n
        const int64_t h = j * g + (r0 + r) / n, i = (r0 + r) % n;
        qv[r] = qp + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        ov[r] = op + ((b * n + i) * H + h) * d;
        mv[r] = masked ? mp + b * mb + i * L : nullptr;
        seen[r] = masked ? L : L - n + i + 1;
        full[r] = d % kCols == 0 ? seen[r] / kCols * kCols : 0;  // keys scored 8 at a time
        most = std::max(most, seen[r]);
      }
      // pass 1: scores, a block of K through every query, then each query's last keys one by one
      for (int64_t l0 = 0; l0 < most; l0 += kBlock) {
        for (int64_t r = 0; r < nr; r++) {
          float* sr = s.data() + r * L;
          const int64_t l1 = std::min(l0 + kBlock, full[r]);
          for (int64_t l = l0; l < l1; l += kCols) {
            __m256 sv = _mm256_mul_ps(dots8(qv[r], kb + l * ks, ks, d), _mm256_set1_ps(sc));
            if (masked) sv = _mm256_add_ps(sv, _mm256_loadu_ps(mv[r] + l));
            _mm256_storeu_ps(sr + l, sv);
          }
        }
      }
      for (int64_t r = 0; r < nr; r++) {
        float* sr = s.data() + r * L;
        float mx = -INFINITY;
        for (int64_t l = 0; l < full[r]; l += kCols) mx = std::max(mx, hmax(_mm256_loadu_ps(sr + l)));
        for (int64_t l = full[r]; l < seen[r]; l++) {
          const float* kr = kb + l * ks;
          __m256 a = _mm256_setzero_ps();
          int64_t e = 0;
          for (; e + kCols <= d; e += kCols) a = _mm256_fmadd_ps(_mm256_loadu_ps(qv[r] + e), _mm256_loadu_ps(kr + e), a);
          float dot = hsum(a);
          for (; e < d; e++) dot += qv[r][e] * kr[e];
          sr[l] = dot * sc + (masked ? mv[r][l] : 0.f);
          mx = std::max(mx, sr[l]);
        }
        if (mx == -INFINITY) mx = 0.f;  // nothing visible (cannot happen for a real row): zeros out
        const __m256 mxv = _mm256_set1_ps(mx);
        __m256 sumv = _mm256_setzero_ps();
        int64_t l = 0;
        for (; l + kCols <= seen[r]; l += kCols) {
          const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + l), mxv));
          _mm256_storeu_ps(sr + l, p);
          sumv = _mm256_add_ps(sumv, p);
        }
        float sum = hsum(sumv);
        for (; l < seen[r]; l++) {
          sr[l] = std::exp(sr[l] - mx);
          sum += sr[l];
        }
        inv[r] = sum > 0.f ? 1.f / sum : 0.f;
      }
      // pass 2: p . V, a block of V through every query; 64 dimensions at a time in registers
      int64_t e0 = 0;
      for (; e0 + 8 * kCols <= d; e0 += 8 * kCols) {
        for (int64_t l0 = 0; l0 < most; l0 += kBlock) {
          for (int64_t r = 0; r < nr; r++) {
            const int64_t l1 = std::min(l0 + kBlock, seen[r]);
            if (l0 >= l1) continue;
            const float* sr = s.data() + r * L;
            float* ar = acc.data() + r * 8 * kCols;
            __m256 a[8];
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) a[u] = l0 ? _mm256_loadu_ps(ar + u * kCols) : _mm256_setzero_ps();
            for (int64_t l = l0; l < l1; l++) {
              const float* vr = vb + l * vs + e0;
              const __m256 p = _mm256_set1_ps(sr[l]);
#pragma GCC unroll 8
              for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + u * kCols), a[u]);
            }
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(ar + u * kCols, a[u]);
          }
        }
        for (int64_t r = 0; r < nr; r++) {
          const float* ar = acc.data() + r * 8 * kCols;
#pragma GCC unroll 8
          for (int u = 0; u < 8; u++)
            _mm256_storeu_ps(ov[r] + e0 + u * kCols, _mm256_mul_ps(_mm256_loadu_ps(ar + u * kCols), _mm256_set1_ps(inv[r])));
        }
      }
      if (e0 < d) {  // head sizes that are not a multiple of 64
        for (int64_t r = 0; r < nr; r++) {
          const float* sr = s.data() + r * L;
          float* ar = acc.data() + r * std::max<int64_t>(d, 8 * kCols);
          std::fill(ar, ar + d, 0.f);
          for (int64_t l = 0; l < seen[r]; l++)
            for (int64_t e = e0; e < d; e++) ar[e] += sr[l] * vb[l * vs + e];
          for (int64_t e = e0; e < d; e++) ov[r][e] = ar[e] * inv[r];
        }
      }
    }
  });
  return out;
}

// silu(gate) * up for the fused MLP: gu [..., 2F] holds gate | up (one kernel call made both);
// returns [..., F]. silu(x) = x / (1 + e^-x), e^x as in the attention (about 1 ulp).
torch::Tensor silu_mul(const torch::Tensor& gu_in) {
  TORCH_CHECK(gu_in.dim() >= 1 && gu_in.scalar_type() == torch::kFloat && gu_in.size(-1) % 2 == 0,
              "silu_mul: gu must be fp32 [..., 2F]");
  const auto gu = gu_in.contiguous();
  const int64_t F = gu.size(-1) / 2, n = F ? gu.numel() / (2 * F) : 0;
  auto sizes = gu.sizes().vec();
  sizes.back() = F;
  auto y = torch::empty(sizes, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (int64_t r = r0; r < r1; r++) {
      const float* g = gp + r * 2 * F;
      const float* u = g + F;
      float* o = yp + r * F;
      int64_t i = 0;
      for (; i + kCols <= F; i += kCols) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
      }
      for (; i < F; i++) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

// A fused Llama layer's two halves, one call each (native._fused_llama_forward): the same kernel
// calls in the same order as the Python composition of the calls above (fused_qkv, the cache
// update, attention, o_proj and its residual; fused_mlp), so the same bits, without the ~20 torch
// ops and Python calls a layer made between them (~2-3 us apiece here: about as much as the
// layer's attention at one new token).
//
// y += x elementwise (y contiguous, x any layout of y's shape): x + y, the same sums as torch's add
// (a TensorIterator's add_ costs ~3 us of set-up at these sizes).
torch::Tensor add_residual(torch::Tensor y, const torch::Tensor& x_in) {
  const auto x = x_in.contiguous();
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == torch::kFloat, "add_residual: x must match y");
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0, N = y.numel(); i < N; i++) yp[i] = xp[i] + yp[i];
  return y;
}

// attn_block: x [B, n, D] -> x + o_proj(attention(RoPE(q), RoPE(k), v)), q|k|v = RMSNorm(x) W_qkv^T.
// The new keys and values are written into the cache's buffers kbuf, vbuf [B, Hkv, cap, d]
// (d contiguous) at slots [off + L, off + L + n), and the attention reads slots [off, off + L + n).
torch::Tensor attn_block(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, const torch::Tensor& qkv_w,
                         int64_t nq, int64_t nkv, int64_t d, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor kbuf, torch::Tensor vbuf, int64_t off, int64_t L, const torch::Tensor& mask,
                         double scale, const torch::Tensor& o_w) {
  TORCH_CHECK(x.dim() == 3 && kbuf.dim() == 4 && vbuf.sizes() == kbuf.sizes() && kbuf.size(0) == x.size(0) &&
                  kbuf.size(1) == nkv && kbuf.size(3) == d && kbuf.stride(3) == 1 && vbuf.stride(3) == 1 &&
                  kbuf.scalar_type() == torch::kFloat && vbuf.scalar_type() == torch::kFloat && off >= 0 &&
                  L >= 0 && off + L + x.size(1) <= kbuf.size(2),
              "attn_block: x [B, n, D]; kbuf, vbuf fp32 [B, Hkv, cap, d] with room for n slots after off + L");
  const int64_t B = x.size(0), n = x.size(1), H = nq + 2 * nkv;
  auto qkv = few_rows_linear(rms_norm(x, norm_w, eps), qkv_w, H * d).view({B, n, H, d});
  rope_(qkv, cos, sin, nq + nkv);
  const float* src = qkv.data_ptr<float>();
  float* kp = kbuf.data_ptr<float>();
  float* vp = vbuf.data_ptr<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t j = 0; j < nkv; j++)
      for (int64_t t = 0; t < n; t++) {
        const float* row = src + ((b * n + t) * H + nq + j) * d;
        const int64_t slot = off + L + t;
        std::memcpy(kp + b * kbuf.stride(0) + j * kbuf.stride(1) + slot * kbuf.stride(2), row, d * sizeof(float));
        std::memcpy(vp + b * vbuf.stride(0) + j * vbuf.stride(1) + slot * vbuf.stride(2), row + nkv * d,
                    d * sizeof(float));
      }
  const auto o = attention(qkv.narrow(2, 0, nq).transpose(1, 2), kbuf.narrow(2, off, L + n),
                           vbuf.narrow(2, off, L + n), mask, scale);
  return add_residual(few_rows_linear(o.view({B, n, nq * d}), o_w, x.size(2)), x);
}

// mlp_block: x [B, n, D] -> x + down(silu(gate) * up), gate|up = RMSNorm(x) W_gate_up^T.
torch::Tensor mlp_block(const torch::Tensor& x, const torch::Tensor& norm_w, double eps,
                        const torch::Tensor& gate_up_w, int64_t width, const torch::Tensor& down_w) {
  return add_residual(
      few_rows_linear(silu_mul(few_rows_linear(rms_norm(x, norm_w, eps), gate_up_w, 2 * width)), down_w, x.size(-1)),
      x);
}

// In every cache tensor of `caches` (a layer's keys or values, [B, H, S, d], d contiguous), slot
// src[i] of row rows[i] moves to slot dst[i] for all heads, i = 0, 1, ...: a tree's accepted path
// to right behind its row's prefix (kv.RaggedCache.commit), one call for all layers where torch
// takes two indexing ops per layer (~5-10 us apiece on caches left cold by the forward). Within a
// row the moves come in path order, dst[i] <= src[i] and both ascending, so none overwrites a slot
// a later one reads.
void move_slots(const std::vector<torch::Tensor>& caches, const torch::Tensor& rows_in, const torch::Tensor& src_in,
                const torch::Tensor& dst_in) {
  const auto rows = rows_in.contiguous(), src = src_in.contiguous(), dst = dst_in.contiguous();
  TORCH_CHECK(rows.scalar_type() == torch::kLong && src.scalar_type() == torch::kLong &&
                  dst.scalar_type() == torch::kLong && src.numel() == rows.numel() && dst.numel() == rows.numel(),
              "move_slots: rows, src, dst must be int64 of one length");
  const int64_t m = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  for (const auto& t : caches) {
    TORCH_CHECK(t.dim() == 4 && t.scalar_type() == torch::kFloat && t.device().is_cpu() && t.stride(3) == 1,
                "move_slots: each cache tensor must be fp32 [B, H, S, d] on the CPU, d contiguous");
    for (int64_t i = 0; i < m; i++)
      TORCH_CHECK(r[i] >= 0 && r[i] < t.size(0) && s[i] >= 0 && s[i] < t.size(2) && d[i] >= 0 && d[i] < t.size(2),
                  "move_slots: a row or slot out of range");
    float* p = t.data_ptr<float>();
    const int64_t H = t.size(1), D = t.size(3);
    for (int64_t i = 0; i < m; i++)
      for (int64_t h = 0; h < H; h++) {
        float* base = p + r[i] * t.stride(0) + h * t.stride(1);
        std::memmove(base + d[i] * t.stride(2), base + s[i] * t.stride(2), D * sizeof(float));
      }
  }
}

// A model whose decoder layers all run fused, as one call per decode or verify forward
// (native._fused_model_forward): every layer's attn_block then mlp_block, the same calls in the
// same order as the Python loop over them made (the same bits), without the ~30 us a layer that
// loop spent reaching the weights through the modules and checking that they had not changed
// once the weight stream had left the caches cold.
//
// The check is this object's own (state()): the (dict, key, object) links through which the
// modules reach each weight (model.layers, each layer, its submodules, their parameters and their
// forward), each still in place, and each tensor among them still at the address and version it
// had when packed; the layers' hook dicts still empty. Any change there (a parameter reassigned or
// loaded in place, a layer replaced, a hook added) tells the caller to rebuild or to take Hugging
// Face's loop. Runs under the GIL (it reads the dicts), as every call from Python here does.
class FusedStack {
 public:
  // links: (dict, key, object, is_tensor); empties: dicts that must stay empty; per layer,
  // weights (rms weight 1, packed q|k|v, packed o_proj, rms weight 2, packed gate|up, packed
  // down_proj), floats (eps 1, eps 2, attention scale), ints (query heads, KV heads, head size,
  // MLP width).
  FusedStack(const py::list& links, const py::list& empties, std::vector<torch::Tensor> weights,
             std::vector<double> floats, std::vector<int64_t> ints)
      : weights_(std::move(weights)), floats_(std::move(floats)), ints_(std::move(ints)) {
    const size_t layers = weights_.size() / 6;
    TORCH_CHECK(weights_.size() == 6 * layers && floats_.size() == 3 * layers && ints_.size() == 4 * layers,
                "FusedStack: 6 weights, 3 floats and 4 ints per layer");
    for (const auto& item : links) {
      const auto t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 4 && PyDict_Check(t[0].ptr()), "FusedStack: links are (dict, key, object, is_tensor)");
      Link l{t[0].cast<py::object>(), t[1].cast<py::object>(), t[2].cast<py::object>(), t[3].cast<bool>(), nullptr, 0,
             torch::Tensor(), nullptr};
      if (l.tensor) {
        TORCH_CHECK(THPVariable_Check(l.obj.ptr()), "FusedStack: a link marked as a tensor is not one");
        const auto& w = THPVariable_Unpack(l.obj.ptr());
        l.ptr = w.data_ptr();
        l.version = w.is_inference() ? 0 : w._version();
        l.held = w;  // keeps the impl prefetched below alive whatever happens to the parameter
        l.storage = w.storage().unsafeGetStorageImpl();
      }
      links_.push_back(std::move(l));
    }
    for (const auto& d : empties) {
      TORCH_CHECK(PyDict_Check(d.ptr()), "FusedStack: empties are dicts");
      empties_.push_back(d.cast<py::object>());
    }
  }

  // 0: as built, and runnable; 1: something it was built from changed (rebuild it); 2: a layer
  // has a hook (run Hugging Face's loop).
  int state() const {
    // Everything here sits in memory the forward's weight stream left cold (~350 us one by one,
    // ~35 us warm): the addresses known from the build are asked for first, all at once, then
    // the dicts' tables, then each link is read.
    for (const auto& l : links_) {
      __builtin_prefetch(l.dict.ptr());
      __builtin_prefetch(l.obj.ptr());
      if (l.tensor) {
        __builtin_prefetch(l.held.unsafeGetTensorImpl());
        __builtin_prefetch(l.storage);
      }
    }
    for (const auto& l : links_) {
      const char* keys = reinterpret_cast<const char*>(reinterpret_cast<PyDictObject*>(l.dict.ptr())->ma_keys);
      for (int i = 0; i < 3; i++) __builtin_prefetch(keys + 64 * i);  // a module's dicts: a few entries
      if (l.tensor)  // its version counter (a prefetch is only a hint: it never faults)
        __builtin_prefetch(*reinterpret_cast<void* const*>(&l.held.unsafeGetTensorImpl()->version_counter()));
    }
    for (const auto& l : links_) {
      PyObject* cur = PyDict_GetItemWithError(l.dict.ptr(), l.key.ptr());
      if (cur == nullptr) {
        PyErr_Clear();
        return 1;
      }
      if (cur != l.obj.ptr()) return 1;
      if (l.tensor) {
        const auto& w = THPVariable_Unpack(cur);
        if (w.data_ptr() != l.ptr || (!w.is_inference() && w._version() != l.version)) return 1;
      }
    }
    for (const auto& d : empties_)
      if (PyDict_Size(d.ptr()) != 0) return 2;
    return 0;
  }

  // x [B, n, D] through every layer; kbufs, vbufs, offs, lens: each layer's slab (SlabLayer.append).
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<torch::Tensor>& kbufs, const std::vector<torch::Tensor>& vbufs,
                        const std::vector<int64_t>& offs, const std::vector<int64_t>& lens, const torch::Tensor& mask) {
    const size_t layers = weights_.size() / 6;
    TORCH_CHECK(kbufs.size() == layers && vbufs.size() == layers && offs.size() == layers && lens.size() == layers,
                "FusedStack.forward: one key buffer, value buffer, offset and length per layer");
    for (size_t i = 0; i < layers; i++) {
      const torch::Tensor* w = weights_.data() + 6 * i;
      const double* f = floats_.data() + 3 * i;
      const int64_t* k = ints_.data() + 4 * i;
      x = attn_block(x, w[0], f[0], w[1], k[0], k[1], k[2], cos, sin, kbufs[i], vbufs[i], offs[i], lens[i], mask, f[2],
                     w[2]);
      x = mlp_block(x, w[3], f[1], w[4], k[3], w[5]);
    }
    return x;
  }

 private:
  struct Link {
    py::object dict, key, obj;
    bool tensor;
    const void* ptr;
    int64_t version;
    torch::Tensor held;   // the tensor as built: its impl, and where its storage lay then
    const void* storage;  // (only prefetched)
  };
  std::vector<Link> links_;
  std::vector<py::object> empties_;
  std::vector<torch::Tensor> weights_;
  std::vector<double> floats_;
  std::vector<int64_t> ints_;
};

// argmax over the last dimension of fp32 rows (x [R, V], unit stride along V, any row stride), as
// numpy's and torch's argmax: the first index of the largest value, or of the first NaN where a
// row has one. Greedy picks read a whole vocabulary per row right after the output layer wrote
// it; the layer's threads each wrote a contiguous share of the columns, so each thread here
// scans the same share of every row (from its own core's cache; numpy's one thread reading all
// of it took ~0.1 ms a pick inside a Leviathan step), then the shares' bests combine in column order.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() && x.stride(1) == 1 &&
                  x.size(1) > 0,
              "argmax_rows: x must be fp32 [R, V] with V > 0 and unit stride along V");
  const int64_t R = x.size(0), V = x.size(1), rs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), V / 4096));
  const int64_t share = (V + T - 1) / T;
  std::vector<float> best(R * T);
  std::vector<int64_t> where(R * T);
  std::vector<char> nan(R * T);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int64_t c0 = t * share, c1 = std::min(V, c0 + share);
      for (int64_t r = 0; r < R; r++) {
        const float* row = xp + r * rs;
        // pass 1: the share's largest value, and whether it holds a NaN
        __m256 mx[4], un[4];
        for (int i = 0; i < 4; i++) mx[i] = _mm256_set1_ps(-INFINITY), un[i] = _mm256_setzero_ps();
        int64_t c = c0;
        for (; c + 4 * kCols <= c1; c += 4 * kCols)  // four independent chains
          for (int i = 0; i < 4; i++) {
            const __m256 v = _mm256_loadu_ps(row + c + i * kCols);
            mx[i] = _mm256_max_ps(mx[i], v);
            un[i] = _mm256_or_ps(un[i], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
          }
        for (; c + kCols <= c1; c += kCols) {
          const __m256 v = _mm256_loadu_ps(row + c);
          mx[0] = _mm256_max_ps(mx[0], v);
          un[0] = _mm256_or_ps(un[0], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        alignas(32) float m8[kCols];
        _mm256_store_ps(m8, _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3])));
        const __m256 u = _mm256_or_ps(_mm256_or_ps(un[0], un[1]), _mm256_or_ps(un[2], un[3]));
        float m = m8[0];
        for (int i = 1; i < kCols; i++) m = std::max(m, m8[i]);
        bool has_nan = _mm256_movemask_ps(u) != 0;
        for (; c < c1; c++) {
          if (std::isnan(row[c])) has_nan = true;
          else m = std::max(m, row[c]);
        }
        // pass 2: the first index holding it (the first NaN if any)
        int64_t at = c0;
        if (has_nan) {
          while (!std::isnan(row[at])) at++;
        } else {
          const __m256 mb = _mm256_set1_ps(m);
          int hit = 0;
          for (; at + kCols <= c1; at += kCols)
            if ((hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + at), mb, _CMP_EQ_OQ))) != 0) break;
          if (hit) at += __builtin_ctz(hit);
          else while (row[at] != m) at++;
        }
        best[r * T + t] = m;  // (unused where the share has a NaN: that share wins)
        where[r * T + t] = at;
        nan[r * T + t] = has_nan;
      }
    }
  });
  auto out = torch::empty({R}, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; r++) {
    int64_t k = 0;
    for (int64_t t = 1; t < T && !nan[r * T + k]; t++)
      if (nan[r * T + t] || best[r * T + t] > best[r * T + k]) k = t;
    op[r] = where[r * T + k];
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<FusedStack>(m, "FusedStack")
      .def(py::init<const py::list&, const py::list&, std::vector<torch::Tensor>, std::vector<double>,
                    std::vector<int64_t>>())
      .def("state", &FusedStack::state, "0: as built; 1: changed since (rebuild); 2: a layer has a hook")
      .def("forward", &FusedStack::forward, "x through every fused layer, the KV cache written in place");
  m.def("move_slots", &move_slots, "move cache slots (rows, src -> dst) in every layer's keys and values");
  m.def("attn_block", &attn_block, "a fused Llama layer's attention half, the KV cache written in place");
  m.def("mlp_block", &mlp_block, "a fused Llama layer's MLP half");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from one [..., gate | up] tensor");
  m.def("attention", &attention, "decode/verify attention over a KV cache, GQA without repeating it");
  m.def("few_rows_linear", &few_rows_linear, "y = x @ W^T for a few rows, W packed in 8- or 48-column panels");
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU runs the 48-column (AVX-512F) tiles");
  m.def("is_intel", &cpu_is_intel, "whether this CPU is Intel's (no software prefetch; AVX2 tiles by default)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (fp32)");
  m.def("argmax_rows", &argmax_rows, "argmax over the last dimension of fp32 rows (first index; NaN first)");
  m.def("rope_", &rope_, "rotary embedding in place on the first heads of x [B, n, H, d]");
}
