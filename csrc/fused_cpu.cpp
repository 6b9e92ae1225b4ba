// CPU kernels behind model.py's fused per-layer ops and the sampler's greedy pick: each replaces
// several PyTorch ops (and the temporaries between them) with one pass over the rows.
//   rms_norm(x, weight, eps) -> out                  out = x / rms(x) * weight
//   add_rms_norm_(x, residual, weight, eps)           residual += x; x = rms_norm(residual) (in place)
//   rope_(qkv, cos, sin, num_heads, head_dim)         rotate-half RoPE on the first num_heads heads of
//                                                     every row of qkv, in place (q and k, not v)
//   rope_and_cache_(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads, head_dim)
//                                                     rope_ on q and k, then k and v into their cache slots
//                                                     (a bfloat16 cache under float32 qkv too)
//   silu_and_mul(gate_up) -> out                      out = silu(gate) * up, gate_up = [gate | up]
//   argmax(logits) -> int64 [rows]                    torch.argmax(logits, -1): the sampler's greedy pick
//   top_p_(logits, top_p)                             nucleus filter in place: -inf past each row's top_p
//   exp_sub_max_(x, scale)                            x = exp((x - max(x)) * scale), per row, in place
//   mask_below_(x, floor)                             x = -inf where x < its row's floor (top-k, min-p)
//   kth_largest(x, k) -> float32 [rows]               each row's k-th largest value: the top-k floor
// float32 or bfloat16 tensors; math in float32, rounded once on store (PyTorch's reference rounds
// after every op in bf16, so bf16 results differ by about one bf16 unit). The loops are written
// for the compiler's vectorizer (-O3 -march=native): no intrinsics, so any x86-64 or ARM CPU builds
// them. Parallel over rows with torch's threads. Registered as torch.ops.nanoserve_fused.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

namespace {

// std::bit_cast is C++20, and torch before 2.13 builds extensions as C++17
template <class To, class From>
inline To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return bit_cast<float>(uint32_t(x.x) << 16); }
inline void store(float* p, float x) { *p = x; }
inline void store(at::BFloat16* p, float x) {   // round to nearest even, as torch does (no NaN here)
  const uint32_t u = bit_cast<uint32_t>(x);
  p->x = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// e^x for x <= 0 (paged_attention_cpu.cpp's polynomial): vectorizes, unlike std::exp.
inline float exp_nonpositive(float x) {
  const float y = std::max(x * 1.44269504f, -126.f);
  const float n = (y + 12582912.f) - 12582912.f, f = y - n;   // round to nearest: 1.5 * 2^23 pushes the fraction out
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  return x < -87.f ? 0.f : p * bit_cast<float>((int32_t(n) + 127) << 23);
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be 2-D with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

// the sampler's ops: float32 logits only (the model's logits are float32 whatever its dtype)
void check_float32_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              name, " must be float32 [rows, vocab] with contiguous rows");
}

// out row = src row (+ add row, stored back into add) normalized, times weight (float32 or T,
// read as stored: converting a bf16 weight per call cost a tensor, 61 per decode step).
template <typename T, typename W>
void norm_rows(const at::Tensor& x, at::Tensor* residual, const W* w, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), H = x.size(1);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x.const_data_ptr<T>() + r * x.stride(0);
      float ss = 0.f;
      if (residual) {   // the sum is rounded to T first: that is the residual the next layer sees
        T* rr = residual->mutable_data_ptr<T>() + r * residual->stride(0);
        for (int64_t i = 0; i < H; ++i) {
          store(rr + i, to_float(xr[i]) + to_float(rr[i]));
          buf[i] = to_float(rr[i]);
        }
      } else {
        for (int64_t i = 0; i < H; ++i) buf[i] = to_float(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / H + float(eps));
      T* o = out.mutable_data_ptr<T>() + r * out.stride(0);
      for (int64_t i = 0; i < H; ++i) store(o + i, buf[i] * inv * to_float(w[i]));
    }
  });
}

