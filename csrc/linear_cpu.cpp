// CPU kernels behind model.linear(): out = x @ weight.T + bias.
//
// At small M a linear layer is a stream over its weight matrix, and MKL's sgemm reaches only
// a fraction of memory bandwidth there (it packs for large tiles). The small-M kernels read the
// weight once per call, in the nn.Linear layout [N, K] as stored (no repacking, so tied
// embeddings cost nothing extra): each work item takes kRows weight rows (a few KB, kept in
// L1) and computes them against every activation row, kTileM rows at a time with dot
// products along K. Threads split the output columns (torch's thread count). Past a few rows
// the work is arithmetic, and the last sections are a register-blocked GEMM on a repacked copy
// of the weight (panels), which model.linear takes at every row count: in float32 on AVX2 CPUs,
// in bfloat16 on CPUs with AVX512_BF16 and no AMX, and in every dtype in batch-invariant mode
// (bf16 panels without AVX512_BF16 are the float32 GEMM with the weights widened in registers).
//
// Registered as torch.ops.nanoserve_linear.linear_small_m (float32; needs K % 8 == 0 and
// N % 4 == 0), linear_small_m_bf16 (bfloat16; K % 32 == 0), linear_gguf (float32
// activations against a GGUF file's Q4_1 / Q4_0 / Q8_0 blocks, a sixth / a quarter of the
// float32 bytes, at any M; K % 64 == 0 and N % 2 == 0; 8-bit activations against those blocks or
// against int8 weights are csrc/int8_cpu.cpp's linear_q8, in this library), pack_panels and linear_panels (float32, N % 16 == 0; bfloat16 with
// AVX512_BF16, N % 32 == 0 and K % 2 == 0, without it N % 16 == 0: panel_columns says; float_out:
// float32 out from bf16), contiguous inputs
// (model.linear checks). Built with -O3 -march=native: AVX2+FMA at least, AVX512_BF16 used
// where present.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

namespace {

constexpr int kRows = 4;    // weight rows per tile: their 4 sums end in one hadd tree
constexpr int kTileM = 2;   // activation rows per tile: 4 x 2 = 8 accumulators hide FMA latency

// The 4 horizontal sums of a, b, c, d as one 4-float vector.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// out[m, n0:n0+4] for m in [m0, m0 + MR): dot products of MR activation rows with 4 weight rows.
// w: the tile's kRows weight rows, K floats apart.
template <int MR>
void tile(const float* x, const float* w, const float* bias, float* out,
          int64_t m0, int64_t n0, int64_t K, int64_t N, const float* prefetch) {
  __m256 acc[MR][kRows];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kRows; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if (prefetch) {   // the next tile's kRows * K floats, 2 cache lines per step of 8 floats
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + 4 * k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + 4 * k + 16), _MM_HINT_T0);
    }
    __m256 wv[kRows];
    for (int j = 0; j < kRows; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < kRows; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  __m128 b = bias ? _mm_loadu_ps(bias + n0) : _mm_setzero_ps();
  for (int i = 0; i < MR; ++i)
    _mm_storeu_ps(out + (m0 + i) * N + n0,
                  _mm_add_ps(hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), b));
}

// x [M, K], weight [N, K], bias [N] or None -> [M, N]
at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % 8 == 0 && N % kRows == 0, "need K % 8 == 0 and N % 4 == 0");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // grain: 16 tiles = 64 weight rows, enough work per chunk to amortize the scheduling
  at::parallel_for(0, N / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // the first pass over this tile prefetches the next one; later passes hit L1
      const float* next = t + 1 < end ? wp + (t + 1) * kRows * K : nullptr;
      int64_t m = 0;
      const float* w = wp + t * kRows * K;
      for (; m + kTileM <= M; m += kTileM, next = nullptr) tile<kTileM>(xp, w, b, op, m, t * kRows, K, N, next);
      for (; m < M; ++m, next = nullptr) tile<1>(xp, w, b, op, m, t * kRows, K, N, next);
    }
  });
  return out;
}

