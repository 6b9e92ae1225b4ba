// CPU kernels behind paged_attention.py's "cpu" backend: ragged paged attention and the
// fused KV write (reshape_and_cache). Semantics are exactly paged_attention_reference's.
//
// Parallel work item = (sequence, KV head, tile of up to kTileRows query rows); on the SIMD
// decode path with enough decode sequences, (sequence, all KV heads, tile) so that blocks are
// read whole. Items are flattened and handed out dynamically, longest first (each thread claims
// one item ahead, so an item can prefetch the next one's first blocks), so 64 decode rows and one
// long prefill chunk both keep every core busy. Inside an item, each KV row is loaded (and
// converted from bf16/fp16 to float) once and used by every query row of the tile and every query
// head of the GQA group. Softmax is online (running max and sum per query vector), so no [context
// x heads] buffer is ever materialized. The block table scatters blocks, which defeats the
// hardware prefetcher, so the kernel prefetches the blocks it reads next itself.
//
// Three paths. Decode-sized tiles (fewer than 16 query vectors, head_dim 64 or 128) take the
// SIMD decode path, written once for AVX-512 and AVX2 ("decode tiles in SIMD registers" below:
// 64 keys per softmax step, 16 or 8 keys per score register). Prefill tiles (16 or more query
// vectors) of those head sizes take the SIMD prefill path ("prefill tiles in SIMD registers":
// query vectors across the lanes, softmax and both products on whole registers). Other head
// sizes, and every tile on a CPU without AVX2 + FMA, take the generic path (attend_tile).
// batch_invariant: tiles sized so that every query vector takes the same path whatever its batch
// and chunk (invariant_tile_rows below).
// Registered as torch.ops.nanoserve_cpu.{paged_attention, reshape_and_cache}; built by
// paged_attention.py with -O3 -march=native -fopenmp. Lean headers keep the build ~10 s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTileRows = 16;  // query rows per work item; a tile shares every K/V load
constexpr int kLanes = 16;     // head_dim granule: one AVX-512 / two AVX2 registers of floats
constexpr int kStepKeys = 64;   // keys per online-softmax step of the SIMD paths
constexpr int64_t kSerialWork = 2048;   // query x key pairs, summed over KV heads, below which one thread runs a call
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// std::bit_cast is C++20, and torch before 2.13 builds extensions as C++17
template <class To, class From>
inline To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

// exp(x) for the softmax, where x <= 0: e^x = 2^n * 2^f with n = round(x log2 e), |f| <= 1/2 and
// 2^f a degree-6 Taylor polynomial (relative error ~1.2e-7). Unlike std::exp, a loop of it
// vectorizes; x < -87 (e^x < 2^-125) returns 0, so -inf does too.
inline float exp_nonpositive(float x) {
  const float y = std::max(x * 1.44269504f, -126.f);
  const float n = std::floor(y + 0.5f), f = y - n;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  const float two_n = bit_cast<float>((int32_t(n) + 127) << 23);
  return x < -87.f ? 0.f : p * two_n;
}

// ---- KV rows, converted to float on load ------------------------------------------------

inline void load_row(const at::BFloat16* src, float* dst, int n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = bit_cast<float>(uint32_t(bits[i]) << 16);  // bf16 = top half of fp32
}

inline void load_row(const at::Half* src, float* dst, int n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    // integer-only so it vectorizes: move exponent+mantissa to float's place, rebias by 2^112
    // (also right for subnormals); exponent 31 (inf/nan) maps to float's 255
    const uint32_t h = bits[i], magnitude = h & 0x7fff, sign = (h & 0x8000) << 16;
    const float scaled = bit_cast<float>(magnitude << 13) * 0x1p112f;
    const uint32_t f = magnitude >= 0x7c00 ? (magnitude << 13) | 0x7f800000 : bit_cast<uint32_t>(scaled);
    dst[i] = bit_cast<float>(f | sign);
  }
}

// Rows [0, n) of one KV head inside a block as float, each row `*stride` floats apart.
// float32 caches are read in place; narrower caches are converted into `buffer`.
template <typename KV>
const float* block_rows(const KV* first_row, int64_t row_stride, int n, int head_dim,
                        float* buffer, int64_t* stride) {
  if constexpr (std::is_same_v<KV, float>) {
    *stride = row_stride;
    return first_row;
  } else {
    for (int t = 0; t < n; ++t) load_row(first_row + t * row_stride, buffer + t * head_dim, head_dim);
    *stride = head_dim;
    return buffer;
  }
}

// Ask for the next block's rows now, so its cache misses overlap this block's math: the
// block table scatters blocks, so the hardware prefetcher cannot guess the next address.
// Into L2 (locality 1): measured faster than into L1, whose few miss buffers fill up.
template <typename KV>
void prefetch_rows(const KV* first_row, int64_t row_stride, int n, int head_dim) {
  for (int t = 0; t < n; ++t)
    for (int64_t byte = 0; byte < (int64_t)head_dim * (int64_t)sizeof(KV); byte += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(first_row + t * row_stride) + byte, 0, 1);
}

// acc[d] += sum_t p[t] * v[t][d], W outputs at a time with t innermost: the W partial sums
// stay in registers for the whole block (W = 64 gives 4 independent AVX-512 FMA chains)
template <int W>
void accumulate(float* acc, const float* p, const float* v, int64_t v_stride, int n, int D) {
  for (int d0 = 0; d0 < D; d0 += W) {
    float a[W];
    for (int l = 0; l < W; ++l) a[l] = acc[d0 + l];
    for (int t = 0; t < n; ++t) {
      const float pt = p[t], *vt = v + t * v_stride + d0;
#pragma omp simd
      for (int l = 0; l < W; ++l) a[l] += pt * vt[l];
    }
    for (int l = 0; l < W; ++l) acc[d0 + l] = a[l];
  }
}

// Scores of a tile's query vectors against n keys, vectorized over the query vectors: a
// plain dot product ends in a horizontal sum per (query, key); here there is none, so prefill
// tiles run at FMA speed. T keys at a time give T independent FMA chains; keys past n (up
// to a multiple of T, still inside the block) are scored too and never read.
// q_t is [D][padded_m] (query vector m in column m, zero padding); writes
// score[m * score_stride + t] for every m < padded_m.
template <int T>
void scores_by_query(const float* q_t, int padded_m, const float* k, int64_t k_stride, int n, int D,
                     float* score, int score_stride) {
  for (int m0 = 0; m0 < padded_m; m0 += kLanes)
    for (int t0 = 0; t0 < n; t0 += T) {
      float a[T][kLanes] = {};
      for (int d = 0; d < D; ++d)
        for (int j = 0; j < T; ++j) {
          const float kd = k[(t0 + j) * k_stride + d];
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) a[j][l] += q_t[d * padded_m + m0 + l] * kd;
        }
      for (int j = 0; j < T; ++j)
        for (int l = 0; l < kLanes; ++l) score[(m0 + l) * score_stride + t0 + j] = a[j][l];
    }
}