template <typename T>
void norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor& out) {
  const at::Tensor w = weight.contiguous();   // parameters are: no copy
  if (w.scalar_type() == at::kFloat) norm_rows<T, float>(x, residual, w.const_data_ptr<float>(), eps, out);
  else norm_rows<T, T>(x, residual, w.const_data_ptr<T>(), eps, out);
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK((weight.scalar_type() == at::kFloat || weight.scalar_type() == x.scalar_type()) &&
              weight.dim() == 1 && weight.numel() == x.size(1), "weight must be [hidden], float32 or x's dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) norm_rows<float>(x, nullptr, weight, eps, out);
  else norm_rows<at::BFloat16>(x, nullptr, weight, eps, out);
  return out;
}

void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x in shape and dtype");
  if (x.scalar_type() == at::kFloat) norm_rows<float>(x, &residual, weight, eps, x);
  else norm_rows<at::BFloat16>(x, &residual, weight, eps, x);
}

template <typename T>
void rope_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos.const_data_ptr<float>() + t * half;
      const float* s = sin.const_data_ptr<float>() + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv.mutable_data_ptr<T>() + t * qkv.stride(0) + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          store(x + i, x1 * c[i] - x2 * s[i]);
          store(x + i + half, x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "num_heads x head_dim exceeds qkv's row");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == qkv.size(0) &&
                t->size(1) == head_dim / 2, "cos/sin must be float32 [num_tokens, head_dim / 2]");
  if (qkv.scalar_type() == at::kFloat) rope_rows<float>(qkv, cos, sin, num_heads, head_dim);
  else rope_rows<at::BFloat16>(qkv, cos, sin, num_heads, head_dim);
}

// RoPE on q and k, then each row's k and v into its cache slot: what rope_ and paged_attention's
// reshape_and_cache do, in one pass over the row while it is in cache, and without the copies the
// cache write made of k and v (strided views of qkv). The cache is [blocks, block_size, kv_heads,
// head_dim], so a slot is one contiguous run of kv_heads x head_dim values, in qkv's dtype or in
// bfloat16 under float32 qkv (the CPU integer paths' cache: engine.kv_dtype_auto), rounded on store.
template <typename T, typename C>
void rope_cache_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                     at::Tensor& value_cache, const int64_t* slots, int64_t heads, int64_t kv_heads, int64_t D) {
  rope_rows<T>(qkv, cos, sin, heads + kv_heads, D);
  const int64_t row = kv_heads * D;
  T* qkv_data = qkv.mutable_data_ptr<T>();
  C* kd = key_cache.mutable_data_ptr<C>();
  C* vd = value_cache.mutable_data_ptr<C>();
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;                 // -1: a padding row, not cached
      const T* k = qkv_data + t * qkv.stride(0) + heads * D;
      if constexpr (std::is_same_v<T, C>) {
        std::memcpy(kd + slots[t] * row, k, row * sizeof(T));
        std::memcpy(vd + slots[t] * row, k + row, row * sizeof(T));
      } else {
        C* kc = kd + slots[t] * row;
        C* vc = vd + slots[t] * row;
        for (int64_t i = 0; i < row; ++i) store(kc + i, to_float(k[i]));
        for (int64_t i = 0; i < row; ++i) store(vc + i, to_float(k[row + i]));
      }
    }
  });
}

void rope_and_cache_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_cache,
                     at::Tensor value_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK((num_heads + 2 * num_kv_heads) * head_dim == qkv.size(1), "qkv must be [num_tokens, (num_heads + 2 "
              "num_kv_heads) head_dim]");
  const bool to_bf16 = qkv.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  for (const auto* c : {&key_cache, &value_cache})
    TORCH_CHECK(c->dim() == 4 && c->is_contiguous() && c->scalar_type() == key_cache.scalar_type() &&
                (c->scalar_type() == qkv.scalar_type() || to_bf16) && c->size(2) == num_kv_heads && c->size(3) == head_dim,
                "key/value cache must be contiguous [blocks, block_size, num_kv_heads, head_dim] in qkv's dtype "
                "(or bfloat16 under float32 qkv)");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == qkv.size(0), "slot_mapping must have one slot per row of qkv");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* s = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(s[i] >= -1 && s[i] < num_slots, "slot_mapping[", i, "] = ", s[i], " outside [0, ", num_slots,
                ") (or -1: not cached)");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == qkv.size(0) &&
                t->size(1) == head_dim / 2, "cos/sin must be float32 [num_tokens, head_dim / 2]");
  if (to_bf16)
    rope_cache_rows<float, at::BFloat16>(qkv, cos, sin, key_cache, value_cache, s, num_heads, num_kv_heads, head_dim);
  else if (qkv.scalar_type() == at::kFloat)
    rope_cache_rows<float, float>(qkv, cos, sin, key_cache, value_cache, s, num_heads, num_kv_heads, head_dim);
  else
    rope_cache_rows<at::BFloat16, at::BFloat16>(qkv, cos, sin, key_cache, value_cache, s, num_heads, num_kv_heads,
                                                head_dim);
}