// ---- bfloat16: the same stream over the weight, half the bytes ---------------------------------
// With AVX512_BF16 (Zen 4, Cooper Lake and later Xeons) _mm512_dpbf16_ps multiplies 32 bf16
// pairs exactly and accumulates in float32, so x and the weight are used as stored. Elsewhere
// (AVX2) each 8 bf16 become floats with a shift (bf16 is the top half of a float) before an FMA.
// Either way the sums are float32 and rounded to bf16 once, on store. Needs K % 32 == 0.
inline uint16_t round_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

#if defined(__AVX512BF16__)
template <int MR>
void tile_bf16(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out,
               int64_t m0, int64_t n0, int64_t K, int64_t N, const uint16_t* prefetch) {
  __m512 acc[MR][kRows];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kRows; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    if (prefetch) {   // the next tile's kRows rows: 4 x 64 bytes per step of 32 elements
      for (int j = 0; j < kRows; ++j) _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * K + k), _MM_HINT_T0);
    }
    __m512bh wv[kRows];
    for (int j = 0; j < kRows; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (n0 + j) * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * K + k);
      for (int j = 0; j < kRows; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kRows; ++j)
      out[(m0 + i) * N + n0 + j] = round_to_bf16(_mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.f));
}
#else
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <int MR>
void tile_bf16(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out,
               int64_t m0, int64_t n0, int64_t K, int64_t N, const uint16_t* prefetch) {
  __m256 acc[MR][kRows];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kRows; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if (prefetch && k % 32 == 0)
      for (int j = 0; j < kRows; ++j) _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * K + k), _MM_HINT_T0);
    __m256 wv[kRows];
    for (int j = 0; j < kRows; ++j) wv[j] = bf16x8(w + (n0 + j) * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = bf16x8(x + (m0 + i) * K + k);
      for (int j = 0; j < kRows; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float sums[4];
    _mm_storeu_ps(sums, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    for (int j = 0; j < kRows; ++j) out[(m0 + i) * N + n0 + j] = round_to_bf16(sums[j] + (bias ? bias[n0 + j] : 0.f));
  }
}
#endif

// x [M, K] bf16, weight [N, K] bf16, bias [N] (any float dtype) or None -> [M, N] bf16
at::Tensor linear_small_m_bf16(const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % 32 == 0 && N % kRows == 0, "need K % 32 == 0 and N % 4 == 0");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must be [N]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? b32.const_data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.const_data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  at::parallel_for(0, N / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* next = t + 1 < end ? wp + (t + 1) * kRows * K : nullptr;
      int64_t m = 0;
      for (; m + kTileM <= M; m += kTileM, next = nullptr) tile_bf16<kTileM>(xp, wp, b, op, m, t * kRows, K, N, next);
      for (; m < M; ++m, next = nullptr) tile_bf16<1>(xp, wp, b, op, m, t * kRows, K, N, next);
    }
  });
  return out;
}

// ---- GGUF blocks: the weight as the file stores it, 5 or 8.5 bits per value -----------------
// At a few rows the float32 stream above is bound by memory: 4 bytes per weight per step. The
// default model's GGUF stores its layers as Q4_1 and its embedding (tied to lm_head) as Q8_0,
// blocks of 32 values along K:
//   Q4_1: value = d * q + m, q in 0..15;   Q8_0: value = d * q, q int8;   Q4_0: d * (q - 8),
// which weights.read_gguf_blocks hands over as Q4_1 with m = -8 d (the same floats, exactly).
// d and m are float16 in the file, held here as float32 [N, K / 32]. Each block is unpacked once
// into registers as the float32 weights themselves, fma(d, q, m) or d * q (d * q is exact, so
// this is bit for bit the weight that weights.convert_gguf wrote), and that one unpacked block
// is applied to up to kGgufTileM activation rows before the next is read: 1 to 8 rows cost one
// pass over the blocks, 16 rows two. Each product is the float32 reference's; only the order of
// the float32 sums along K differs.
//
// weights.write_gguf_blocks lays q out in 32-bit lanes, so that 8 consecutive values come out
// of one 256-bit load with a shift and a mask, with no byte shuffles:
//   Q4_1: 8 uint32 per pair of blocks (64 values); lane L holds value 8i + L in bits 4i..4i+3
//   Q8_0: 8 int32 per block; lane L holds value 8i + L in bits 8i..8i+7
constexpr int kGgufTileM = 8;   // rows per unpacked block: 8 sums + raw, w, x, d, m, mask = 14 ymm

