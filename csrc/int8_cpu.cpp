// Integer matmuls on the CPU: 8-bit activations against 8- or 4-bit weights, exact int32 sums.
//
// Owns torch.ops.nanoserve_linear.linear_q8 (registered into linear_cpu.cpp's library) and q8_dot
// (which integer dot product this build runs). Three weight kinds, all packed at load by
// cpu_linear.pack_q8 into one layout:
//   int8 (quantization="int8", dynamic W8A8): w[n, k] ~ sw[n] q[n, k], q int8 per output channel;
//        x quantized per row and group of G values (a multiple of 32): p = round(x * 127 / amax);
//   Q8_0 / Q4_1 / Q4_0 (quantization="gguf", a GGUF's own blocks of 32 along K): w = d q (+ m);
//        x quantized per block of 32 as llama.cpp's Q8_1: p = round(x / dx), dx = amax / 127, with
//        the block's sum sx = dx sum p for the mins' term (Q4_0 is Q4_1 with m = -8 d).
//   out[m, n] = sum over groups (in order) of scale * float(exact int32 sum_k p w) (+ m sx) + bias,
// so nothing in a row depends on another row, on M, or on which dot product the CPU has: the
// int32 sums are exact on both paths, and the float ops after them are the same intrinsics.
//
// Layout (why it is fast): 8 output columns per panel, K in quads. One 256-bit vector holds 4
// consecutive k of each of 8 columns, lane c = column c; x's 4 bytes at those k are broadcast, and
// one dot product (vpdpbusd with AVX512_VNNI+VL; vpmaddubsw on AVX2) adds 4 products into each
// column's own int32 lane. No horizontal sums, and the per-block float work (convert, scale, add)
// is one instruction for 8 columns x 32 products. The unsigned operand is the weight:
//   8-bit: w + 128 as uint8, [P, K/32, 8 quads, 8 columns, 4] (256 bytes per panel and block);
//   Q4:    nibbles 0..15, byte (t, c, j) = value 4t+j | value 4(t+4)+j << 4, [P, K/32, 4, 8, 4];
//   d, m: float16 [P, K/32, 8] (the file's own halves); int8: sw float32 [P * 8], zeros pad N.
// VNNI: dpbusd(acc, w + 128, p) = isum + 128 sum p, so acc starts at -128 sum p (x's group sums).
// AVX2: Q4's products are at most 2 * 15 * 127 per int16 pair, so a block's 8 vpmaddubsw add in
// int16 (8 * 3810 < 32767) and one vpmaddwd against ones widens them; 8-bit weights move their
// sign onto x (vpsignb) and multiply |w| (at most 2 * 128 * 127 per pair: exact), one vpmaddwd
// per quad.
// Tiles: up to kTileM rows of x per pass over a panel's K (each loaded weight vector feeds every
// row), panels split over threads (at::parallel_for), rows in blocks that keep x's bytes in L2.
// AVX2: each row's int32 sum is one chain of adds pinned in a register (keep): left free, GCC rebuilt a
// block's 8 quads x 8 rows as a tree of partial sums that spilled AVX2's 16 ymm registers. One row
// alone (decode) splits its chain over even and odd quads; the weights are prefetched 2 KB ahead.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

