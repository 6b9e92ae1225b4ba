// CPU kernels behind model.py's fused per-layer ops: each replaces several PyTorch ops (and the
// temporaries between them) with one pass over the rows.
//   rms_norm(x, weight, eps) -> out                  out = x / rms(x) * weight
//   add_rms_norm_(x, residual, weight, eps)           residual += x; x = rms_norm(residual) (in place)
//   rope_(qkv, cos, sin, num_heads, head_dim)         rotate-half RoPE on the first num_heads heads of
//                                                     every row of qkv, in place (q and k, not v)
//   silu_and_mul(gate_up) -> out                      out = silu(gate) * up, gate_up = [gate | up]
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

// out row = src row (+ add row, stored back into add) normalized, times weight.
template <typename T>
void norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), H = x.size(1);
  const at::Tensor weight_f32 = weight.to(at::kFloat).contiguous();   // a no-op for float32 weights
  const float* w = weight_f32.const_data_ptr<float>();
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
      for (int64_t i = 0; i < H; ++i) store(o + i, buf[i] * inv * w[i]);
    }
  });
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

}  // namespace

TORCH_LIBRARY(nanoserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("silu_and_mul", &silu_and_mul);
}