inline __m256i load8x32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// values 8j..8j+7 of block b (as float32 weights) from its raw lanes v; Half = b % 2 (Q4_1's
// pair of blocks shares the lanes: the low or high 16 bits)
template <bool Q4, int Half>
inline __m256 block_weights(__m256i v, int j, __m256 vd, __m256 vm) {
  if constexpr (Q4) {
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, 16 * Half + 4 * j), _mm256_set1_epi32(0xF));
    return _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(q), vm);
  } else {   // each byte moved to the top, then shifted down with its sign
    const __m256i q = _mm256_srai_epi32(_mm256_sllv_epi32(v, _mm256_set1_epi32(24 - 8 * j)), 24);
    return _mm256_mul_ps(vd, _mm256_cvtepi32_ps(q));
  }
}

inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}

// out[m, n] += x[m, k] . w[n, k] over blocks [b0, b1) (k in [32 b0, 32 b1)) for m in [m0, m0 + MR),
// w[n] from its blocks (qs, d, mn: row n's). A sums per row, A chains of FMAs in flight: at 1 or 2 rows one sum per row
// would wait on the FMA latency (5 cycles on Zen) at every step.
template <bool Q4, int MR>
void tile_gguf(const float* x, const uint8_t* qs, const float* d, const float* mn, int64_t b0, int64_t b1,
               float* out, int64_t m0, int64_t n, int64_t K, int64_t N) {
  constexpr int A = MR == 1 ? 4 : MR < 4 ? 2 : 1;
  __m256 acc[MR][A];
  for (int i = 0; i < MR; ++i)
    for (int a = 0; a < A; ++a) acc[i][a] = _mm256_setzero_ps();
  const float* xm = x + m0 * K;
  auto block = [&](int64_t b, auto half) {   // half: b % 2, as a compile-time constant
    constexpr int H = decltype(half)::value;
    const __m256i v = load8x32(qs + (Q4 ? 16 * (b - H) : 32 * b));
    const __m256 vd = _mm256_broadcast_ss(d + b), vm = Q4 ? _mm256_broadcast_ss(mn + b) : vd;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 w = block_weights<Q4, H>(v, j, vd, vm);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        acc[i][j % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + i * K + 32 * b + 8 * j), w, acc[i][j % A]);
    }
  };
  for (int64_t b = b0; b < b1; b += 2) {   // b0 and b1 are even
    block(b, std::integral_constant<int, 0>{});
    block(b + 1, std::integral_constant<int, 1>{});
  }
  for (int i = 0; i < MR; ++i) {
    __m256 s = acc[i][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[i][a]);
    out[(m0 + i) * N + n] += hsum8(s);
  }
}

template <bool Q4>
using GgufTile = void (*)(const float*, const uint8_t*, const float*, const float*, int64_t, int64_t, float*,
                          int64_t, int64_t, int64_t, int64_t);
template <bool Q4, int... MR>
constexpr std::array<GgufTile<Q4>, sizeof...(MR)> gguf_tiles(std::integer_sequence<int, MR...>) {
  return {tile_gguf<Q4, MR + 1>...};
}
template <bool Q4>   // [rows - 1]
constexpr auto kGgufTiles = gguf_tiles<Q4>(std::make_integer_sequence<int, kGgufTileM>{});

