// The GPU path's fused per-layer ops, one launch each, with fused_ops.py's PyTorch versions as
// their oracle (the same contract as csrc/fused_cpu.cpp, registered beside the attention ops as
// torch.ops.nanoserve_cuda.{rms_norm, add_rms_norm_, rope_, silu_and_mul}):
//   norm_kernel          out = RMSNorm(x) * weight, or first residual = residual + x (stored, rounded
//                        to the dtype: what the next layer sees) and out = RMSNorm(residual) * weight;
//                        one block per row, the sum of squares in float32 through a block reduction.
//   rope_kernel          rotate-half RoPE in place on the first num_heads heads (q, then k) of each
//                        qkv row, cos/sin float32 [num_tokens, head_dim / 2].
//   silu_and_mul_kernel  out = silu(gate) * up for gate_up = [gate | up].
// Rows may be strided (qkv and the norms' inputs are rows of wider tensors); elements of a row are
// contiguous. Math in float32, rounded once on store. Only plain pointers and ints cross the
// boundary (the extern "C" launchers at the end); the PyTorch side is
// csrc/paged_attention_cuda_binding.cpp. Without nvcc it compiles against csrc/cuda_emu.h.
#include "cuda_common.h"

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

struct NormShared {
  float warp_sums[kWarps];
  float inv_rms;
};

__device__ __forceinline__ float warp_sum(float x) {
  for (int mask = 16; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

template <typename T, typename W>
__global__ void norm_kernel(const T* x, int64_t x_stride, T* residual, int64_t r_stride, const W* weight, float eps,
                            T* out, int64_t out_stride, int hidden) {
  const T* xr = x + int64_t(blockIdx.x) * x_stride;
  T* rr = residual ? residual + int64_t(blockIdx.x) * r_stride : nullptr;
  T* o = out + int64_t(blockIdx.x) * out_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float(xr[i]);
    if (rr) {                                   // each thread rereads only what it wrote
      rr[i] = from_float<T>(v + to_float(rr[i]));
      v = to_float(rr[i]);
    }
    ss += v * v;
  }
  NormShared& s = block_shared<NormShared>();
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) s.warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += s.warp_sums[w];
    s.inv_rms = 1.f / sqrtf(total / hidden + eps);
  }
  __syncthreads();
  const float inv = s.inv_rms;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = rr ? to_float(rr[i]) : to_float(xr[i]);
    o[i] = from_float<T>(v * inv * to_float(weight[i]));
  }
}

template <typename T>
__global__ void rope_kernel(T* qkv, int64_t stride, const float* cos, const float* sin, int num_heads, int head_dim) {
  const int half = head_dim / 2;
  T* row = qkv + int64_t(blockIdx.x) * stride;
  const float* c = cos + int64_t(blockIdx.x) * half;
  const float* s = sin + int64_t(blockIdx.x) * half;
  for (int k = threadIdx.x; k < num_heads * half; k += blockDim.x) {
    T* x = row + (k / half) * head_dim;
    const int i = k % half;
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    x[i] = from_float<T>(x1 * c[i] - x2 * s[i]);
    x[i + half] = from_float<T>(x2 * c[i] + x1 * s[i]);
  }
}

template <typename T>
__global__ void silu_and_mul_kernel(const T* gate_up, int64_t stride, T* out, int inter) {
  const T* g = gate_up + int64_t(blockIdx.x) * stride;
  T* o = out + int64_t(blockIdx.x) * inter;
  for (int i = threadIdx.x; i < inter; i += blockDim.x) {
    const float gate = to_float(g[i]);
    o[i] = from_float<T>(gate / (1.f + expf(-gate)) * to_float(g[i + inter]));
  }
}

template <typename T, typename W>
void launch_norm(const void* x, int64_t xs, void* residual, int64_t rs, const void* weight, float eps, void* out,
                 int64_t os, int rows, int hidden, cudaStream_t stream) {
  auto* kernel = norm_kernel<T, W>;
  LAUNCH_KERNEL(kernel, dim3(rows), dim3(kThreads), stream, static_cast<const T*>(x), xs, static_cast<T*>(residual),
                rs, static_cast<const W*>(weight), eps, static_cast<T*>(out), os, hidden);
}

