// GGUF blocks against 8-bit activations: integer dot products per block (quantization="gguf").
//
// Owns torch.ops.nanoserve_linear.linear_gguf_q8 (registered into linear_cpu.cpp's library): x
// float32 [M, K] against a GGUF file's Q4_1 / Q4_0 / Q8_0 blocks in weights.write_gguf_blocks' lane
// layout (described in linear_cpu.cpp), any M. As llama.cpp's Q8_1 scheme: each row of x is
// quantized here, per block of 32 values, to int8 q = round-half-even(x / dx) with dx = max |x| / 127,
// and its block sum sx = dx * sum q kept for the mins' term; then per block and output
//   out[m, n] = sum_b (d_b dx_b * isum_b + m_b sx_b) + bias[n],   isum_b = sum_k q_k w_k exact in int32,
// so the result is the rounded x times the weight (d q + m). The sums over blocks run in one fixed
// order whatever M is, and nothing in a row depends on another row: batch-invariant.
//
// Products: unsigned weights (Q4's nibbles 0..15; Q8_0's |q|, its sign moved onto x) times signed x.
// With AVX512_VNNI (+VL) one vpdpbusd does 32 products into 8 int32 sums; on AVX2 vpmaddubsw does
// 32 products into 16 int16 pair sums (at most 2 * 15 * 127, or 2 * 127 * 127 for Q8_0: no
// saturation) and vpmaddwd against ones adds the pairs into int32. Which one is a compile-time
// choice: csrc builds with -march=native into a directory keyed by the CPU's flags (extensions.py),
// and the AVX2 build (-march=x86-64-v3) is built and tested on any x86 CPU.
//
// Q4 layout (a pair of blocks, 64 values, in 32 bytes of lanes): the nibbles are split (v & 15,
// v >> 4 & 15) and interleaved by 16-bit words (vpunpcklwd / vpunpckhwd) into two vectors W1, W2
// whose every 32-bit lane holds 4 values of one block, blocks b and b + 1 alternating by lane. The
// quantizer writes x's 64 bytes in the same order (kQ4Order), so one float vector of scales,
// (d_b dx_b, d_b+1 dx_b+1) repeated, converts a pair of blocks at once. Q8_0: lane L of a block
// holds values L, 8 + L, 16 + L, 24 + L, and x's 32 bytes follow the same order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
// acc + the 4 products of each lane's bytes, u unsigned, s signed
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// byte p of x's 64 (a Q4 pair of blocks) holds value kQ4Order[p]: the order of W1's then W2's bytes,
// from the weight lanes (lo nibble of byte j of lane L: value 16 j + L; hi nibble: 16 j + 8 + L)
// through vpunpck{l,h}wd within each 128-bit half
constexpr std::array<uint8_t, 64> q4_order() {
  std::array<uint8_t, 64> order{};
  int p = 0;
  for (int high = 0; high < 2; ++high)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 4; ++i)
        for (int nib = 0; nib < 2; ++nib)            // word i (+4) of lo, then of hi
          for (int byte = 0; byte < 2; ++byte) {
            const int pos = 16 * h + 2 * (i + 4 * high) + byte;   // byte position in the 32 lane bytes
            order[p++] = uint8_t(16 * (pos % 4) + 8 * nib + pos / 4);
          }
  return order;
}
constexpr auto kQ4Order = q4_order();

// x [M, K] -> xq int8 [M, K] (per 64 values in kQ4Order, or per 32 in Q8_0's lane order), dx and
// sx float32 [M, K / 32]
void quantize_rows(const float* x, int64_t M, int64_t K, bool q4, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* r = x + m * K + 32 * b;
        float amax = 0.f;
        for (int k = 0; k < 32; ++k) amax = std::max(amax, std::abs(r[k]));
        const float d = amax / 127.f;
        float q[32];
        int sum = 0;
        for (int k = 0; k < 32; ++k) q[k] = d > 0.f ? std::nearbyint(r[k] / d) : 0.f;   // |q| <= 127
        for (int k = 0; k < 32; ++k) sum += int(q[k]);
        dx[m * nb + b] = d;
        sx[m * nb + b] = d * float(sum);
        if (q4) {   // the pair's 64 bytes start at the even block
          int8_t* pair = xq + m * K + 32 * (b & ~int64_t(1));
          for (int p = 0; p < 64; ++p)
            if (kQ4Order[p] / 32 == b % 2) pair[p] = int8_t(q[kQ4Order[p] % 32]);
        } else {
          for (int k = 0; k < 32; ++k) xq[m * K + 32 * b + 4 * (k % 8) + k / 8] = int8_t(q[k]);
        }
      }
    }
  });
}

inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 pair_broadcast(const float* p) {   // (p[0], p[1]) in every pair of lanes
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
}
inline __m128 pair_low(const float* p) {   // (p[0], p[1], 0, 0)
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
}

