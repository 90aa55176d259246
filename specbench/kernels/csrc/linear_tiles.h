// The few-row linear layer's tiles (few_rows.cpp), written once for a vector type V and included
// twice there: in namespace ymm (V = Ymm, AVX2, blocks of 8 columns) and in namespace zmm (V = Zmm,
// AVX-512, blocks of 16 columns) under `#pragma GCC target("avx512f")`, so that the AVX-512 code is
// compiled as such and runs only where the CPU has it. V::W is the block width (floats per vector),
// V::T the vector, V::S the blocks the packing interleaves k by k (1: each block its own stream;
// 3: a 48-column panel whose three vectors of one k lie side by side, one stream). The includer
// defines kOneC, kFewC, kManyC and kManyRmax (the blocks a tile takes for 1, 2-3 and 4 or more
// rows, and the most rows of one pass of the last; with S > 1 every tile takes all S blocks of a
// panel) and kNoAheadFrom (rows from which a single pass leaves the stream to the hardware
// prefetcher).
// No include guard: it is meant to be included more than once, each time in its own namespace.

constexpr int64_t kStride = V::S * V::W;  // floats from one k to the next within a block

// Block b (columns W*b ..) of a packing: where its vector of k = 0 lies.
inline const float* block_at(const float* wp, int64_t I, int64_t b) {
  return wp + (b / V::S) * I * kStride + (b % V::S) * V::W;
}

// R rows of x (row stride I) through C consecutive blocks of w (the first at w, the next ws floats
// on) over k in [k0, k1): the tile's partial sums come from acc (unless k0 == 0) and go back to it,
// R*C vectors of V::W. Ahead > 0: each block's line Ahead k further on is prefetched at every k.
template <int R, int C, int Ahead>
inline void tile(const float* x, int64_t I, const float* w, int64_t ws, int64_t k0, int64_t k1, float* acc) {
  typename V::T a[R][C];
#pragma GCC unroll 9
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) a[r][c] = k0 ? V::load(acc + (r * C + c) * V::W) : V::zero();
  for (int64_t k = k0; k < k1; k++) {
    typename V::T wk[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) wk[c] = V::loadu(w + c * ws + kStride * k);
    if constexpr (Ahead > 0)  // every k (each line twice with 8 columns): cheaper than a branch for every other k
#pragma GCC unroll 4
      for (int c = 0; c < C; c++) prefetch_nta(w + c * ws, kStride * (k + Ahead));
#pragma GCC unroll 9
    for (int r = 0; r < R; r++) {
      const typename V::T xk = V::set1(x + r * I + k);
#pragma GCC unroll 4
      for (int c = 0; c < C; c++) a[r][c] = V::fma(xk, wk[c], a[r][c]);
    }
  }
#pragma GCC unroll 9
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) V::store(acc + (r * C + c) * V::W, a[r][c]);
}

template <int C, int Rmax, int Ahead>
inline void tile_rows(int64_t R, const float* x, int64_t I, const float* w, int64_t ws, int64_t k0, int64_t k1,
                      float* acc) {
  switch (R) {
    case 9: if constexpr (Rmax >= 9) tile<9, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
    case 8: if constexpr (Rmax >= 8) tile<8, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
    case 7: if constexpr (Rmax >= 7) tile<7, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
    case 6: if constexpr (Rmax >= 6) tile<6, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
    case 5: if constexpr (Rmax >= 5) tile<5, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
    case 4: if constexpr (Rmax >= 4) tile<4, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
    case 3: if constexpr (Rmax >= 3) tile<3, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
    case 2: if constexpr (Rmax >= 2) tile<2, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
    default: tile<1, C, Ahead>(x, I, w, ws, k0, k1, acc); break;
  }
}