template <typename T>
void dispatch_weight(int w_dtype, const void* x, int64_t xs, void* residual, int64_t rs, const void* weight,
                     float eps, void* out, int64_t os, int rows, int hidden, cudaStream_t stream) {
  if (w_dtype == kFloat32) launch_norm<T, float>(x, xs, residual, rs, weight, eps, out, os, rows, hidden, stream);
  else launch_norm<T, T>(x, xs, residual, rs, weight, eps, out, os, rows, hidden, stream);
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

// out[r] = RMSNorm(x[r] (+ residual[r], stored into residual when residual is not null)) * weight.
// weight: float32 or x's dtype. out may be x.
extern "C" const char* rms_norm_launch(const void* x, int64_t x_stride, void* residual, int64_t r_stride,
                                       const void* weight, float eps, void* out, int64_t out_stride, int rows,
                                       int hidden, int dtype, int w_dtype, void* stream) {
  if (!valid_dtype(dtype) || (w_dtype != kFloat32 && w_dtype != dtype)) return "unsupported dtype";
  if (rows == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == kFloat32) dispatch_weight<float>(w_dtype, x, x_stride, residual, r_stride, weight, eps, out, out_stride, rows, hidden, s);
  if (dtype == kBFloat16) dispatch_weight<bf16>(w_dtype, x, x_stride, residual, r_stride, weight, eps, out, out_stride, rows, hidden, s);
  if (dtype == kFloat16) dispatch_weight<f16>(w_dtype, x, x_stride, residual, r_stride, weight, eps, out, out_stride, rows, hidden, s);
  return last_error();
}

extern "C" const char* rope_launch(void* qkv, int64_t stride, const float* cos, const float* sin, int rows,
                                   int num_heads, int head_dim, int dtype, void* stream) {
  if (!valid_dtype(dtype)) return "unsupported dtype";
  if (rows == 0) return nullptr;
  [[maybe_unused]] const auto s = static_cast<cudaStream_t>(stream);   // the emulator runs on no stream
  const dim3 grid(rows), block(kThreads);
  if (dtype == kFloat32) LAUNCH_KERNEL(rope_kernel<float>, grid, block, s, static_cast<float*>(qkv), stride, cos, sin, num_heads, head_dim);
  if (dtype == kBFloat16) LAUNCH_KERNEL(rope_kernel<bf16>, grid, block, s, static_cast<bf16*>(qkv), stride, cos, sin, num_heads, head_dim);
  if (dtype == kFloat16) LAUNCH_KERNEL(rope_kernel<f16>, grid, block, s, static_cast<f16*>(qkv), stride, cos, sin, num_heads, head_dim);
  return last_error();
}

extern "C" const char* silu_and_mul_launch(const void* gate_up, int64_t stride, void* out, int rows, int inter,
                                           int dtype, void* stream) {
  if (!valid_dtype(dtype)) return "unsupported dtype";
  if (rows == 0) return nullptr;
  [[maybe_unused]] const auto s = static_cast<cudaStream_t>(stream);   // the emulator runs on no stream
  const dim3 grid(rows), block(kThreads);
  if (dtype == kFloat32) LAUNCH_KERNEL(silu_and_mul_kernel<float>, grid, block, s, static_cast<const float*>(gate_up), stride, static_cast<float*>(out), inter);
  if (dtype == kBFloat16) LAUNCH_KERNEL(silu_and_mul_kernel<bf16>, grid, block, s, static_cast<const bf16*>(gate_up), stride, static_cast<bf16*>(out), inter);
  if (dtype == kFloat16) LAUNCH_KERNEL(silu_and_mul_kernel<f16>, grid, block, s, static_cast<const f16*>(gate_up), stride, static_cast<f16*>(out), inter);
  return last_error();
}