template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t I = out.size(1);
  const T* src = gate_up.const_data_ptr<T>();     // data pointers outside the loops: the calls that
  T* dst = out.mutable_data_ptr<T>();             // fetch them can throw, which stops vectorization
  const int64_t src_stride = gate_up.stride(0), dst_stride = out.stride(0);
  at::parallel_for(0, gate_up.size(0), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(I);
    float* buf = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* g = src + r * src_stride;
      const T* u = g + I;
      T* o = dst + r * dst_stride;
      for (int64_t i = 0; i < I; ++i) buf[i] = to_float(g[i]);
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float x = buf[i];
        const float e = exp_nonpositive(-std::fabs(x));          // e^-|x|: never overflows
        buf[i] = x * ((x >= 0.f ? 1.f : e) / (1.f + e));          // x * sigmoid(x)
      }
      for (int64_t i = 0; i < I; ++i) store(o + i, buf[i] * to_float(u[i]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_rows<float>(gate_up, out);
  else silu_mul_rows<at::BFloat16>(gate_up, out);
  return out;
}

// ---- greedy argmax -------------------------------------------------------------------------
// torch.argmax over a [64, 49152] row block took 3 ms on 2 AVX2 cores (a scalar loop tracking
// index and value), 2% of a batch-64 decode step; a max alone vectorizes and took 0.15 ms. So each
// 64-logit block is first only asked, vectorized, whether it beats the running maximum; the rare
// block that does is scanned in order. Same answer as torch: the first index of the maximum, and a
// NaN counts as the maximum (the first NaN wins).
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  constexpr int64_t B = 64;
  float m = -INFINITY;
  int64_t best = 0;
  int nan = 0;   // int, not bool: GCC vectorizes an int OR over compares and not a bool one (7x)
  auto scan = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      if (to_float(x[i]) > m) m = to_float(x[i]), best = i;
  };
  int64_t i = 0;
  for (; i + B <= V; i += B) {
    int up = 0;
    for (int64_t j = 0; j < B; ++j) {
      const float v = to_float(x[i + j]);
      up |= v > m;
      nan |= v != v;
    }
    if (up) scan(i, i + B);
  }
  for (int64_t j = i; j < V; ++j) nan |= to_float(x[j]) != to_float(x[j]);
  scan(i, V);
  if (nan)
    for (int64_t j = 0; j < V; ++j)
      if (to_float(x[j]) != to_float(x[j])) return j;
  return best;
}

at::Tensor argmax(const at::Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.size(1) > 0, "logits must have at least one column");
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (logits.scalar_type() == at::kFloat) o[r] = argmax_row(logits.const_data_ptr<float>() + r * stride, V);
      else o[r] = argmax_row(logits.const_data_ptr<at::BFloat16>() + r * stride, V);
    }
  });
  return out;
}

// ---- top-p (nucleus) filter -----------------------------------------------------------------
// A row keeps its most probable tokens, in order, until their mass reaches top_p (the token that
// crosses it too). Sorting all 49152 logits of each row for that took torch 140 ms at batch 64, more
// than the decode step. Only the crossing token has to be found: each probability's top 12 bits
// (exponent and 3 mantissa bits, an order-preserving key for floats >= 0) name one of 1017 buckets;
// the buckets' masses, summed from the top, find the crossing bucket, and only its tokens are sorted.
// Order as the sort-based reference: higher logit first, equal logits by lower index (the reference's
// sort leaves ties in no particular order). Masses in double; the reference sums in float32.
constexpr int kTopPBuckets = (0x3F800000 >> 20) + 1;   // keys of [0, 1]: 1.0f is 0x3F800000

inline int prob_key(float e) { return int(bit_cast<uint32_t>(e) >> 20); }

// The largest of x[0:V] (NaNs skipped), in 16 running maxima: a reduction that vectorizes.
float row_max(const float* x, int64_t V) {
  float lanes[16];
  std::fill(lanes, lanes + 16, -INFINITY);
  int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    for (int k = 0; k < 16; ++k) lanes[k] = x[i + k] > lanes[k] ? x[i + k] : lanes[k];
  for (; i < V; ++i) lanes[0] = x[i] > lanes[0] ? x[i] : lanes[0];
  return *std::max_element(lanes, lanes + 16);
}