// All n rows through C blocks (the first at w; y: the first block's first column; cols: the columns
// of y's rows left from there, O in all), kGroup rows at a time, each
// group split evenly into passes of at most Rmax rows (6 rows with Rmax 4: 3 + 3, not 4 + 2).
// With one pass the blocks stream by once, prefetched kAhead k ahead for 2 or more rows (up to
// kNoAheadFrom rows). One row is left to the hardware prefetcher (software prefetch there ran from
// 4% faster to 2% slower by host state). With several passes, the passes take turns over chunks of
// kChunk k: every pass after the first finds the chunk in L1. The first prefetches kAhead k ahead
// and the later ones the next chunk (kChunk ahead), so the memory stream goes on under all of them
// (passes over whole blocks left the memory idle while the later ones reran the blocks from cache,
// and compute and stream added up). Prefetches are non-temporal. Against T0 prefetches from the
// first of several passes only (the previous scheme), interleaved: the model's 121 linears back to
// back 0.94-0.97x the time at 2 rows, 0.79-0.86x at 4, 0.89-0.95x at 5-8; whole forwards (bs 1,
// ctx 256) 0.92x at 4 rows, 0.95-0.97x at 5-8 (the back-to-back gain shrinks between other ops).
// At 5-8 rows the tiles are bound by the FMAs, not the stream (8 rows: 10 ms of FMAs at the two
// cores' peak against 11 ms of weight reads at 48 GB/s), so the loop's own instructions count: a
// prefetch at every k instead of a branch to one at every other k (with a clamp that went through
// the stack) took the model's linears to 0.89-0.95x at 5-8 rows, whole forwards to 0.94-0.96x.
template <int C, int Rmax>
inline void rows_through(const float* x, int64_t n, int64_t I, const float* w, float* y, int64_t O, int64_t cols) {
  const int64_t ws = V::S == 1 ? I * V::W : V::W;  // from one block to the next
  alignas(64) float acc[kGroup * C * V::W];
  for (int64_t g = 0; g < n; g += kGroup) {
    const int64_t gn = std::min<int64_t>(kGroup, n - g);
    int64_t sizes[kGroup], passes = 0;
    for (int64_t r = 0; r < gn; passes++) {
      const int64_t left = gn - r, p = (left + Rmax - 1) / Rmax;
      sizes[passes] = (left + p - 1) / p;
      r += sizes[passes];
    }
    const int64_t chunk = passes > 1 ? kChunk : I;
    const bool ahead = gn > 1 && (passes > 1 || gn < kNoAheadFrom) && software_prefetch();
    for (int64_t k0 = 0; k0 < I; k0 += chunk)
      for (int64_t p = 0, r = 0; p < passes; r += sizes[p++]) {
        const float* xr = x + (g + r) * I;
        const int64_t k1 = std::min(I, k0 + chunk);
        if (!ahead)
          tile_rows<C, Rmax, 0>(sizes[p], xr, I, w, ws, k0, k1, acc + r * C * V::W);
        else if (p == 0)
          tile_rows<C, Rmax, kAhead>(sizes[p], xr, I, w, ws, k0, k1, acc + r * C * V::W);
        else
          tile_rows<C, Rmax, kChunk>(sizes[p], xr, I, w, ws, k0, k1, acc + r * C * V::W);
      }
    for (int64_t r = 0; r < gn; r++)
      for (int c = 0; c < C; c++) {
        const int64_t m = std::min<int64_t>(V::W, cols - c * V::W);  // a panel's padding: none
        if (m > 0) std::memcpy(y + (g + r) * O + c * V::W, acc + (r * C + c) * V::W, m * sizeof(float));
      }
  }
}

// Blocks [b0, b1) in groups of C (with panels, b0 on a panel's first block and C = S: a group is a
// panel), the rest one at a time.
template <int C, int Rmax>
inline void blocks_range(const float* x, int64_t n, int64_t I, const float* wp, float* y, int64_t O, int64_t b0,
                         int64_t b1) {
  static_assert(V::S == 1 || C == V::S, "a tile takes a whole panel");
  int64_t b = b0;
  for (; b + C <= b1; b += C)
    rows_through<C, Rmax>(x, n, I, block_at(wp, I, b), y + V::W * b, O, O - V::W * b);
  for (; b < b1; b++)
    rows_through<1, 8>(x, n, I, block_at(wp, I, b), y + V::W * b, O, O - V::W * b);
}

// m rows of x through the panels [p0, p1) of wp (one thread's share; with S = 1 a panel is a
// block): one row through kOneC blocks at a time, 2 or 3 rows through kFewC, 4 or more through
// kManyC in passes of at most kManyRmax rows.
inline void rows_range(const float* x, int64_t m, int64_t I, const float* wp, float* y, int64_t O, int64_t p0,
                       int64_t p1) {
  const int64_t b0 = p0 * V::S, b1 = std::min(p1 * V::S, (O + V::W - 1) / V::W);  // no block of padding only
  if (m == 1)
    blocks_range<kOneC, 1>(x, m, I, wp, y, O, b0, b1);
  else if (m <= 3)
    blocks_range<kFewC, 3>(x, m, I, wp, y, O, b0, b1);
  else
    blocks_range<kManyC, kManyRmax>(x, m, I, wp, y, O, b0, b1);
}