// ---- one work item ------------------------------------------------------------------------

struct Batch {                      // raw views of the call's tensors
  const float* query;               // [num_tokens, num_heads, head_dim], float32, rows q_stride apart
  float* out;                       // [num_tokens, num_heads, head_dim], contiguous
  const int* block_tables;          // [num_seqs, max_blocks]
  int64_t max_blocks;
  int num_heads, num_kv_heads, head_dim, block_size, group;
  float scale;
  int64_t q_stride;                 // query's row stride: a view of the fused qkv is read in place
  const float* q(int64_t row, int head) const { return query + row * q_stride + (int64_t)head * head_dim; }
};

struct WorkItem {
  int seq, kv_head;
  int num_heads;                    // KV heads kv_head .. kv_head + num_heads - 1 (> 1: SIMD decode path only)
  int row_begin, row_end;           // query rows (indices into `query`) of this tile
  int first_pos;                    // absolute position of row_begin
  int64_t cost;                     // ~ rows x context, for longest-first ordering
};

struct Scratch {                    // per thread, reused across items
  std::vector<float> q, q_t, acc, score, row_max, row_sum, last, corr, k, v;
  // query vectors of a tile, padded to a register; keys of a block or of a SIMD prefill step
  static int padded(const Batch& b) { return kTileRows * b.group + kLanes; }
  static int keys(const Batch& b) { return std::max(b.block_size, kStepKeys); }
  Scratch(const Batch& b)
      : q(kTileRows * b.group * b.head_dim), q_t(padded(b) * b.head_dim), acc(q_t.size()),
        score(padded(b) * keys(b)), row_max(padded(b)), row_sum(row_max.size()), last(row_max.size()),
        corr(row_max.size()), k(keys(b) * b.head_dim), v(k.size()) {}
};

// Query vector m of a tile is (row m / group, head kv_head * group + m % group).
template <typename KV>
void attend_tile(const Batch& b, const KV* key_cache, const KV* value_cache, const WorkItem& w,
                 Scratch& s) {
  const int D = b.head_dim, G = b.group, bs = b.block_size;
  const int rows = w.row_end - w.row_begin, M = rows * G;
  for (int m = 0; m < M; ++m) {
    const float* src = b.q(w.row_begin + m / G, w.kv_head * G + m % G);
    for (int d = 0; d < D; ++d) s.q[m * D + d] = src[d] * b.scale;  // fold the scale into q once
    s.row_max[m] = kNegInf;
    s.row_sum[m] = 0.f;
  }
  std::fill(s.acc.begin(), s.acc.begin() + (int64_t)M * D, 0.f);
  // enough query vectors to fill a register (prefill tiles): score them with q transposed
  const bool by_query = M >= kLanes;
  const int padded_m = (M + kLanes - 1) / kLanes * kLanes;
  if (by_query)
    for (int d = 0; d < D; ++d)
      for (int m = 0; m < padded_m; ++m) s.q_t[d * padded_m + m] = m < M ? s.q[m * D + d] : 0.f;

  const int kv_len = w.first_pos + rows;     // the tile's last row sees positions [0, kv_len)
  const int64_t row_stride = (int64_t)b.num_kv_heads * D;   // token t -> t+1 inside a block
  const int* block_table = b.block_tables + w.seq * b.max_blocks;
  for (int start = 0; start < kv_len; start += bs) {
    const int n = std::min(bs, kv_len - start);
    const int64_t base = ((int64_t)block_table[start / bs] * bs * b.num_kv_heads + w.kv_head) * D;
    if (start + bs < kv_len) {
      const int64_t next = ((int64_t)block_table[start / bs + 1] * bs * b.num_kv_heads + w.kv_head) * D;
      const int next_n = std::min(bs, kv_len - start - bs);
      prefetch_rows(key_cache + next, row_stride, next_n, D);
      prefetch_rows(value_cache + next, row_stride, next_n, D);
    }
    int64_t ks, vs;
    const float* k = block_rows(key_cache + base, row_stride, n, D, s.k.data(), &ks);    // [n, D]
    const float* v = block_rows(value_cache + base, row_stride, n, D, s.v.data(), &vs);  // [n, D]
    if (by_query && bs % 4 == 0) scores_by_query<4>(s.q_t.data(), padded_m, k, ks, n, D, s.score.data(), bs);
    else if (by_query) scores_by_query<1>(s.q_t.data(), padded_m, k, ks, n, D, s.score.data(), bs);
    for (int m = 0; m < M; ++m) {
      const float* qm = &s.q[m * D];
      float* sc = &s.score[m * bs];
      const int visible = std::min(n, w.first_pos + m / G - start + 1);  // causal: pos <= row's pos
      if (visible <= 0) continue;            // whole block is in this row's future
      if (!by_query) {                       // decode: few query vectors, plain dot products
        for (int t = 0; t < visible; ++t) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += qm[d] * k[t * ks + d];
          sc[t] = dot;
        }
      }
      float block_max = kNegInf;
      for (int t = 0; t < visible; ++t) block_max = std::max(block_max, sc[t]);
      // online softmax: rescale what we have by exp(old_max - new_max), then add this block
      const float new_max = std::max(s.row_max[m], block_max);
      const float correction = exp_nonpositive(s.row_max[m] - new_max);  // 0 on the first block
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int t = 0; t < visible; ++t) block_sum += (sc[t] = exp_nonpositive(sc[t] - new_max));
      s.row_sum[m] = s.row_sum[m] * correction + block_sum;
      s.row_max[m] = new_max;
      if (correction != 1.f) {
        float* acc = &s.acc[m * D];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[d] *= correction;
      }
      if (D % 64 == 0) accumulate<64>(&s.acc[m * D], sc, v, vs, visible, D);
      else accumulate<kLanes>(&s.acc[m * D], sc, v, vs, visible, D);
    }
  }
  for (int m = 0; m < M; ++m) {
    float* dst = b.out + ((int64_t)(w.row_begin + m / G) * b.num_heads + w.kv_head * G + m % G) * D;
    const float inv = 1.f / s.row_sum[m];    // row_sum >= 1: the row always sees itself
    for (int d = 0; d < D; ++d) dst[d] = s.acc[m * D + d] * inv;
  }
}