// rows [m0, m1) of x against weight rows [n0, n1), kGgufTileM rows per unpacking of a block.
// (Tried and slower on Zen 1: K in strips of 256 so x's strip stays in L1, which breaks the
// weight rows' sequential stream; two weight rows per tile to halve the loads of x, at 4 rows.)
template <bool Q4>
void rows_gguf(const float* x, const uint8_t* qs, const float* d, const float* mn, float* out,
               int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = qs + n * (Q4 ? K / 2 : K);
    for (int64_t m = m0; m < m1; m += kGgufTileM)
      kGgufTiles<Q4>[std::min<int64_t>(kGgufTileM, m1 - m) - 1](x, q, d + n * nb, Q4 ? mn + n * nb : nullptr,
                                                                  0, nb, out, m, n, K, N);
  }
}

// x [M, K] float32; qs uint8 [N, K / 2] with mins (Q4_1, Q4_0) or int8 [N, K] without (Q8_0);
// scales and mins float32 [N, K / 32]; bias [N] or None -> [M, N] float32. Any M: rows come in
// blocks whose x stays in L2 (~384 KB) while every weight row streams past it once per block.
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  const bool q4 = mins.has_value();
  TORCH_CHECK(K % 64 == 0, "need K % 64 == 0");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == (q4 ? K / 2 : K) &&
              qs.scalar_type() == (q4 ? at::kByte : at::kChar), "qs must be uint8 [N, K/2] (Q4_1) or int8 [N, K] (Q8_0), in lanes");
  for (const at::Tensor* t : {&scales, q4 ? &*mins : &scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N * (K / 32),
                "scales and mins must be float32 [N, K/32]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bias must be float32 [N]");
  at::Tensor out = bias.has_value() ? bias->view({1, N}).repeat({M, 1}) : at::zeros({M, N}, x.options());
  const float *xp = x.const_data_ptr<float>(), *dp = scales.const_data_ptr<float>();
  const float* mp = q4 ? mins->const_data_ptr<float>() : nullptr;
  const auto* qp = static_cast<const uint8_t*>(qs.const_data_ptr());
  float* op = out.mutable_data_ptr<float>();
  const int64_t block = std::max<int64_t>(kGgufTileM, 98304 / K / kGgufTileM * kGgufTileM);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    // grain: 64 weight rows per chunk, as in linear_small_m
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      if (q4) rows_gguf<true>(xp, qp, dp, mp, op, m0, m1, n0, n1, K, N);
      else rows_gguf<false>(xp, qp, dp, mp, op, m0, m1, n0, n1, K, N);
    });
  }
  return out;
}

// ---- float32 GEMM on weight panels: from a few rows up ------------------------------------
// Past a few rows a linear layer is bound by arithmetic, and on AVX2 oneDNN's float32 matmul
// reaches about 60% of the FMA peak on this model's shapes (its lm_head, 49k columns, less).
// This is the classic register-blocked GEMM instead: the weight is repacked once into panels
// of 16 output columns, [N / 16, K, 16], so that the 16 weights of one k are one 64-byte line;
// a 6 x 16 tile of the output lives in 12 registers while k runs over the whole of K: per k,
// 2 loads of weights, 6 broadcasts of x and 12 FMAs. Threads split the panels; rows come in
// blocks small enough for x to stay in L2 while every panel streams past it once per block.
constexpr int kPanel = 16;   // output columns per panel: two 8-float vectors
constexpr int kTile = 6;     // rows per register tile: 6 x 2 accumulators + 2 weights + 1 x = 15 of 16 ymm

// The 16 weights of one k as two float vectors: float32 panels as stored; bfloat16 panels (CPUs
// without AVX512_BF16) widened in registers, bf16 being the top half of a float32.
inline void load_panel_k(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_load_ps(p);
  w1 = _mm256_load_ps(p + 8);
}
inline void load_panel_k(const uint16_t* p, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}