// f(j) for each j with pred(e[j]), in order. The test runs 64 at a time, vectorized, and only a
// block with a hit is walked one by one: most of a row's tokens are masked or far from the crossing.
template <class Pred, class F>
void for_each_where(const float* e, int64_t V, Pred pred, F f) {
  int64_t i = 0;
  for (; i + 64 <= V; i += 64) {
    int hit = 0;
    for (int64_t j = i; j < i + 64; ++j) hit |= pred(e[j]);
    if (hit)
      for (int64_t j = i; j < i + 64; ++j)
        if (pred(e[j])) f(j);
  }
  for (; i < V; ++i)
    if (pred(e[i])) f(i);
}

void top_p_row(float* x, int64_t V, double top_p, std::vector<float>& e, std::vector<double>& mass,
               std::vector<int64_t>& bucket) {
  const float m = row_max(x, V);
  if (!(m > -INFINITY)) return;                          // every token masked
  for (int64_t i = 0; i < V; ++i) e[i] = exp_nonpositive(x[i] - m);   // -inf -> 0
  // 4 histograms, token i into i % 4: neighbours often share a bucket, and one histogram would chain
  // every add on the one before it through memory. Masked tokens (e = 0) have no mass to add.
  std::fill(mass.begin(), mass.end(), 0.0);
  for_each_where(e.data(), V, [](float v) { return v > 0.f; }, [&](int64_t j) { mass[4 * prob_key(e[j]) + j % 4] += e[j]; });
  double total = 0.0;   // folded in place: bucket b's sum lands at b, below the 4b..4b+3 still to read
  for (int b = 0; b < kTopPBuckets; ++b)
    total += mass[b] = mass[4 * b] + mass[4 * b + 1] + mass[4 * b + 2] + mass[4 * b + 3];
  const double target = top_p * total;
  int cross = kTopPBuckets - 1;
  double before = 0.0;                                   // mass of the buckets above `cross`
  for (; cross > 0 && before + mass[cross] < target; --cross) before += mass[cross];
  // the crossing bucket as a range of probabilities [lo, hi): plain compares from here on
  const float lo = bit_cast<float>(uint32_t(cross) << 20), hi = bit_cast<float>(uint32_t(cross + 1) << 20);
  bucket.clear();
  for_each_where(e.data(), V, [=](float v) { return v >= lo && v < hi; }, [&](int64_t j) { bucket.push_back(j); });
  std::stable_sort(bucket.begin(), bucket.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  size_t keep = 0;
  for (; keep < bucket.size() && before < target; ++keep) before += e[bucket[keep]];
  for (size_t j = keep; j < bucket.size(); ++j) x[bucket[j]] = -INFINITY;
  for (int64_t i = 0; i < V; ++i) x[i] = e[i] < lo ? -INFINITY : x[i];
}

void top_p_(at::Tensor& logits, const at::Tensor& top_p) {
  check_float32_rows(logits, "logits");
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == logits.size(0) && top_p.scalar_type() == at::kFloat,
              "top_p must be float32 [rows]");
  const int64_t V = logits.size(1);
  const at::Tensor p = top_p.contiguous();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V);
    std::vector<double> mass(4 * kTopPBuckets);
    std::vector<int64_t> bucket;
    for (int64_t r = begin; r < end; ++r) {
      const float pr = p.const_data_ptr<float>()[r];
      if (pr < 1.f) top_p_row(logits.mutable_data_ptr<float>() + r * logits.stride(0), V, pr, e, mass, bucket);
    }
  });
}

// ---- the sampler's unnormalized softmax ---------------------------------------------------------
// exp((x - max) * scale): what the inverse CDF searches. torch.exp took 3 ms on [64, 49152] finite
// logits on 2 AVX2 cores, 6.5 ms where most were -inf (top-k, top-p) and 21 ms where many underflow
// (low temperatures): it leaves the vector path for those. The polynomial costs the same everywhere.
// A row with every logit -inf becomes NaN, as in torch.
void exp_sub_max_(at::Tensor& x, const at::Tensor& scale) {
  check_float32_rows(x, "x");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == x.size(0) && scale.scalar_type() == at::kFloat,
              "scale must be float32 [rows]");
  const int64_t V = x.size(1);
  const at::Tensor s = scale.contiguous();
  at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x.mutable_data_ptr<float>() + r * x.stride(0);
      const float m = row_max(xr, V), sr = s.const_data_ptr<float>()[r];
      if (!(m > -INFINITY)) {
        std::fill(xr, xr + V, NAN);
        continue;
      }
      for (int64_t i = 0; i < V; ++i) xr[i] = exp_nonpositive((xr[i] - m) * sr);
    }
  });
}