// ---- decode tiles in SIMD registers (AVX-512 or AVX2) ----------------------------------------
// A decode item has few query vectors (the GQA group, e.g. 3), so the generic path above spends
// its time on one horizontal sum per (query, key) and a scalar exp per key, not on reading KV.
// At batch 64 the kernel must read ~15 GB/s of KV on 2 cores, i.e. one K row and one V row of a
// KV head every ~35 ns per core; so every instruction per key counts. Here:
//   - keys go W at a time (a "span", W = the register's floats: 16 on AVX-512, 8 on AVX2): each
//     query's W dot products are left as W vectors and summed by one transpose-and-add tree
//     (45 ops instead of 16 horizontal sums on AVX-512);
//   - a step takes up to kSpans spans (64 keys), scores them all, then runs the online softmax
//     once: one max, one rescale of the accumulators and one scalar exp per query per 64 keys
//     instead of per span, and the exp itself W lanes at a time;
//   - K/V rows are widened to float in registers as they are used (no buffer), bf16 in its
//     cheapest order (see Rows), and query vectors go MB <= kMB at a time, exactly as many as
//     there are (no padded lanes of work), their q or accumulators held in registers;
//   - the step is memory-bound at batch 64, so the next step's rows are prefetched, one row's
//     worth per row consumed and in memory order (see attend_small).
// Measured on 2 shared Zen 4 cores, 64 x 2048 tokens of bf16 KV: 1.9x the previous version of this
// path single-threaded (9-13 vs 5-7 GB/s); what remains is mostly memory stalls, not math. The
// AVX2 build on 2 shared Zen 3 cores, batch 64, 512-2048 tokens: 0.46-0.58 of read bandwidth for
// float32 KV and 0.38-0.53 for bf16, where the generic path read 0.35-0.37 and 0.17-0.19.
// Built where the compiler targets AVX-512 or AVX2 + FMA + F16C (-march=native); elsewhere the
// generic path runs. Exactly the same math as the generic path, in another summation order.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define NANOSERVE_SIMD_TILES 1