// 16 float32 sums to out: as they are, or rounded to bf16 (nearest even, as round_to_bf16)
inline void store16(float* out, __m256 a, __m256 b) {
  _mm256_storeu_ps(out, a);
  _mm256_storeu_ps(out + 8, b);
}
inline void store16(uint16_t* out, __m256 a, __m256 b) {
  alignas(32) float sums[16];
  _mm256_store_ps(sums, a);
  _mm256_store_ps(sums + 8, b);
  for (int j = 0; j < 16; ++j) out[j] = round_to_bf16(sums[j]);
}

// out[0:MR, 0:16] = x[0:MR, :] @ panel + bias, rows of x K apart, of out N apart. While the first
// row block passes over a panel, the next panel is prefetched one line per k. x is float32 (bf16
// x is widened once per call); each output's sum runs over k = 0 .. K-1 in order whatever MR is,
// so a row's result never depends on the rows beside it (batch-invariant: cpu_linear.py).
template <int MR, typename WT, typename OT>
void panel_tile(const float* __restrict x, const WT* __restrict panel, const float* bias,
                OT* __restrict out, int64_t K, int64_t N, const WT* next_panel) {
  // named accumulators, not an array: __m256 may alias any float, so GCC would store an array
  // back to the stack on every k
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    if (next_panel && (sizeof(WT) == 4 || k % 2 == 0))   // one 64-byte line per 16 (bf16: 32) weights
      _mm_prefetch(reinterpret_cast<const char*>(next_panel + kPanel * k), _MM_HINT_T0);
    __m256 w0, w1;
    load_panel_k(panel + kPanel * k, w0, w1);
#define ROW(i)                                                     \
    if constexpr (MR > i) {                                        \
      const __m256 a = _mm256_broadcast_ss(x + i * K + k);         \
      c##i##0 = _mm256_fmadd_ps(a, w0, c##i##0);                   \
      c##i##1 = _mm256_fmadd_ps(a, w1, c##i##1);                   \
    }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#define STORE(i) \
  if constexpr (MR > i) store16(out + i * N, _mm256_add_ps(c##i##0, b0), _mm256_add_ps(c##i##1, b1));
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

template <typename WT, typename OT>
using PanelTile = void (*)(const float*, const WT*, const float*, OT*, int64_t, int64_t, const WT*);
template <typename WT, typename OT>   // [rows]
constexpr PanelTile<WT, OT> kPanelTiles[kTile + 1] = {
    nullptr, panel_tile<1, WT, OT>, panel_tile<2, WT, OT>, panel_tile<3, WT, OT>,
    panel_tile<4, WT, OT>, panel_tile<5, WT, OT>, panel_tile<6, WT, OT>};

// x [M, K] float32 against panels [P, K, 16] of WT -> out [M, P * 16] of OT
template <typename WT, typename OT>
void run_panels(const float* xp, const WT* wp, const float* b, OT* op, int64_t M, int64_t K, int64_t P) {
  const int64_t N = P * kPanel;
  // rows per block: x's block within ~384 KB, so it stays in a Zen 3 core's 512 KB L2 beside
  // the panel streaming past (a batch-64 decode step is one block at K = 576 and 1536)
  const int64_t block = std::max<int64_t>(kTile, 98304 / K / kTile * kTile);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const WT* panel = wp + p * K * kPanel;
        const WT* next = p + 1 < end ? panel + K * kPanel : nullptr;
        for (int64_t m = m0; m < m1; m += kTile, next = nullptr) {
          const int rows = int(std::min<int64_t>(kTile, m1 - m));
          kPanelTiles<WT, OT>[rows](xp + m * K, panel, b ? b + p * kPanel : nullptr, op + m * N + p * kPanel, K, N, next);
        }
      }
    });
  }
}