// x < floor -> -inf, in place: a select the vectorizer takes. masked_fill with a comparison's
// boolean mask made two passes and a temporary, 3 ms on [64, 49152].
void mask_below_(at::Tensor& x, const at::Tensor& floor) {
  check_float32_rows(x, "x");
  TORCH_CHECK(floor.numel() == x.size(0) && floor.scalar_type() == at::kFloat, "floor must be float32 [rows]");
  const int64_t V = x.size(1);
  const at::Tensor f = floor.contiguous();
  at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x.mutable_data_ptr<float>() + r * x.stride(0);
      const float fr = f.const_data_ptr<float>()[r];
      for (int64_t i = 0; i < V; ++i) xr[i] = xr[i] < fr ? -INFINITY : xr[i];
    }
  });
}

// ---- top-k floor --------------------------------------------------------------------------------
// Each row's k-th largest logit, ties counted (torch.topk(k).values[:, -1]): the floor top-k masks
// below. torch.topk's cost grows with k: on [64, 49152] 3 ms at k = 50, 38 ms at 10,000 and 111 ms
// at 40,000, so one request's large top_k slowed every step of every request beside it. Counting
// instead costs the same at any k: an order-preserving key of each float (its bits, flipped so
// that unsigned order is float order) names one of 2048 buckets by its top 11 bits; the counts,
// summed from the top, find the bucket that holds the k-th, and nth_element ranks within it.
inline uint32_t order_key(float v) {
  const uint32_t u = bit_cast<uint32_t>(v);
  return (u >> 31) ? ~u : (u | 0x80000000u);
}

float kth_largest_row(const float* x, int64_t V, int64_t k, std::vector<int32_t>& count, std::vector<float>& bucket) {
  std::fill(count.begin(), count.end(), 0);
  for (int64_t i = 0; i < V; ++i) ++count[4 * (order_key(x[i]) >> 21) + i % 4];   // 4 histograms, as top_p_
  for (int b = 0; b < 2048; ++b) count[b] = count[4 * b] + count[4 * b + 1] + count[4 * b + 2] + count[4 * b + 3];
  int64_t above = 0;                                     // values in the buckets above `cross`
  int cross = 2047;
  for (; cross > 0 && above + count[cross] < k; --cross) above += count[cross];
  bucket.clear();
  for_each_where(x, V, [=](float v) { return int(order_key(v) >> 21) == cross; }, [&](int64_t j) { bucket.push_back(x[j]); });
  const int64_t rank = k - above - 1;                    // 0: the bucket's largest
  std::nth_element(bucket.begin(), bucket.begin() + rank, bucket.end(), std::greater<float>());
  return bucket[rank];
}

// x [rows, vocab] float32, k [rows] int64 -> float32 [rows]; -inf where k is not in [1, vocab)
at::Tensor kth_largest(const at::Tensor& x, const at::Tensor& k) {
  check_float32_rows(x, "x");
  TORCH_CHECK(k.dim() == 1 && k.size(0) == x.size(0) && k.scalar_type() == at::kLong, "k must be int64 [rows]");
  const int64_t V = x.size(1);
  const at::Tensor kc = k.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options());
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> count(4 * 2048);
    std::vector<float> bucket;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t kr = kc.const_data_ptr<int64_t>()[r];
      out.mutable_data_ptr<float>()[r] = 0 < kr && kr < V
          ? kth_largest_row(x.const_data_ptr<float>() + r * x.stride(0), V, kr, count, bucket) : -INFINITY;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def("rope_and_cache_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) key_cache, Tensor(c!) value_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("top_p_(Tensor(a!) logits, Tensor top_p) -> ()");
  m.def("exp_sub_max_(Tensor(a!) x, Tensor scale) -> ()");
  m.def("mask_below_(Tensor(a!) x, Tensor floor) -> ()");
  m.def("kth_largest(Tensor x, Tensor k) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("rope_and_cache_", &rope_and_cache_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax", &argmax);
  m.impl("top_p_", &top_p_);
  m.impl("exp_sub_max_", &exp_sub_max_);
  m.impl("mask_below_", &mask_below_);
  m.impl("kth_largest", &kth_largest);
}