// The few register operations the decode and prefill paths need, for the widest registers the CPU has.
#if defined(__AVX512F__)
struct Simd {
  using V = __m512;
  static constexpr int W = 16;        // floats per register: keys per span
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {                // 2^n for integral n in [-126, 127]: build the exponent bits
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static V zero_below(V x, V r, float bound) {   // x where r >= bound, else 0
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, _mm512_set1_ps(bound), _CMP_GE_OQ), x);
  }
  static V first_n(V x, int n, float fill) {     // lanes < n of x, the rest `fill`
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), __mmask16((1u << n) - 1), x);
  }
  static V keep_if_le(V x, V a, V b, float fill) {   // x where a <= b, else fill
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), x);
  }
  static float reduce_max(V x) { return _mm512_reduce_max_ps(x); }
  static float reduce_add(V x) { return _mm512_reduce_add_ps(x); }
  static V load_half(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 2W bf16 as W (even, odd) pairs: bf16 is the top half of a float, so the odd elements are the
  // 32-bit words with their low halves masked and the even ones the words shifted left 16
  static void load_bf16_pairs(const at::BFloat16* p, V* even, V* odd) {
    const __m512i x = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int32_t(0xffff0000u))));
  }
  // r[i][j] <- r[j][i] for a 16 x 16 tile: pairs of rows interleaved, then quads, then
  // 128-bit lanes gathered in two rounds of shuffles
  static void transpose(V* r) {
    V t[16];
    for (int i = 0; i < 8; ++i) {          // per 128-bit lane k: elements 4k, 4k+1 | 4k+2, 4k+3 of rows 2i, 2i+1
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i)            // r[4i + j], lane k: element 4k + j of rows 4i .. 4i+3
      for (int h = 0; h < 2; ++h) {
        const __m512d a = _mm512_castps_pd(t[4 * i + h]), b = _mm512_castps_pd(t[4 * i + 2 + h]);
        r[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      }
    for (int j = 0; j < 4; ++j) {          // column 4k + j takes lane k of r[j], r[4+j], r[8+j], r[12+j]
      const V u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
      const V v0 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), v1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
      t[j] = _mm512_shuffle_f32x4(u0, v0, 0x88);
      t[8 + j] = _mm512_shuffle_f32x4(u0, v0, 0xdd);
      t[4 + j] = _mm512_shuffle_f32x4(u1, v1, 0x88);
      t[12 + j] = _mm512_shuffle_f32x4(u1, v1, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }
  // out[i] = sum of the lanes of v[i], for W vectors: pairs, then quads, then 128-bit lanes
  static V sum_lanes(const V* v) {
    V pair[8], quad[4];
    for (int i = 0; i < 8; ++i)   // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
      pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { // per 128-bit lane: the lane's sums of a, b, c, d
      const __m512d a = _mm512_castps_pd(pair[2 * i]), b = _mm512_castps_pd(pair[2 * i + 1]);
      quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    V half[2];                    // 128-bit lanes added pairwise, two quads per result
    for (int i = 0; i < 2; ++i)
      half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#else
struct Simd {
  using V = __m256;
  static constexpr int W = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V zero_below(V x, V r, float bound) {
    return _mm256_and_ps(_mm256_cmp_ps(r, _mm256_set1_ps(bound), _CMP_GE_OQ), x);
  }
  static V first_n(V x, int n, float fill) {
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(live));
  }
  static V keep_if_le(V x, V a, V b, float fill) {
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_cmp_ps(a, b, _CMP_LE_OQ));
  }
  static float reduce_max(V x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float reduce_add(V x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static V load_half(const at::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void load_bf16_pairs(const at::BFloat16* p, V* even, V* odd) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int32_t(0xffff0000u))));
  }
  // r[i][j] <- r[j][i] for an 8 x 8 tile
  static void transpose(V* r) {
    V t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i)            // u[4i + j], per 128-bit lane: element j of rows 4i .. 4i+3
      for (int h = 0; h < 2; ++h) {
        u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
        u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xee);
      }
    for (int j = 0; j < 4; ++j) {
      r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
      r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
  }
  // out[i] = sum of the lanes of v[i], for 8 vectors: horizontal adds within 128-bit lanes,
  // then the two lanes added
  static V sum_lanes(const V* v) {
    const V a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // [0123 low | 0123 high]
    const V b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // [4567 low | 4567 high]
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
};
#endif

using Vec = Simd::V;
constexpr int W = Simd::W;
constexpr int kSpans = kStepKeys / W;    // spans per step

// A K/V row of D = W * C elements as C float vectors, and where element d lands. float and
// fp16 rows keep their order. bf16 rows come as (even, odd) pairs of vectors (see
// Simd::load_bf16_pairs), half the cost of widening them in order. q and the output
// accumulators are kept in the same lane order, so dot products and p @ V do not change; the
// order is undone once per item when the output is written.
template <typename KV, int C>
struct Rows {
  static int dim(int c, int l) { return W * c + l; }   // element of vector c, lane l
  static void load(const KV* p, Vec* out) {
    for (int c = 0; c < C; ++c) {
      if constexpr (std::is_same_v<KV, float>) out[c] = Simd::load(p + W * c);
      else out[c] = Simd::load_half(p + W * c);
    }
  }
};

template <int C>
struct Rows<at::BFloat16, C> {
  static int dim(int c, int l) { return 2 * W * (c / 2) + 2 * l + c % 2; }
  static void load(const at::BFloat16* p, Vec* out) {
    for (int j = 0; j < C / 2; ++j) Simd::load_bf16_pairs(p + 2 * W * j, &out[2 * j], &out[2 * j + 1]);
  }
};

// exp_nonpositive() on W lanes: same range reduction and polynomial.
inline Vec exp_nonpositive_simd(Vec x) {
  const Vec y = Simd::max(Simd::mul(x, Simd::set1(1.44269504f)), Simd::set1(-126.f));
  const Vec n = Simd::round(y), f = Simd::sub(y, n);
  Vec p = Simd::set1(1.5403530e-4f);
  for (float coef : {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.f})
    p = Simd::fmadd(p, f, Simd::set1(coef));
  return Simd::zero_below(Simd::mul(p, Simd::pow2(n)), x, -87.f);
}

// Up to W consecutive keys inside one block: K/V rows k[t * row_stride], v[...], t < n, at
// absolute positions pos + t.
template <typename KV>
struct Span {
  const KV *k, *v;
  int n, pos;
};

// Ask for one K or V row of a future step now, so its cache misses overlap this step's math:
// the block table scatters blocks, so the hardware prefetcher cannot guess the next address.
// One row per row consumed, spread through the compute: a burst of a whole step's prefetches
// would fill the core's few miss buffers and stall the math behind them. Into L2 (locality 1).
template <typename KV, int C>
inline void prefetch_row(const KV* row) {
  for (int byte = 0; byte < W * C * (int)sizeof(KV); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + byte, 0, 1);
}

// p[i * kStepKeys + W * s + t] = q_i . k_t for MB query vectors and the keys of spans [0, ns);
// key slots past a span's n get 0, for the softmax to mask. While at it, for each row it reads,
// prefetches one row's worth of K at ahead[s].k + t * pf_stride (`ahead`: the next step's
// spans, na of them, 0 for none).
template <typename KV, int C, int MB>
void span_scores(const float* q, const Span<KV>* spans, int ns, const Span<KV>* ahead, int na, int64_t pf_stride,
                 int64_t row_stride, float* p) {
  Vec qr[MB][C];
  for (int i = 0; i < MB; ++i)
    for (int c = 0; c < C; ++c) qr[i][c] = Simd::load(q + i * W * C + W * c);
  for (int s = 0; s < ns; ++s) {
    Vec dots[MB][W];
    for (int t = 0; t < W; ++t) {
      if (t >= spans[s].n) {
        for (int i = 0; i < MB; ++i) dots[i][t] = Simd::zero();
        continue;
      }
      if (s < na && t < ahead[s].n) prefetch_row<KV, C>(ahead[s].k + t * pf_stride);
      Vec k[C];
      Rows<KV, C>::load(spans[s].k + t * row_stride, k);
      for (int i = 0; i < MB; ++i) {
        Vec a = Simd::mul(qr[i][0], k[0]);
        for (int c = 1; c < C; ++c) a = Simd::fmadd(qr[i][c], k[c], a);
        dots[i][t] = a;
      }
    }
    for (int i = 0; i < MB; ++i) Simd::store(p + i * kStepKeys + W * s, Simd::sum_lanes(dots[i]));
  }
}

// acc_i += sum_t p[i * kStepKeys + W * s + t] * v_t over the spans, MB accumulators in
// registers; prefetches V from `ahead` as span_scores does K.
template <typename KV, int C, int MB>
void span_values(const float* p, const Span<KV>* spans, int ns, const Span<KV>* ahead, int na, int64_t pf_stride,
                 int64_t row_stride, float* acc) {
  Vec a[MB][C];
  for (int i = 0; i < MB; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = Simd::load(acc + i * W * C + W * c);
  for (int s = 0; s < ns; ++s)
    for (int t = 0; t < spans[s].n; ++t) {
      if (s < na && t < ahead[s].n) prefetch_row<KV, C>(ahead[s].v + t * pf_stride);
      Vec v[C];
      Rows<KV, C>::load(spans[s].v + t * row_stride, v);
      for (int i = 0; i < MB; ++i) {
        const Vec pt = Simd::set1(p[i * kStepKeys + W * s + t]);
        for (int c = 0; c < C; ++c) a[i][c] = Simd::fmadd(pt, v[c], a[i][c]);
      }
    }
  for (int i = 0; i < MB; ++i)
    for (int c = 0; c < C; ++c) Simd::store(acc + i * W * C + W * c, a[i][c]);
}

// Query vectors per pass: 4 of head_dim 64 or 2 of 128, so that each K/V row loaded serves
// a whole GQA group (3 or 4 query vectors in most models). On AVX-512 their q (or accumulators)
// fill half the registers; on AVX2 they spill to L1, which measured no slower than one pass per
// query vector that reloads and reconverts every row (0.46-0.56 vs 0.35-0.51 of read bandwidth).
template <int C>
constexpr int kMB = W * C <= 64 ? 4 : 2;

// All M query vectors, kMB at a time (the last group smaller).
template <typename KV, int C>
void scores_all(const float* q, int M, const Span<KV>* spans, int ns, const Span<KV>* ahead, int na,
                int64_t pf_stride, int64_t row_stride, float* p) {
  constexpr int MB = kMB<C>, D = W * C;
  for (int m = 0; m < M; m += MB) {
    const float* qm = q + m * D;
    float* pm = p + m * kStepKeys;
    const int na_m = m == 0 ? na : 0;        // prefetch once, with the first group
    switch (std::min(MB, M - m)) {
      case 1: span_scores<KV, C, 1>(qm, spans, ns, ahead, na_m, pf_stride, row_stride, pm); break;
      case 2: if constexpr (MB >= 2) span_scores<KV, C, 2>(qm, spans, ns, ahead, na_m, pf_stride, row_stride, pm); break;
      case 3: if constexpr (MB >= 3) span_scores<KV, C, 3>(qm, spans, ns, ahead, na_m, pf_stride, row_stride, pm); break;
      default: if constexpr (MB >= 4) span_scores<KV, C, 4>(qm, spans, ns, ahead, na_m, pf_stride, row_stride, pm); break;
    }
  }
}

template <typename KV, int C>
void values_all(const float* p, int M, const Span<KV>* spans, int ns, const Span<KV>* ahead, int na,
                int64_t pf_stride, int64_t row_stride, float* acc) {
  constexpr int MB = kMB<C>, D = W * C;
  for (int m = 0; m < M; m += MB) {
    const float* pm = p + m * kStepKeys;
    float* am = acc + m * D;
    const int na_m = m == 0 ? na : 0;
    switch (std::min(MB, M - m)) {
      case 1: span_values<KV, C, 1>(pm, spans, ns, ahead, na_m, pf_stride, row_stride, am); break;
      case 2: if constexpr (MB >= 2) span_values<KV, C, 2>(pm, spans, ns, ahead, na_m, pf_stride, row_stride, am); break;
      case 3: if constexpr (MB >= 3) span_values<KV, C, 3>(pm, spans, ns, ahead, na_m, pf_stride, row_stride, am); break;
      default: if constexpr (MB >= 4) span_values<KV, C, 4>(pm, spans, ns, ahead, na_m, pf_stride, row_stride, am); break;
    }
  }
}

// The online softmax step for one query vector over the keys just scored: p holds the scores
// of ns spans (W slots each), row position `row_pos` sees keys at positions <= row_pos.
// Rewrites p as the weights exp(score - new max), zero where masked, and rescales acc.
template <typename KV, int C>
void softmax_step(float* p, const Span<KV>* spans, int ns, int row_pos, float* row_max, float* row_sum,
                  float* acc) {
  Vec sc[kSpans];
  Vec top = Simd::set1(kNegInf);
  for (int s = 0; s < ns; ++s) {
    const int visible = std::clamp(row_pos - spans[s].pos + 1, 0, spans[s].n);   // causal, and the span's end
    sc[s] = Simd::first_n(Simd::load(p + W * s), visible, kNegInf);
    top = Simd::max(top, sc[s]);
  }
  const float new_max = std::max(*row_max, Simd::reduce_max(top));
  if (new_max == kNegInf) {                  // every key here is in this row's future
    for (int s = 0; s < ns; ++s) Simd::store(p + W * s, Simd::zero());
    return;
  }
  const float correction = exp_nonpositive(*row_max - new_max);   // 0 on the first step
  Vec sum = Simd::zero();
  for (int s = 0; s < ns; ++s) {
    const Vec e = exp_nonpositive_simd(Simd::sub(sc[s], Simd::set1(new_max)));
    Simd::store(p + W * s, e);
    sum = Simd::add(sum, e);
  }
  *row_sum = *row_sum * correction + Simd::reduce_add(sum);
  *row_max = new_max;
  if (correction != 1.f)
    for (int c = 0; c < C; ++c) Simd::store(acc + W * c, Simd::mul(Simd::load(acc + W * c), Simd::set1(correction)));
}

// A step's spans of item w: up to kSpans spans of up to W keys from position `start` on, never
// crossing a block, at KV head w.kv_head. Returns how many (0 past the item's context).
template <typename KV>
int make_spans(const Batch& b, const KV* key_cache, const KV* value_cache, const WorkItem& w, int start,
               Span<KV>* spans) {
  const int kv_len = w.first_pos + (w.row_end - w.row_begin), bs = b.block_size;
  const int64_t row_stride = (int64_t)b.num_kv_heads * b.head_dim;
  const int* block_table = b.block_tables + w.seq * b.max_blocks;
  int ns = 0;
  for (; ns < kSpans && start < kv_len; ++ns) {
    const int n = std::min({W, bs - start % bs, kv_len - start});
    const int64_t at = ((int64_t)block_table[start / bs] * bs + start % bs) * row_stride + (int64_t)w.kv_head * b.head_dim;
    spans[ns] = {key_cache + at, value_cache + at, n, start};
    start += n;
  }
  return ns;
}

// The item covers KV heads [kv_head, kv_head + num_heads): with all of a sequence's heads in
// one item, a block is read front to back (every head's rows are interleaved in it), which
// DRAM serves much faster than each head's 128-byte slices read by separate items.
// `next` (may be null) is the item this thread runs next: the last steps prefetch its first
// ones, so a new sequence does not start cold. State of (head h, query vector m) is at index
// h * M + m, in Rows' lane order.
template <typename KV, int C>
void attend_small(const Batch& b, const KV* key_cache, const KV* value_cache, const WorkItem& w,
                         const WorkItem* next, Scratch& s) {
  using R = Rows<KV, C>;
  constexpr int D = W * C;
  const int G = b.group, H = w.num_heads;
  const int rows = w.row_end - w.row_begin, M = rows * G;    // query vectors per KV head, < 16
  auto out_row = [&](int h, int m) {                       // the output [D] of query vector (h, m)
    return (int64_t)(w.row_begin + m / G) * b.num_heads + (w.kv_head + h) * G + m % G;
  };
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < M; ++m) {
      const float* src = b.q(w.row_begin + m / G, (w.kv_head + h) * G + m % G);
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < W; ++l) s.q[(h * M + m) * D + W * c + l] = src[R::dim(c, l)] * b.scale;
      s.row_max[h * M + m] = kNegInf;
      s.row_sum[h * M + m] = 0.f;
    }
  std::fill(s.acc.begin(), s.acc.begin() + (int64_t)H * M * D, 0.f);
  const int kv_len = w.first_pos + rows;
  const int64_t row_stride = (int64_t)b.num_kv_heads * D;
  // Prefetch in memory order: when the item owns all heads, a span's rows are one contiguous
  // range, and the pass of head h prefetches the h-th 1/H of the next span's range (D elements
  // per row consumed), so DRAM sees each block read front to back once, not H strided passes
  // (measured 0-15% faster at 512-1024 tokens, even at 2048); otherwise each head prefetches
  // its own rows.
  const bool whole_rows = H == b.num_kv_heads;
  const int64_t pf_stride = whole_rows ? D : row_stride;
  if (next && next->num_heads != H) next = nullptr;   // its rows would not line up with ours
  // spans at position `pos` of the key stream: this item's keys, then the next item's
  auto spans_at = [&](int pos, Span<KV>* out) {
    if (pos < kv_len) return make_spans(b, key_cache, value_cache, w, pos, out);
    return next ? make_spans(b, key_cache, value_cache, *next, pos - kv_len, out) : 0;
  };
  alignas(64) float p[16 * kStepKeys];       // [m][kStepKeys]: scores, then weights
  Span<KV> spans[kSpans], ahead[kSpans];     // this step's keys, the next step's (for prefetch)
  int ns = make_spans(b, key_cache, value_cache, w, 0, spans);
  while (ns > 0) {
    const int end = spans[ns - 1].pos + spans[ns - 1].n;
    const int na = spans_at(end, ahead);
    for (int h = 0; h < H; ++h) {            // the same keys for head kv_head + h
      Span<KV> head_spans[kSpans], head_ahead[kSpans];   // head_ahead: what this head's passes prefetch
      for (int i = 0; i < ns; ++i) head_spans[i] = {spans[i].k + h * D, spans[i].v + h * D, spans[i].n, spans[i].pos};
      for (int i = 0; i < na; ++i) {
        const int64_t part = h * (whole_rows ? ahead[i].n * D : D);
        head_ahead[i] = {ahead[i].k + part, ahead[i].v + part, ahead[i].n, ahead[i].pos};
      }
      float* q_h = &s.q[h * M * D];
      float* acc_h = &s.acc[h * M * D];
      scores_all<KV, C>(q_h, M, head_spans, ns, head_ahead, na, pf_stride, row_stride, p);
      for (int m = 0; m < M; ++m)
        softmax_step<KV, C>(p + m * kStepKeys, head_spans, ns, w.first_pos + m / G, &s.row_max[h * M + m],
                            &s.row_sum[h * M + m], acc_h + m * D);
      values_all<KV, C>(p, M, head_spans, ns, head_ahead, na, pf_stride, row_stride, acc_h);
    }
    ns = make_spans(b, key_cache, value_cache, w, end, spans);
  }
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < M; ++m) {
      float* dst = b.out + out_row(h, m) * D;
      const float inv = 1.f / s.row_sum[h * M + m];   // row_sum >= 1: the row always sees itself
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < W; ++l) dst[R::dim(c, l)] = s.acc[(h * M + m) * D + W * c + l] * inv;
    }
}