// ---- bfloat16 GEMM on weight panels: AVX512_BF16 dot products ----------------------------------
// The same GEMM in bf16, where the CPU has AVX512_BF16 (Zen 4, Cooper Lake and later Xeons):
// _mm512_dpbf16_ps multiplies 16 pairs of bf16 by 16 pairs and adds each pair's two products to
// one of 16 float32 sums. So the panels hold 32 output columns with K's values in pairs,
// [N / 32, K / 2, 32, 2]: one pair of k is two 64-byte lines, 16 columns each. A 12 x 32 tile of
// the output lives in 24 of the 32 registers while k runs over K: per pair of k, 2 loads of
// weights, 12 broadcasts of a pair of x and 24 dot products. At a few rows this reads the weight
// at memory speed, where oneDNN reaches about 60% of it; past 64 rows it runs near the dot
// products' peak. Sums stay float32 and are rounded to bf16 once, on store.
constexpr int kPanelBf16 = 32;   // output columns per panel: two 16-float vectors
constexpr int kTileBf16 = 12;    // rows per register tile: 12 x 2 accumulators + 2 weights + 1 x

#if defined(__AVX512BF16__)
// out[0:MR, 0:32] = x[0:MR, :] @ panel + bias, rows of x K apart, of out N apart; out is bf16
// (uint16_t) or, for logits, the float32 sums themselves (Out = float)
template <int MR, typename Out>
void panel_tile_bf16(const uint16_t* __restrict x, const uint16_t* __restrict panel, const float* bias,
                     Out* __restrict out, int64_t K, int64_t N) {
  __m512 c[MR][2];   // fully unrolled below, so GCC keeps them in registers
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm512_setzero_ps();
  const int32_t* pairs = reinterpret_cast<const int32_t*>(x);   // x's rows as pairs of bf16, K / 2 per row
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(panel + 2 * kPanelBf16 * kk);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(panel + 2 * kPanelBf16 * kk + 32);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {   // x's pair (k, k + 1) of row i, in every 32-bit lane
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pairs[i * (K / 2) + kk]);
      c[i][0] = _mm512_dpbf16_ps(c[i][0], a, w0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], a, w1);
    }
  }
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_storeu_ps(out + i * N, _mm512_add_ps(c[i][0], b0));
      _mm512_storeu_ps(out + i * N + 16, _mm512_add_ps(c[i][1], b1));
    } else {   // round to nearest even, as round_to_bf16
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * N), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[i][0], b0)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * N + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c[i][1], b1)));
    }
  }
}

template <typename Out>
using PanelTileBf16 = void (*)(const uint16_t*, const uint16_t*, const float*, Out*, int64_t, int64_t);
template <typename Out, int... MR>
constexpr std::array<PanelTileBf16<Out>, sizeof...(MR)> panel_tiles_bf16(std::integer_sequence<int, MR...>) {
  return {panel_tile_bf16<MR + 1, Out>...};
}
template <typename Out>   // [rows - 1]
constexpr auto kPanelTilesBf16 = panel_tiles_bf16<Out>(std::make_integer_sequence<int, kTileBf16>{});

template <typename Out>
void linear_panels_bf16(const at::Tensor& x, const at::Tensor& panels, const float* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = P * kPanelBf16;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.const_data_ptr());
  auto* op = reinterpret_cast<Out*>(out.mutable_data_ptr());
  // rows per block: x's block within ~384 KB, in L2 beside the panel streaming past
  const int64_t block = std::max<int64_t>(kTileBf16, 196608 / K / kTileBf16 * kTileBf16);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t m = m0; m < m1; m += kTileBf16)
          kPanelTilesBf16<Out>[std::min<int64_t>(kTileBf16, m1 - m) - 1](
              xp + m * K, wp + p * K * kPanelBf16, bias ? bias + p * kPanelBf16 : nullptr, op + m * N + p * kPanelBf16, K, N);
    });
  }
}
#endif

// Where bf16 panels hold pairs of k for AVX512_BF16 dot products ([N / 32, K / 2, 32, 2]); elsewhere
// they are the float32 layout in bf16 ([N / 16, K, 16]), widened in registers.
#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif

// output columns per panel for a dtype on this build (cpu_linear.py checks N against it)
int64_t panel_columns(bool bf16) { return bf16 && kBf16Pairs ? kPanelBf16 : kPanel; }