enum Kind { kInt8 = 0, kQ8 = 1, kQ4 = 2 };
constexpr int kCols = 8;     // output columns per panel (int32 lanes of a 256-bit vector)
constexpr int kTileM = 8;    // rows of x per pass over a panel (AVX2 too, once nothing spills: 6 times the same)
// bytes of weights prefetched ahead of the block being read: a panel's blocks, then the next
// panel's, are one stream per thread, and at 1 row the pass waits on memory (~10% faster here)
constexpr int64_t kAhead = 2048;

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i bcast4(const int8_t* p) {   // x's 4 bytes at p in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// A register the compiler must hold as is here: the accumulators' adds stay one chain per row, in
// order, instead of GCC reassociating a block's products into a tree whose partial sums (8 quads x
// MR rows) outnumber AVX2's 16 ymm registers and spill to the stack.
// (AVX2 only: vpdpbusd's 5-cycle latency wants the tree's parallel chains, and 32 registers hold it.)
inline void keep(__m256i& v) {
  if constexpr (!kVnni) asm("" : "+x"(v));
}
inline __m256 halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// One row's x, quantized: bytes per 32 values, the scale and exact sum of each scale group.
struct Rows {
  const int8_t* xq;     // [M, Kp]
  const float* dx;      // [M, ng]: each group's scale
  const float* sx;      // [M, ng]: dx * sum p (Q4's mins term)
  const int32_t* ps;    // [M, ng]: sum p (VNNI's offset correction)
  int64_t Kp, ng;
};

// 8 values of x -> 8 int8 at q (round half to even: the default rounding mode), their sum added to
// sum. gguf: x / d (the division, as llama.cpp and the tests' oracle take it); int8: x * inv,
// clamped to +-127.
inline void quantize8(const float* x, bool gguf, __m256 d, __m256 inv, int8_t* q, __m256i& sum) {
  const __m256 v = _mm256_loadu_ps(x);
  __m256 r = _mm256_round_ps(gguf ? _mm256_div_ps(v, d) : _mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (!gguf) r = _mm256_min_ps(_mm256_set1_ps(127.f), _mm256_max_ps(_mm256_set1_ps(-127.f), r));
  const __m256i i = _mm256_cvtps_epi32(r);
  sum = _mm256_add_epi32(sum, i);
  const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(p16, p16));
}

// x [M, K] float32 -> Rows, groups of G values (G % 32 == 0; K padded with zeros to Kp). int8:
// p = round-half-even(x * (127 / amax)) clamped to 127, dx = amax / 127; GGUF (llama.cpp's Q8_1):
// p = round-half-even(x / dx). An all-zero group: p = 0, dx = 0. 8 values at a time, the tail of
// a K that 8 does not divide one by one, with the same arithmetic.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, bool gguf, int8_t* xq, float* dx, float* sx,
                   int32_t* ps, int64_t Kp, int64_t ng) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = x + m * K;
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t k0 = g * G, k1 = std::min(K, k0 + G);
        __m256 vmax = _mm256_setzero_ps();
        int64_t k = k0;
        for (; k + 8 <= k1; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(r + k)));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, vmax);
        float amax = 0.f;
        for (float v : lanes) amax = std::max(amax, v);
        for (; k < k1; ++k) amax = std::max(amax, std::abs(r[k]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i vsum = _mm256_setzero_si256();
        int32_t sum = 0;
        if (d > 0.f)
          for (k = k0; k + 8 <= k1; k += 8) quantize8(r + k, gguf, _mm256_set1_ps(d), _mm256_set1_ps(inv), xq + m * Kp + k, vsum);
        else
          for (k = k0; k + 8 <= k1; k += 8) std::memset(xq + m * Kp + k, 0, 8);
        for (; k < k1; ++k) {
          const float q = gguf ? (d > 0.f ? std::nearbyint(r[k] / d) : 0.f)
                               : std::min(127.f, std::max(-127.f, std::nearbyint(r[k] * inv)));
          xq[m * Kp + k] = int8_t(q);
          sum += int32_t(q);
        }
        alignas(32) int32_t parts[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(parts), vsum);
        for (int32_t v : parts) sum += v;
        for (k = std::max(k0, K); k < std::min(Kp, k0 + G); ++k) xq[m * Kp + k] = 0;
        dx[m * ng + g] = d, sx[m * ng + g] = d * float(sum), ps[m * ng + g] = sum;
      }
    }
  });
}

// acc (int32 lanes, or int16 pairs for AVX2 Q4) += the products of quad t of a block's weights
// with each row's x bytes there. w: the quad's 32 weight bytes (Q4: already unpacked to 0..15).
template <Kind KD, int MR>
inline void quad(__m256i (&acc)[MR], __m256i w, const int8_t* const (&xr)[MR], int64_t off) {
  if constexpr (kVnni) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_dpbusd_epi32(acc[i], w, bcast4(xr[i] + off)), keep(acc[i]);
#endif
  } else if constexpr (KD == kQ4) {
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(w, bcast4(xr[i] + off))), keep(acc[i]);
  } else {
    const __m256i s = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80))), a = _mm256_abs_epi8(s);
    for (int i = 0; i < MR; ++i) {
      const __m256i pr = _mm256_maddubs_epi16(a, _mm256_sign_epi8(bcast4(xr[i] + off), s));
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pr, _mm256_set1_epi16(1)));
      keep(acc[i]);
    }
  }
}