// ---- prefill tiles in SIMD registers --------------------------------------------------------
// A prefill tile is 16 rows x the GQA group (48 query vectors in SmolLM2) against every key
// before it: two small matrix products, q k^T and then p v. The generic path runs them at 17-23
// G multiply-adds/s on a Zen 4 core, because its softmax goes one query vector at a time: per
// query vector and 16-key block a scalar max, a scalar exp and a rescale of the accumulators.
// Here the query vectors lie across the lanes (q transposed once per item), so the scores come
// out as S[key][query] and the online softmax is elementwise work on W query vectors at once:
// a running max per lane, one vector exp per register of scores, no horizontal sums. Both
// products are register tiles of kPQ registers of query vectors by kPK keys or dims, in which
// each broadcast K or V element feeds kPQ FMAs:
//   S[t][m]    = sum_d qT[d][m] * k[t][d]
//   accT[d][m] = corr[m] * accT[d][m] + sum_t P[t][m] * v[t][d]
// Keys go kStepKeys at a time, gathered across blocks and widened to float once per step into a
// buffer (a prefill chunk's KV was written this step, so it is still in cache); the output is
// transposed back W x W at the end. Same math as the generic path, in float32, in another
// summation order. (Keeping the sums as acc[m][d], with d across the lanes and no transposes,
// measured 1.3x slower.)
constexpr int kPQ = W == 16 ? 3 : 2;    // 24 sums in registers on AVX-512, 8 on AVX2
constexpr int kPK = W == 16 ? 8 : 4;