// weight [N, K] -> panels: float32 [N / 16, K, 16]; bfloat16 [N / 32, K / 2, 32, 2] with
// AVX512_BF16, else [N / 16, K, 16]; a copy made once per weight (cpu_linear.pack_weight)
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "weight must be float32 or bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  // 64-byte aligned by torch's CPU allocator, so each k's (each pair's) 16 weights are one cache line
  if (weight.scalar_type() == at::kBFloat16 && kBf16Pairs) {
    TORCH_CHECK(N % kPanelBf16 == 0 && K % 2 == 0, "bfloat16 panels need N % 32 == 0 and K % 2 == 0");
    return weight.reshape({N / kPanelBf16, kPanelBf16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  TORCH_CHECK(N % kPanel == 0, "need N % 16 == 0");
  return weight.reshape({N / kPanel, kPanel, K}).transpose(1, 2).contiguous();
}

// x [M, K], panels from pack_panels (same dtype), bias [N] or None -> [M, N] in x's dtype, or in
// float32 with float_out (bf16 x: the float32 sums unrounded, as logits want them)
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         bool float_out) {
  const bool bf16 = x.scalar_type() == at::kBFloat16, pairs = bf16 && kBf16Pairs;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              "x must be contiguous float32 or bfloat16 [M, K]");
  TORCH_CHECK(panels.scalar_type() == x.scalar_type() && panels.is_contiguous() &&
              (pairs ? panels.dim() == 4 && panels.size(1) * 2 == x.size(1) && panels.size(2) == kPanelBf16 && panels.size(3) == 2
                     : panels.dim() == 3 && panels.size(1) == x.size(1) && panels.size(2) == kPanel),
              "panels must be pack_panels' [N/16, K, 16] or (bfloat16 with AVX512_BF16) [N/32, K/2, 32, 2], in x's dtype");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = P * (pairs ? kPanelBf16 : kPanel);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.const_data_ptr()) % (pairs ? 64 : 32) == 0,
              "panels must be ", pairs ? 64 : 32, "-byte aligned (aligned loads)");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && (bf16 || (bias->scalar_type() == at::kFloat && bias->is_contiguous()))),
              "bias must be [N] (float32 for float32 x)");
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  const at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias.has_value() ? b32.const_data_ptr<float>() : nullptr;
#if defined(__AVX512BF16__)
  if (pairs) {
    if (float_out) linear_panels_bf16<float>(x, panels, b, out);
    else linear_panels_bf16<uint16_t>(x, panels, b, out);
    return out;
  }
#endif
  if (!bf16) {
    run_panels(x.const_data_ptr<float>(), panels.const_data_ptr<float>(), b, out.mutable_data_ptr<float>(), M, K, P);
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat);   // bf16 -> float32 is exact; once per call, not per panel
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.const_data_ptr());
  if (float_out) run_panels(xf.const_data_ptr<float>(), wp, b, out.mutable_data_ptr<float>(), M, K, P);
  else run_panels(xf.const_data_ptr<float>(), wp, b, reinterpret_cast<uint16_t*>(out.mutable_data_ptr()), M, K, P);
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoserve_linear, m) {
  m.def("linear_small_m(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("linear_small_m", c10::DispatchKey::CPU, TORCH_FN(linear_small_m));
  m.def("linear_small_m_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("linear_small_m_bf16", c10::DispatchKey::CPU, TORCH_FN(linear_small_m_bf16));
  m.def("linear_gguf(Tensor x, Tensor qs, Tensor scales, Tensor? mins, Tensor? bias) -> Tensor");
  m.impl("linear_gguf", c10::DispatchKey::CPU, TORCH_FN(linear_gguf));
  m.def("panel_columns(bool bf16) -> int", TORCH_FN(panel_columns));
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.impl("pack_panels", c10::DispatchKey::CPU, TORCH_FN(pack_panels));
  m.def("linear_panels(Tensor x, Tensor panels, Tensor? bias, bool float_out=False) -> Tensor");
  m.impl("linear_panels", c10::DispatchKey::CPU, TORCH_FN(linear_panels));
}