// out[m0 + i, 8 cols of panel] for i < MR: w, d, mn: this panel's blocks; sw, bias: its 8 columns
template <Kind KD, int MR>
void tile(const Rows& x, int64_t m0, const uint8_t* w, const uint16_t* d, const uint16_t* mn, const float* sw,
          const float* bias, float* out, int64_t N, int cols, int64_t bpg) {
  constexpr int64_t kBlockBytes = KD == kQ4 ? 128 : 256;
  const int64_t nb = x.Kp / 32;
  const int8_t* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = x.xq + (m0 + i) * x.Kp;
  __m256 accf[MR];
  for (int i = 0; i < MR; ++i) accf[i] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F);
  // One row alone (decode) splits its sum over two accumulators, even and odd quads, so the adds do
  // not wait on one another (vpdpbusd takes 5 cycles); the int32 sums are exact, so this changes no bit.
  constexpr int kSplit = MR == 1 ? 2 : 1;
  for (int64_t g = 0; g < x.ng; ++g) {
    __m256i acc[kSplit][MR];
    for (int i = 0; i < MR; ++i) {   // VNNI's 8-bit weights carry +128: start at -128 sum p
      acc[0][i] = kVnni && KD != kQ4 ? _mm256_set1_epi32(-128 * x.ps[(m0 + i) * x.ng + g]) : _mm256_setzero_si256();
      if constexpr (kSplit == 2) acc[1][i] = _mm256_setzero_si256();
    }
    for (int64_t b = g * bpg; b < std::min(nb, (g + 1) * bpg); ++b) {
      const uint8_t* wb = w + b * kBlockBytes;
      for (int64_t l = 0; l < kBlockBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + kAhead + l), _MM_HINT_T0);
      if constexpr (KD == kQ4) {
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const __m256i v = load32(wb + 32 * t);
          quad<KD, MR>(acc[0], _mm256_and_si256(v, nib), xr, 32 * b + 4 * t);
          quad<KD, MR>(acc[kSplit - 1], _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), xr, 32 * b + 4 * t + 16);
        }
        const __m256 vd = halves(d + b * kCols), vm = halves(mn + b * kCols);
        for (int i = 0; i < MR; ++i) {   // AVX2: each half at most 4 * 3810 in an int16 pair, so their sum fits
          const __m256i a = kSplit == 2 ? (kVnni ? _mm256_add_epi32(acc[0][i], acc[1][i]) : _mm256_add_epi16(acc[0][i], acc[1][i]))
                                        : acc[0][i];
          const __m256i s = kVnni ? a : _mm256_madd_epi16(a, _mm256_set1_epi16(1));
          const int64_t r = (m0 + i) * x.ng + b;
          accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(vd, _mm256_set1_ps(x.dx[r])), accf[i]);
          accf[i] = _mm256_fmadd_ps(vm, _mm256_set1_ps(x.sx[r]), accf[i]);
        }
      } else {
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) quad<KD, MR>(acc[t % kSplit], load32(wb + 32 * t), xr, 32 * b + 4 * t);
        if constexpr (KD == kQ8) {
          const __m256 vd = halves(d + b * kCols);
          for (int i = 0; i < MR; ++i) {
            const __m256i a = kSplit == 2 ? _mm256_add_epi32(acc[0][i], acc[1][i]) : acc[0][i];
            const int64_t r = (m0 + i) * x.ng + b;
            accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(vd, _mm256_set1_ps(x.dx[r])), accf[i]);
          }
        }
      }
    }
    if constexpr (KD == kInt8)
      for (int i = 0; i < MR; ++i) {
        const __m256i a = kSplit == 2 ? _mm256_add_epi32(acc[0][i], acc[1][i]) : acc[0][i];
        accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(x.dx[(m0 + i) * x.ng + g]), accf[i]);
      }
  }
  alignas(32) float tmp[kCols];
  for (int i = 0; i < MR; ++i) {
    // one rounding per step in every instantiation: an explicit FMA, so the compiler has no mul + add to contract
    const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 o = KD == kInt8 ? _mm256_fmadd_ps(accf[i], _mm256_loadu_ps(sw), b) : _mm256_add_ps(accf[i], b);
    if (cols == kCols) {
      _mm256_storeu_ps(out + (m0 + i) * N, o);
    } else {   // the last panel of an N that 8 does not divide (int8)
      _mm256_store_ps(tmp, o);
      std::memcpy(out + (m0 + i) * N, tmp, cols * sizeof(float));
    }
  }
}

template <Kind KD>
using Tile = void (*)(const Rows&, int64_t, const uint8_t*, const uint16_t*, const uint16_t*, const float*,
                      const float*, float*, int64_t, int, int64_t);
template <Kind KD, int... MR>
constexpr std::array<Tile<KD>, sizeof...(MR)> tiles(std::integer_sequence<int, MR...>) {
  return {tile<KD, MR + 1>...};
}
template <Kind KD>   // [rows - 1]
constexpr auto kTiles = tiles<KD>(std::make_integer_sequence<int, kTileM>{});

template <Kind KD>
void run(const Rows& x, int64_t M, const uint8_t* w, const uint16_t* d, const uint16_t* mn, const float* sw,
         const float* bias, float* out, int64_t n, int64_t P, int64_t bpg) {
  const int64_t nb = x.Kp / 32, panel_bytes = nb * (KD == kQ4 ? 128 : 256);
  const int64_t block = std::max<int64_t>(kTileM, 262144 / x.Kp / kTileM * kTileM);   // x's rows within ~256 KB (L2)
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int cols = int(std::min<int64_t>(kCols, n - p * kCols));
        const uint16_t* dp = d ? d + p * nb * kCols : nullptr;
        const uint16_t* mp = mn ? mn + p * nb * kCols : nullptr;
        const float* bp = bias ? bias + p * kCols : nullptr;
        for (int64_t m = m0; m < m1; m += kTileM)
          kTiles<KD>[std::min<int64_t>(kTileM, m1 - m) - 1](x, m, w + p * panel_bytes, dp, mp, sw ? sw + p * kCols : nullptr,
                                                             bp, out + p * kCols, n, cols, bpg);
      }
    });
  }
}