// S[t * Mp + m] for keys t < nk_pad (a multiple of kPK) and the QB registers of query vectors
// from m0 on. k is [nk_pad][D] floats, qT [D][Mp].
template <int QB>
void prefill_scores(const float* qT, int Mp, int m0, const float* k, int nk_pad, int D, float* S) {
  for (int t0 = 0; t0 < nk_pad; t0 += kPK) {
    Vec a[QB][kPK];
    for (int i = 0; i < QB; ++i)
      for (int j = 0; j < kPK; ++j) a[i][j] = Simd::zero();
    for (int d = 0; d < D; ++d) {
      Vec q[QB];
      for (int i = 0; i < QB; ++i) q[i] = Simd::load(qT + d * Mp + m0 + i * W);
      for (int j = 0; j < kPK; ++j) {
        const Vec kj = Simd::set1(k[(t0 + j) * D + d]);
        for (int i = 0; i < QB; ++i) a[i][j] = Simd::fmadd(q[i], kj, a[i][j]);
      }
    }
    for (int j = 0; j < kPK; ++j)
      for (int i = 0; i < QB; ++i) Simd::store(S + (t0 + j) * Mp + m0 + i * W, a[i][j]);
  }
}

// accT[d][m] = corr[m] * accT[d][m] + sum_{t < nk} P[t][m] * v[t][d] for the QB registers of
// query vectors from m0 on; the rescale rides on the load of the sums. v is [nk][D] floats.
template <int QB>
void prefill_values(const float* P, int Mp, int m0, const float* v, int nk, int D, const float* corr,
                    float* accT) {
  Vec c[QB];
  for (int i = 0; i < QB; ++i) c[i] = Simd::load(corr + m0 + i * W);
  for (int d0 = 0; d0 < D; d0 += kPK) {
    Vec a[QB][kPK];
    for (int j = 0; j < kPK; ++j)
      for (int i = 0; i < QB; ++i) a[i][j] = Simd::mul(Simd::load(accT + (d0 + j) * Mp + m0 + i * W), c[i]);
    for (int t = 0; t < nk; ++t) {
      Vec p[QB];
      for (int i = 0; i < QB; ++i) p[i] = Simd::load(P + t * Mp + m0 + i * W);
      for (int j = 0; j < kPK; ++j) {
        const Vec vj = Simd::set1(v[t * D + d0 + j]);
        for (int i = 0; i < QB; ++i) a[i][j] = Simd::fmadd(p[i], vj, a[i][j]);
      }
    }
    for (int j = 0; j < kPK; ++j)
      for (int i = 0; i < QB; ++i) Simd::store(accT + (d0 + j) * Mp + m0 + i * W, a[i][j]);
  }
}

// tile(QB, m0) over all Mp query vectors, kPQ registers at a time (the last group smaller);
// QB comes as a std::integral_constant so that the tile can take it as a template argument.
template <class Tile>
void over_query_registers(int Mp, Tile tile) {
  for (int m0 = 0; m0 < Mp; m0 += kPQ * W) {
    const int regs = std::min(kPQ, (Mp - m0) / W);
    if (regs == 1) tile(std::integral_constant<int, 1>(), m0);
    else if (regs == 2) tile(std::integral_constant<int, 2>(), m0);
    else if constexpr (kPQ >= 3) tile(std::integral_constant<int, kPQ>(), m0);
  }
}

// The online softmax step for every query vector at once, keys [key_pos, key_pos + nk): masks
// keys past each query's position (last[m]: the last position query vector m sees) to -inf,
// turns S into P = exp(S - new max), and leaves in corr[m] the factor exp(old max - new max)
// that the sums so far take. Every query sees key 0, so after the first step no max is -inf.
void prefill_softmax(float* S, int Mp, int nk, int key_pos, bool causal, const float* last, float* row_max,
                     float* row_sum, float* corr) {
  for (int m = 0; m < Mp; m += W) {
    const Vec sees = Simd::load(last + m);
    Vec top = Simd::load(row_max + m);
    for (int t = 0; t < nk; ++t) {
      Vec x = Simd::load(S + t * Mp + m);
      if (causal) {
        x = Simd::keep_if_le(x, Simd::set1(float(key_pos + t)), sees, kNegInf);
        Simd::store(S + t * Mp + m, x);
      }
      top = Simd::max(top, x);
    }
    const Vec c = exp_nonpositive_simd(Simd::sub(Simd::load(row_max + m), top));   // 0 on the first step
    Vec sum = Simd::zero();
    for (int t = 0; t < nk; ++t) {
      const Vec e = exp_nonpositive_simd(Simd::sub(Simd::load(S + t * Mp + m), top));
      Simd::store(S + t * Mp + m, e);
      sum = Simd::add(sum, e);
    }
    Simd::store(corr + m, c);
    Simd::store(row_sum + m, Simd::fmadd(Simd::load(row_sum + m), c, sum));
    Simd::store(row_max + m, top);
  }
}