// Weight rows [n0, n0 + NR) (their blocks: q lanes K / 2 or K bytes apart, d and mn nb apart) against
// rows [m0, m0 + MR) of the quantized x; out[m, n] = the sums + bias[n]. A pair of blocks is unpacked
// once for MR rows, and x's bytes and scales are loaded once for NR weight rows. The mins' term is
// added in lanes 0 and 1 of the same 8 float sums. Each row's operations are the same whatever MR
// and NR are.
template <bool Q4, int MR, int NR>
void tile(const int8_t* xq, const float* dx, const float* sx, const uint8_t* q, const float* d, const float* mn,
          const float* bias, float* out, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  const int64_t nb = K / 32, qrow = Q4 ? K / 2 : K;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  if constexpr (Q4) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b += 2) {
      __m256i w1[NR], w2[NR];
      __m256 vd[NR], vm[NR];
      for (int j = 0; j < NR; ++j) {
        const __m256i v = load32(q + j * qrow + 16 * b);
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        w1[j] = _mm256_unpacklo_epi16(lo, hi), w2[j] = _mm256_unpackhi_epi16(lo, hi);
        vd[j] = pair_broadcast(d + j * nb + b), vm[j] = _mm256_zextps128_ps256(pair_low(mn + j * nb + b));
      }
      for (int i = 0; i < MR; ++i) {
        const int8_t* xr = xq + (m0 + i) * K + 32 * b;
        const __m256i x1 = load32(xr), x2 = load32(xr + 32);
        const __m256 vdx = pair_broadcast(dx + (m0 + i) * nb + b);
        const __m256 vsx = _mm256_zextps128_ps256(pair_low(sx + (m0 + i) * nb + b));
        for (int j = 0; j < NR; ++j) {
          const __m256i s = dot_u8s8(dot_u8s8(_mm256_setzero_si256(), w1[j], x1), w2[j], x2);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(vd[j], vdx), acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(vm[j], vsx, acc[i][j]);
        }
      }
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      __m256i v[NR], w[NR];
      __m256 vd[NR];
      for (int j = 0; j < NR; ++j)
        v[j] = load32(q + j * qrow + 32 * b), w[j] = _mm256_abs_epi8(v[j]), vd[j] = _mm256_broadcast_ss(d + j * nb + b);
      for (int i = 0; i < MR; ++i) {
        const __m256i x = load32(xq + (m0 + i) * K + 32 * b);
        const __m256 vdx = _mm256_broadcast_ss(dx + (m0 + i) * nb + b);
        for (int j = 0; j < NR; ++j) {
          const __m256i s = dot_u8s8(_mm256_setzero_si256(), w[j], _mm256_sign_epi8(x, v[j]));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(vd[j], vdx), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[(m0 + i) * N + n0 + j] = hsum8(acc[i][j]) + (bias ? bias[n0 + j] : 0.f);
}

constexpr int kTileM = 4;   // activation rows per pass over the weight rows' blocks
constexpr int kTileN = 2;   // weight rows per tile (N is even)
template <bool Q4>
using Tile = void (*)(const int8_t*, const float*, const float*, const uint8_t*, const float*, const float*,
                      const float*, float*, int64_t, int64_t, int64_t, int64_t);
template <bool Q4, int... MR>
constexpr std::array<Tile<Q4>, sizeof...(MR)> tiles(std::integer_sequence<int, MR...>) {
  return {tile<Q4, MR + 1, kTileN>...};
}
template <bool Q4>   // [rows - 1]
constexpr auto kTiles = tiles<Q4>(std::make_integer_sequence<int, kTileM>{});

// x float32 [M, K]; qs uint8 [N, K / 2] with mins (Q4_1, Q4_0 as Q4_1) or int8 [N, K] without
// (Q8_0), in lanes; scales (and mins) float32 [N, K / 32]; bias [N] or None -> [M, N] float32
at::Tensor linear_gguf_q8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / 32;
  const bool q4 = mins.has_value();
  TORCH_CHECK(K % 64 == 0 && N % kTileN == 0, "need K % 64 == 0 and N % 2 == 0");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == (q4 ? K / 2 : K) &&
              qs.scalar_type() == (q4 ? at::kByte : at::kChar), "qs must be uint8 [N, K/2] (Q4_1) or int8 [N, K] (Q8_0), in lanes");
  for (const at::Tensor* t : {&scales, q4 ? &*mins : &scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N * nb,
                "scales and mins must be float32 [N, K/32]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bias must be float32 [N]");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar)), dsx = at::empty({2, M, nb}, x.options());
  int8_t* xqp = xq.mutable_data_ptr<int8_t>();
  float *dxp = dsx.mutable_data_ptr<float>(), *sxp = dxp + M * nb;
  quantize_rows(x.const_data_ptr<float>(), M, K, q4, xqp, dxp, sxp);
  const float *dp = scales.const_data_ptr<float>(), *mp = q4 ? mins->const_data_ptr<float>() : nullptr;
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  const auto* qp = static_cast<const uint8_t*>(qs.const_data_ptr());
  float* op = out.mutable_data_ptr<float>();
  const int64_t block = std::max<int64_t>(kTileM, 393216 / K / kTileM * kTileM);   // xq's rows within ~384 KB (L2)
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    at::parallel_for(0, N / kTileN, 32, [&](int64_t t0, int64_t t1) {
      for (int64_t n = t0 * kTileN; n < t1 * kTileN; n += kTileN)
        for (int64_t m = m0; m < m1; m += kTileM) {
          const int rows = int(std::min<int64_t>(kTileM, m1 - m));
          if (q4) kTiles<true>[rows - 1](xqp, dxp, sxp, qp + n * (K / 2), dp + n * nb, mp + n * nb, bp, op, m, n, K, N);
          else kTiles<false>[rows - 1](xqp, dxp, sxp, qp + n * K, dp + n * nb, nullptr, bp, op, m, n, K, N);
        }
    });
  }
  return out;
}

// which integer dot product this build runs (cpu_linear's start-up line says it)
std::string gguf_q8_dot() { return kVnni ? "AVX512_VNNI vpdpbusd" : "AVX2 vpmaddubsw + vpmaddwd"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve_linear, m) {
  m.def("linear_gguf_q8(Tensor x, Tensor qs, Tensor scales, Tensor? mins, Tensor? bias) -> Tensor");
  m.impl("linear_gguf_q8", c10::DispatchKey::CPU, TORCH_FN(linear_gguf_q8));
  m.def("gguf_q8_dot() -> str", TORCH_FN(gguf_q8_dot));
}