// x float32 [M, K]; w uint8 [P, Kp/32, 256] (8-bit) or [P, Kp/32, 128] (Q4); d, m float16 [P, Kp/32, 8]
// (GGUF: Q8_0 has d, Q4 both) or sw float32 [P * 8] (int8); n <= P * 8 output columns; group: x's
// values per scale (int8: a multiple of 32, or >= K for one per row; GGUF: 32); bias float32 [n]
// -> [M, n] float32
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& d,
                     const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& sw, int64_t n, int64_t group,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + 31) / 32 * 32, nb = Kp / 32, P = w.size(0);
  const Kind kind = m.has_value() ? kQ4 : d.has_value() ? kQ8 : kInt8;
  TORCH_CHECK((kind == kInt8) == sw.has_value() && (kind != kQ4 || d.has_value()), "give sw (int8), d (Q8_0) or d and m (Q4)");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(1) == nb &&
              w.size(2) == (kind == kQ4 ? 128 : 256), "w must be uint8 [ceil(N/8), ceil(K/32), 256 (or 128: Q4)]");
  TORCH_CHECK(n > (P - 1) * kCols && n <= P * kCols, "n must fit the panels: ceil(n / 8) of them");
  for (const auto* t : {&d, &m})
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kHalf && (*t)->is_contiguous() && (*t)->numel() == P * nb * kCols),
                "d and m must be float16 [ceil(N/8), ceil(K/32), 8]");
  TORCH_CHECK(!sw.has_value() || (sw->scalar_type() == at::kFloat && sw->is_contiguous() && sw->numel() == P * kCols),
              "sw must be float32 [ceil(N/8) * 8]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias must be float32 [N]");
  const int64_t G = group >= K ? Kp : group;
  TORCH_CHECK(G > 0 && G % 32 == 0 && (kind == kInt8 || G == 32), "group must be a multiple of 32 (GGUF: 32) or >= K");
  const int64_t ng = (Kp + G - 1) / G;
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  // one scratch allocation (a decode step makes ~200 of these calls): dx, sx float32 and ps int32
  // [M, ng] each, then x's bytes [M, Kp]
  at::Tensor scratch = at::empty({3 * M * ng * 4 + M * Kp}, x.options().dtype(at::kByte));
  auto* f = reinterpret_cast<float*>(scratch.mutable_data_ptr<uint8_t>());
  auto* ps = reinterpret_cast<int32_t*>(f + 2 * M * ng);
  auto* xq = reinterpret_cast<int8_t*>(ps + M * ng);
  quantize_rows(x.const_data_ptr<float>(), M, K, G, kind != kInt8, xq, f, f + M * ng, ps, Kp, ng);
  const Rows rows{xq, f, f + M * ng, ps, Kp, ng};
  at::Tensor b8;   // a bias padded to the panels, so the last one's 8 loads stay in bounds
  if (bias.has_value()) {
    b8 = at::zeros({P * kCols}, x.options());
    b8.narrow(0, 0, n).copy_(*bias);
  }
  const float* bp = bias.has_value() ? b8.const_data_ptr<float>() : nullptr;
  const auto* wp = w.const_data_ptr<uint8_t>();
  const auto* dp = d.has_value() ? reinterpret_cast<const uint16_t*>(d->const_data_ptr()) : nullptr;
  const auto* mp = m.has_value() ? reinterpret_cast<const uint16_t*>(m->const_data_ptr()) : nullptr;
  const float* swp = sw.has_value() ? sw->const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  if (kind == kQ4) run<kQ4>(rows, M, wp, dp, mp, nullptr, bp, op, n, P, 1);
  else if (kind == kQ8) run<kQ8>(rows, M, wp, dp, nullptr, nullptr, bp, op, n, P, 1);
  else run<kInt8>(rows, M, wp, nullptr, nullptr, swp, bp, op, n, P, G / 32);
  return out;
}

// which integer dot product this build runs (the engine's log and bench.py say it)
std::string q8_dot() { return kVnni ? "AVX512_VNNI vpdpbusd" : "AVX2 vpmaddubsw"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve_linear, m) {
  m.def("linear_q8(Tensor x, Tensor w, Tensor? d, Tensor? m, Tensor? sw, int n, int group, Tensor? bias) -> Tensor");
  m.impl("linear_q8", c10::DispatchKey::CPU, TORCH_FN(linear_q8));
  m.def("q8_dot() -> str", TORCH_FN(q8_dot));
}