// Rows [pos, pos + n) of item w's KV head as floats, n rows of D at dst, across blocks.
template <typename KV>
void gather_rows(const Batch& b, const KV* cache, const WorkItem& w, int pos, int n, float* dst) {
  const int D = b.head_dim, bs = b.block_size;
  const int* block_table = b.block_tables + w.seq * b.max_blocks;
  const int64_t row_stride = (int64_t)b.num_kv_heads * D;
  for (int t = 0; t < n;) {
    const int p = pos + t, run = std::min(bs - p % bs, n - t);   // rows left in this block
    const KV* src = cache + ((int64_t)block_table[p / bs] * bs + p % bs) * row_stride + (int64_t)w.kv_head * D;
    for (int r = 0; r < run; ++r, ++t) {
      if constexpr (std::is_same_v<KV, float>) std::memcpy(dst + t * D, src + r * row_stride, D * sizeof(float));
      else load_row(src + r * row_stride, dst + t * D, D);
    }
  }
}

// One prefill tile (>= kLanes query vectors) of one KV head. Query vector m is (row m / G,
// head kv_head * G + m % G), as in attend_tile; vectors past M (padding to a register) have
// zero queries that see every key, and are never written out.
template <typename KV>
void attend_prefill(const Batch& b, const KV* key_cache, const KV* value_cache, const WorkItem& w, Scratch& s) {
  const int D = b.head_dim, G = b.group;
  const int rows = w.row_end - w.row_begin, M = rows * G, Mp = (M + W - 1) / W * W;
  const int kv_len = w.first_pos + rows;
  auto out_row = [&](int m) {   // the output row of query vector m
    return (int64_t)(w.row_begin + m / G) * b.num_heads + w.kv_head * G + m % G; };
  float *qT = s.q_t.data(), *accT = s.acc.data(), *S = s.score.data(), *k = s.k.data(), *v = s.v.data();
  for (int m0 = 0; m0 < Mp; m0 += W)       // qT [D][Mp]: W x W tiles of q transposed, scale folded in
    for (int d0 = 0; d0 < D; d0 += W) {
      Vec r[W];
      for (int i = 0; i < W; ++i)
        r[i] = m0 + i < M ? Simd::mul(Simd::load(b.q(w.row_begin + (m0 + i) / G, w.kv_head * G + (m0 + i) % G) + d0),
                                      Simd::set1(b.scale))
                          : Simd::zero();
      Simd::transpose(r);
      for (int i = 0; i < W; ++i) Simd::store(qT + (d0 + i) * Mp + m0, r[i]);
    }
  for (int m = 0; m < Mp; ++m) {
    s.last[m] = m < M ? float(w.first_pos + m / G) : float(kv_len);
    s.row_max[m] = kNegInf;
    s.row_sum[m] = 0.f;
  }
  std::fill(accT, accT + (int64_t)D * Mp, 0.f);
  for (int start = 0; start < kv_len; start += kStepKeys) {
    const int nk = std::min(kStepKeys, kv_len - start), nk_pad = (nk + kPK - 1) / kPK * kPK;
    gather_rows(b, key_cache, w, start, nk, k);          // [nk][D]
    gather_rows(b, value_cache, w, start, nk, v);        // [nk][D]
    std::fill(k + nk * D, k + nk_pad * D, 0.f);          // scored, never weighed
    over_query_registers(Mp, [&](auto QB, int m0) {      // S [nk_pad][Mp]
      prefill_scores<decltype(QB)::value>(qT, Mp, m0, k, nk_pad, D, S);
    });
    const bool causal = start + nk - 1 > w.first_pos;    // some key here is past some query
    prefill_softmax(S, Mp, nk, start, causal, s.last.data(), s.row_max.data(), s.row_sum.data(), s.corr.data());
    over_query_registers(Mp, [&](auto QB, int m0) {
      prefill_values<decltype(QB)::value>(S, Mp, m0, v, nk, D, s.corr.data(), accT);
    });
  }
  for (int m = 0; m < Mp; ++m) s.corr[m] = 1.f / s.row_sum[m];   // row_sum >= 1: a row always sees itself
  for (int m0 = 0; m0 < M; m0 += W)        // out = accT / row_sum, transposed back W x W
    for (int d0 = 0; d0 < D; d0 += W) {
      Vec r[W];
      for (int i = 0; i < W; ++i) r[i] = Simd::mul(Simd::load(accT + (d0 + i) * Mp + m0), Simd::load(&s.corr[m0]));
      Simd::transpose(r);
      for (int i = 0; i < W && m0 + i < M; ++i) Simd::store(b.out + out_row(m0 + i) * D + d0, r[i]);
    }
}

// Can decode tiles of this batch take the SIMD path with one item per sequence (all KV
// heads)? Only with enough sequences to keep every thread busy, and state that fits Scratch.
bool whole_sequence_items(const Batch& b, int num_seqs, int rows) {
  return (b.head_dim == 64 || b.head_dim == 128) && rows * b.group < kLanes && rows * b.num_kv_heads <= kTileRows &&
         num_seqs >= 4 * at::get_num_threads();
}
#endif  // NANOSERVE_SIMD_TILES

// The SIMD paths for decode-sized and prefill tiles of the usual head sizes, else the generic one.
template <typename KV>
void attend(const Batch& b, const KV* key_cache, const KV* value_cache, const WorkItem& w, const WorkItem* next,
            Scratch& s) {
#if defined(NANOSERVE_SIMD_TILES)
  if ((w.row_end - w.row_begin) * b.group < kLanes) {
    if (b.head_dim == 64) return attend_small<KV, 64 / W>(b, key_cache, value_cache, w, next, s);
    if (b.head_dim == 128) return attend_small<KV, 128 / W>(b, key_cache, value_cache, w, next, s);
  } else if (b.head_dim == 64 || b.head_dim == 128) {
    return attend_prefill<KV>(b, key_cache, value_cache, w, s);
  }
#else
  (void)next;
#endif
  attend_tile<KV>(b, key_cache, value_cache, w, s);   // num_heads == 1 here
}

template <typename KV>
void run_items(const Batch& b, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const std::vector<WorkItem>& items) {
  const KV* k = key_cache.const_data_ptr<KV>();
  const KV* v = value_cache.const_data_ptr<KV>();
  const int64_t num_items = items.size();
  // Dynamic scheduling by hand. With many items (a decode batch) each thread claims one item
  // ahead, so the item it runs knows the next one and can prefetch its start; with few (long
  // prefill chunks) that would let one thread hold two items while another idles, so not then.
  // torch's thread count (torch.set_num_threads) governs this loop too: same libgomp.
  // A small step (a decode row or two over a short context: ~10 us of work) runs on this thread
  // alone: waking the others costs as much, and far more when another process holds their cores
  // (measured at batch 1 on 2 shared cores: 280 us a call with two threads). Same items either way.
  int64_t work = 0;
  for (const WorkItem& item : items) work += item.cost;
  const int threads = work < kSerialWork ? 1 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  const bool claim_ahead = num_items >= 4 * threads;
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch(b);
    for (int64_t i = claimed++; i < num_items;) {
      const int64_t next = claim_ahead ? claimed++ : num_items;
      attend<KV>(b, k, v, items[i], next < num_items ? &items[next] : nullptr, scratch);
      i = claim_ahead ? next : claimed++;
    }
  }
}

// ---- ops ----------------------------------------------------------------------------------

// Batch-invariant mode (docs/batch-invariance.md): query rows per tile such that every tile, a
// decode row's or a prefill chunk's, takes the same path. Each path computes a query vector
// exactly as it would alone: the softmax goes in steps fixed by absolute key positions (64 keys,
// or a block), keys past the vector's position weigh exactly 0, and the tile's other vectors only
// share the loads. But the paths differ from one another in summation order (the decode path's
// dot products end in a shuffle tree, the prefill path's run along head_dim), and by default a
// chunk's tiles of 16 rows take the prefill path while its short last tile and every decode row
// take the decode one. So: tiles of fewer than 16 query vectors (15 / group rows, e.g. 5 rows
// for a GQA group of 3), which all take the decode path (the generic one for other head sizes,
// with plain dot products too); a group of 16 or more makes every tile, one row included, a
// prefill tile, and the usual tiles stay.
int invariant_tile_rows(int group) { return group < kLanes ? std::max(1, (kLanes - 1) / group) : kTileRows; }

void check_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.dtype() == key_cache.dtype(),
              "value_cache must match key_cache in shape and dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  const auto dt = key_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "KV cache dtype must be float32, bfloat16 or float16, got ", dt);
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, const at::Tensor& query_start_loc,
                               double scale, bool batch_invariant) {
  check_kv_cache(key_cache, value_cache);
  TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, head_dim], got ", query.sizes());
  const int num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const int num_tokens = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(query.size(2) == head_dim, "query head_dim ", query.size(2), " != cache head_dim ", head_dim);
  TORCH_CHECK(head_dim % kLanes == 0, "head_dim must be a multiple of ", kLanes, ", got ", head_dim);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads ", num_heads, " must be a multiple of num_kv_heads ",
              num_kv_heads);
  // a [T, heads, head_dim] view with contiguous heads (the q of a fused qkv) is read in place
  auto q = query.to(at::kFloat);
  if (q.stride(2) != 1 || q.stride(1) != head_dim) q = q.contiguous();
  const auto tables = block_tables.to(at::kInt).contiguous();
  const auto ctx = context_lens.to(at::kInt).contiguous();
  const auto qsl = query_start_loc.to(at::kInt).contiguous();
  const int num_seqs = ctx.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(qsl.numel() == num_seqs + 1, "query_start_loc must have num_seqs + 1 entries");
  auto out = at::empty(q.sizes(), q.options());   // contiguous
  Batch b{q.const_data_ptr<float>(), out.mutable_data_ptr<float>(), tables.const_data_ptr<int>(),
          tables.size(1), num_heads, num_kv_heads, head_dim, block_size, num_heads / num_kv_heads,
          (float)scale, q.stride(0)};

  // Flatten (sequence, KV head, query tile) into work items; validate what the kernel will read.
  const int tile_rows = batch_invariant ? invariant_tile_rows(b.group) : kTileRows;
  const int* qs = qsl.const_data_ptr<int>();
  const int* cl = ctx.const_data_ptr<int>();
  TORCH_CHECK(qs[0] == 0 && qs[num_seqs] == num_tokens, "query_start_loc must run from 0 to num_tokens");
  std::vector<WorkItem> items;
  for (int i = 0; i < num_seqs; ++i) {
    const int q_len = qs[i + 1] - qs[i];
    TORCH_CHECK(q_len >= 0 && cl[i] >= q_len, "sequence ", i, ": need 0 <= q_len (", q_len,
                ") <= context_len (", cl[i], ")");
    const int used_blocks = (cl[i] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= b.max_blocks, "sequence ", i, ": context_len ", cl[i], " needs ", used_blocks,
                " blocks, block_tables has ", b.max_blocks);
    for (int j = 0; j < (q_len ? used_blocks : 0); ++j) {
      const int block = b.block_tables[i * b.max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", i, ": block id ", block, " outside [0, ",
                  num_blocks, ")");
    }
    for (int r = 0; r < q_len; r += tile_rows) {
      const int rows = std::min(tile_rows, q_len - r), first_pos = cl[i] - q_len + r;
      const int64_t cost = (int64_t)rows * (first_pos + rows);
#if defined(NANOSERVE_SIMD_TILES)
      if (whole_sequence_items(b, num_seqs, rows)) {
        items.push_back({i, 0, num_kv_heads, qs[i] + r, qs[i] + r + rows, first_pos, cost * num_kv_heads});
        continue;
      }
#endif
      for (int h = 0; h < num_kv_heads; ++h) items.push_back({i, h, 1, qs[i] + r, qs[i] + r + rows, first_pos, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });

  switch (key_cache.scalar_type()) {
    case at::kFloat: run_items<float>(b, key_cache, value_cache, items); break;
    case at::kBFloat16: run_items<at::BFloat16>(b, key_cache, value_cache, items); break;
    default: run_items<at::Half>(b, key_cache, value_cache, items); break;
  }
  return out.to(query.scalar_type());
}

// Copy row i of key/value into slot slot_mapping[i] of the caches (converted to the cache dtype).
// Slot -1 means "do not cache this row" (vLLM's pad slot): static batching's padding rows.
void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                           at::Tensor value_cache, const at::Tensor& slot_mapping) {
  check_kv_cache(key_cache, value_cache);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row = key_cache.size(2) * key_cache.size(3);           // elements per slot
  const auto k = key.to(key_cache.scalar_type()).contiguous();
  const auto v = value.to(value_cache.scalar_type()).contiguous();
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t n = slots.numel();
  TORCH_CHECK(k.numel() == n * row && v.numel() == n * row,
              "key/value must be [num_tokens, num_kv_heads, head_dim] matching slot_mapping and the cache");
  const int64_t* s = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(s[i] >= -1 && s[i] < num_slots, "slot_mapping[", i, "] = ", s[i], " outside [0, ", num_slots,
                ") (or -1: not cached)");
  const int64_t bytes = row * k.element_size();
  const auto* ks = static_cast<const char*>(k.const_data_ptr());
  const auto* vs = static_cast<const char*>(v.const_data_ptr());
  auto* kd = static_cast<char*>(key_cache.mutable_data_ptr());
  auto* vd = static_cast<char*>(value_cache.mutable_data_ptr());
  // Split past 16 rows (a grain of 16): each row's 2 x row_bytes land in lines that are cold (a
  // slot is written once), and two cores keep twice as many of those misses in flight.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (s[i] < 0) continue;
      std::memcpy(kd + s[i] * bytes, ks + i * bytes, bytes);
      std::memcpy(vd + s[i] * bytes, vs + i * bytes, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(nanoserve_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start_loc, float scale, bool batch_invariant=False) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(nanoserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
}
