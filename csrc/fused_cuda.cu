// The GPU path's fused per-layer ops, one launch each, with fused_ops.py's PyTorch versions as
// their oracle (the same contract as csrc/fused_cpu.cpp, registered beside the attention ops as
// torch.ops.nanoserve_cuda.{rms_norm, add_rms_norm_, rope_, rope_and_cache_, silu_and_mul}):
//   norm_kernel          out = RMSNorm(x) * weight, or first residual = residual + x (stored, rounded
//                        to the dtype: what the next layer sees) and out = RMSNorm(residual) * weight;
//                        one block per row, the sum of squares in float32 through a block reduction.
//                        norm_vec_kernel: the row in registers as 16-byte pieces (up to 512 threads x 4),
//                        every load issued before any store; norm_kernel, one element at a time, takes
//                        rows that are not whole pieces at 16-byte aligned addresses.
//   rope_kernel          rotate-half RoPE in place on the first num_heads heads (q, then k) of each
//                        qkv row, cos/sin float32 [num_tokens, head_dim / 2]; rope_vec_kernel in
//                        16-byte pieces where head_dim / 2, the stride and the addresses allow.
//   rope_and_cache_kernel  RoPE on q and k fused with the KV write (k rotated, v as is, into the
//                        caches at slot_mapping; -1 skipped): one pass over a token's qkv row instead
//                        of rope_ then reshape_and_cache; _vec in 16-byte pieces when the caches have
//                        qkv's dtype and the layout allows.
//   silu_and_mul_kernel  out = silu(gate) * up for gate_up = [gate | up], on a (rows, pieces) grid:
//                        16-byte pieces (the _vec kernel) where sizes and addresses allow, else elements.
// Rows may be strided (qkv and the norms' inputs are rows of wider tensors); elements of a row are
// contiguous. Math in float32, rounded once on store. Only plain pointers and ints cross the
// boundary (the extern "C" launchers at the end); the PyTorch side is
// csrc/paged_attention_cuda_binding.cpp. Without nvcc it compiles against csrc/cuda_emu.h.
#include "cuda_common.h"

namespace {

constexpr int kThreads = 128;          // the scalar kernels' blocks
constexpr int kNormThreads = 512;      // the vector norm: up to 512 threads x kNormVecs 16-byte pieces a row
constexpr int kNormVecs = 4;           // so a row of up to 16,384 16-bit elements stays in registers
constexpr int kSiluThreads = 256;      // silu_and_mul: one 16-byte piece of gate and of up per thread

struct NormShared {
  float warp_sums[kNormThreads / 32];
};

// N elements of E through 16-byte loads and stores (LDG.E.128 / STG.E.128): the caller checked
// that the address is 16-byte aligned (cuda_emu.h refuses it otherwise, as a GPU faults).
template <typename E, int N>
struct alignas(16) Pack {
  static_assert(N * sizeof(E) % 16 == 0, "a pack is whole 16-byte pieces");
  E v[N];
  __device__ __forceinline__ void load(const E* src) {
#pragma unroll
    for (int c = 0; c < int(N * sizeof(E) / 16); ++c) copy16(v + c * 16 / sizeof(E), src + c * 16 / sizeof(E));
  }
  __device__ __forceinline__ void store(E* dst) const {
#pragma unroll
    for (int c = 0; c < int(N * sizeof(E) / 16); ++c) copy16(dst + c * 16 / sizeof(E), v + c * 16 / sizeof(E));
  }
};

__device__ __forceinline__ float warp_sum(float x) {
  for (int mask = 16; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

// The sum of every thread's `x`, in every thread (one barrier: each thread adds the warps' sums).
__device__ __forceinline__ float block_sum(float x) {
  NormShared& s = block_shared<NormShared>();
  x = warp_sum(x);
  if (threadIdx.x % 32 == 0) s.warp_sums[threadIdx.x / 32] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) total += s.warp_sums[w];
  return total;
}

// One block per row, the row in registers: thread t holds 16-byte pieces t, t + blockDim.x, ...
// (at most kNormVecs). Every load (x, residual, weight) is issued before any store, so a row is
// one round trip to memory; out may be x (each thread rewrites only the pieces it read).
template <typename T, typename W>
__global__ void __launch_bounds__(kNormThreads) norm_vec_kernel(const T* x, int64_t x_stride, T* __restrict__ residual,
                                                                int64_t r_stride, const W* __restrict__ weight,
                                                                float eps, T* out, int64_t out_stride, int hidden) {
  constexpr int V = 16 / sizeof(T);
  const int pieces = hidden / V;
  const T* xr = x + int64_t(blockIdx.x) * x_stride;
  T* rr = residual ? residual + int64_t(blockIdx.x) * r_stride : nullptr;
  T* o = out + int64_t(blockIdx.x) * out_stride;
  Pack<T, V> xv[kNormVecs], rv[kNormVecs];
  Pack<W, V> wv[kNormVecs];
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i >= pieces) break;
    xv[k].load(xr + i * V);
    if (rr) rv[k].load(rr + i * V);
    wv[k].load(weight + i * V);
  }
  float v[kNormVecs][V], ss = 0.f;
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i >= pieces) break;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[k][j] = to_float(xv[k].v[j]);
      if (rr) {                                  // the sum, rounded as stored: what the next layer sees
        rv[k].v[j] = from_float<T>(v[k][j] + to_float(rv[k].v[j]));
        v[k][j] = to_float(rv[k].v[j]);
      }
      ss += v[k][j] * v[k][j];
    }
    if (rr) rv[k].store(rr + i * V);
  }
  const float inv = 1.f / sqrtf(block_sum(ss) / hidden + eps);
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i >= pieces) break;
#pragma unroll
    for (int j = 0; j < V; ++j) xv[k].v[j] = from_float<T>(v[k][j] * inv * to_float(wv[k].v[j]));
    xv[k].store(o + i * V);
  }
}

// Any hidden size, stride or alignment: one element at a time (rows the vector kernel cannot take).
template <typename T, typename W>
__global__ void norm_kernel(const T* x, int64_t x_stride, T* __restrict__ residual, int64_t r_stride,
                            const W* __restrict__ weight, float eps, T* out, int64_t out_stride, int hidden) {
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
  const float inv = 1.f / sqrtf(block_sum(ss) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = rr ? to_float(rr[i]) : to_float(xr[i]);
    o[i] = from_float<T>(v * inv * to_float(weight[i]));
  }
}

template <typename T>
__global__ void rope_kernel(T* qkv, int64_t stride, const float* __restrict__ cos, const float* __restrict__ sin,
                            int num_heads, int head_dim) {
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

// One 16-byte piece of RoPE: elements x[0..V) of a head's first half and x[half..half + V) of its second,
// rotated by cos/sin [V] into y1, y2 (all loads issued before the caller stores).
template <typename T, int V>
__device__ __forceinline__ void rotate_piece(const T* x, int half, const float* cos, const float* sin,
                                             Pack<T, V>& y1, Pack<T, V>& y2) {
  Pack<T, V> x1, x2;
  Pack<float, V> c, s;
  x1.load(x);
  x2.load(x + half);
  c.load(cos);
  s.load(sin);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float a = to_float(x1.v[j]), b = to_float(x2.v[j]);
    y1.v[j] = from_float<T>(a * c.v[j] - b * s.v[j]);
    y2.v[j] = from_float<T>(b * c.v[j] + a * s.v[j]);
  }
}

// The same rotation, 16 bytes at a time: thread k of a row takes elements 8k.. (4k.. in float32) of
// both halves of one head, with their cos and sin (float32: two 16-byte pieces each), loads all four
// (six) pieces before storing two. One pass while num_heads x head_dim / 2 pieces fit 1,024 threads.
template <typename T>
__global__ void rope_vec_kernel(T* qkv, int64_t stride, const float* __restrict__ cos, const float* __restrict__ sin,
                                int num_heads, int head_dim) {
  constexpr int V = 16 / sizeof(T);
  const int half = head_dim / 2, per_head = half / V;
  T* row = qkv + int64_t(blockIdx.x) * stride;
  for (int k = threadIdx.x; k < num_heads * per_head; k += blockDim.x) {
    T* x = row + (k / per_head) * head_dim;
    const int i = k % per_head * V;
    Pack<T, V> y1, y2;
    rotate_piece(x + i, half, cos + int64_t(blockIdx.x) * half + i, sin + int64_t(blockIdx.x) * half + i, y1, y2);
    y1.store(x + i);
    y2.store(x + i + half);
  }
}

// RoPE fused with the KV write (a step's tokens: decode rows and prefill chunks alike): one block
// per token rotates its q and k heads in place, as rope_kernel, and writes the rotated k heads
// (rounded to qkv's dtype first, as rope_ then reshape_and_cache would) and its v heads into the
// caches' slot slot_mapping[token] (-1: not cached). qkv rows: [q heads | k heads | v heads].
template <typename Q, typename KV>
__global__ void rope_and_cache_kernel(Q* qkv, int64_t stride, const float* __restrict__ cos,
                                      const float* __restrict__ sin, KV* __restrict__ key_cache,
                                      KV* __restrict__ value_cache, const int64_t* __restrict__ slot_mapping,
                                      int num_heads, int num_kv_heads, int head_dim) {
  const int half = head_dim / 2, row = num_kv_heads * head_dim;
  const int64_t slot = slot_mapping[blockIdx.x];
  Q* x = qkv + int64_t(blockIdx.x) * stride;
  const float* c = cos + int64_t(blockIdx.x) * half;
  const float* s = sin + int64_t(blockIdx.x) * half;
  for (int k = threadIdx.x; k < (num_heads + num_kv_heads) * half; k += blockDim.x) {
    const int head = k / half, i = k % half;
    Q* h = x + head * head_dim;
    const float x1 = to_float(h[i]), x2 = to_float(h[i + half]);
    const Q y1 = from_float<Q>(x1 * c[i] - x2 * s[i]), y2 = from_float<Q>(x2 * c[i] + x1 * s[i]);
    h[i] = y1;
    h[i + half] = y2;
    if (head >= num_heads && slot >= 0) {
      KV* dst = key_cache + slot * row + (head - num_heads) * head_dim;
      dst[i] = from_float<KV>(to_float(y1));
      dst[i + half] = from_float<KV>(to_float(y2));
    }
  }
  const Q* v = x + (num_heads + num_kv_heads) * head_dim;
  for (int i = threadIdx.x; slot >= 0 && i < row; i += blockDim.x) value_cache[slot * row + i] = from_float<KV>(to_float(v[i]));
}

// The same in 16-byte pieces when the caches have qkv's dtype: thread k < rotated takes a piece of
// both halves of one q or k head (as rope_vec_kernel), the others a piece of the v heads; loads
// before stores. One pass while a token's pieces fit 1,024 threads (Llama-3-8B: 320 + 128).
template <typename T>
__global__ void rope_and_cache_vec_kernel(T* qkv, int64_t stride, const float* __restrict__ cos,
                                          const float* __restrict__ sin, T* __restrict__ key_cache,
                                          T* __restrict__ value_cache, const int64_t* __restrict__ slot_mapping,
                                          int num_heads, int num_kv_heads, int head_dim) {
  constexpr int V = 16 / sizeof(T);
  const int half = head_dim / 2, per_head = half / V, rotated = (num_heads + num_kv_heads) * per_head;
  const int row = num_kv_heads * head_dim;
  const int64_t slot = slot_mapping[blockIdx.x];
  T* x = qkv + int64_t(blockIdx.x) * stride;
  for (int k = threadIdx.x; k < rotated + row / V; k += blockDim.x) {
    if (k >= rotated) {                                        // a piece of v: straight to the cache
      if (slot >= 0) {
        const int i = (k - rotated) * V;
        Pack<T, V> v;
        v.load(x + (num_heads + num_kv_heads) * head_dim + i);
        v.store(value_cache + slot * row + i);
      }
      continue;
    }
    const int head = k / per_head, i = k % per_head * V;
    T* h = x + head * head_dim;
    Pack<T, V> y1, y2;
    rotate_piece(h + i, half, cos + int64_t(blockIdx.x) * half + i, sin + int64_t(blockIdx.x) * half + i, y1, y2);
    y1.store(h + i);
    y2.store(h + i + half);
    if (head >= num_heads && slot >= 0) {
      T* dst = key_cache + slot * row + (head - num_heads) * head_dim;
      y1.store(dst + i);
      y2.store(dst + i + half);
    }
  }
}

__device__ __forceinline__ float silu_mul(float gate, float up) { return gate / (1.f + expf(-gate)) * up; }

// Grid (rows, pieces / kSiluThreads): thread i of a row loads its 16-byte piece of gate and of up,
// then stores one piece of out; [64, 2 x 14,336] is 448 blocks, one wave on an H100.
template <typename T>
__global__ void __launch_bounds__(kSiluThreads) silu_and_mul_vec_kernel(const T* __restrict__ gate_up, int64_t stride,
                                                                        T* __restrict__ out, int inter) {
  constexpr int V = 16 / sizeof(T);
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= inter / V) return;
  const T* g = gate_up + int64_t(blockIdx.x) * stride + i * V;
  Pack<T, V> gate, up;
  gate.load(g);
  up.load(g + inter);
#pragma unroll
  for (int j = 0; j < V; ++j) gate.v[j] = from_float<T>(silu_mul(to_float(gate.v[j]), to_float(up.v[j])));
  gate.store(out + int64_t(blockIdx.x) * inter + i * V);
}

// The same grid, one element a thread: sizes, strides or addresses not in whole 16-byte pieces.
template <typename T>
__global__ void __launch_bounds__(kSiluThreads) silu_and_mul_kernel(const T* __restrict__ gate_up, int64_t stride,
                                                                    T* __restrict__ out, int inter) {
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const T* g = gate_up + int64_t(blockIdx.x) * stride;
  out[int64_t(blockIdx.x) * inter + i] = from_float<T>(silu_mul(to_float(g[i]), to_float(g[i + inter])));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The vector kernel when the row is whole 16-byte pieces at 16-byte aligned addresses and fits
// kNormThreads x kNormVecs of them; else the scalar one.
template <typename T, typename W>
void launch_norm(const void* x, int64_t xs, void* residual, int64_t rs, const void* weight, float eps, void* out,
                 int64_t os, int rows, int hidden, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const int pieces = hidden / V;
  const bool vec = hidden % V == 0 && pieces <= kNormThreads * kNormVecs && xs % V == 0 && os % V == 0 &&
                   (!residual || rs % V == 0) && aligned16(x) && aligned16(out) && aligned16(weight) &&
                   (!residual || aligned16(residual));
  const T* in = static_cast<const T*>(x);
  T* res = static_cast<T*>(residual);
  const W* w = static_cast<const W*>(weight);
  T* o = static_cast<T*>(out);
  if (vec) {
    const int threads = min(kNormThreads, (pieces + 31) / 32 * 32);   // one piece each while they last
    LAUNCH_KERNEL_NAMED("norm_vec", (norm_vec_kernel<T, W>), dim3(rows), dim3(threads), stream, in, xs, res, rs, w,
                        eps, o, os, hidden);
  } else {
    LAUNCH_KERNEL_NAMED("norm", (norm_kernel<T, W>), dim3(rows), dim3(kThreads), stream, in, xs, res, rs, w, eps, o,
                        os, hidden);
  }
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

template <typename T>
void launch_rope(void* qkv, int64_t stride, const float* cos, const float* sin, int rows, int num_heads, int head_dim,
                 cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const int half = head_dim / 2;
  const bool vec = half % V == 0 && stride % V == 0 && half % 4 == 0 && aligned16(qkv) && aligned16(cos) &&
                   aligned16(sin);
  T* x = static_cast<T*>(qkv);
  if (vec) {
    const int pieces = num_heads * half / V;
    const dim3 block(min(1024, (pieces + 31) / 32 * 32));
    LAUNCH_KERNEL_NAMED("rope_vec", rope_vec_kernel<T>, dim3(rows), block, stream, x, stride, cos, sin, num_heads,
                        head_dim);
  } else {
    LAUNCH_KERNEL_NAMED("rope", rope_kernel<T>, dim3(rows), dim3(kThreads), stream, x, stride, cos, sin, num_heads,
                        head_dim);
  }
}

extern "C" const char* rope_launch(void* qkv, int64_t stride, const float* cos, const float* sin, int rows,
                                   int num_heads, int head_dim, int dtype, void* stream) {
  if (!valid_dtype(dtype)) return "unsupported dtype";
  if (rows == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == kFloat32) launch_rope<float>(qkv, stride, cos, sin, rows, num_heads, head_dim, s);
  if (dtype == kBFloat16) launch_rope<bf16>(qkv, stride, cos, sin, rows, num_heads, head_dim, s);
  if (dtype == kFloat16) launch_rope<f16>(qkv, stride, cos, sin, rows, num_heads, head_dim, s);
  return last_error();
}

template <typename Q, typename KV>
void launch_rope_and_cache(void* qkv, int64_t stride, const float* cos, const float* sin, void* key_cache,
                           void* value_cache, const int64_t* slots, int rows, int num_heads, int num_kv_heads,
                           int head_dim, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(Q);
  const int half = head_dim / 2;
  const bool vec = std::is_same_v<Q, KV> && half % V == 0 && stride % V == 0 && half % 4 == 0 && aligned16(qkv) &&
                   aligned16(cos) && aligned16(sin) && aligned16(key_cache) && aligned16(value_cache);
  Q* x = static_cast<Q*>(qkv);
  KV* kc = static_cast<KV*>(key_cache);
  KV* vc = static_cast<KV*>(value_cache);
  if constexpr (std::is_same_v<Q, KV>) {
    if (vec) {
      const int pieces = (num_heads + num_kv_heads) * half / V + num_kv_heads * head_dim / V;
      const dim3 block(min(1024, (pieces + 31) / 32 * 32));
      LAUNCH_KERNEL_NAMED("rope_and_cache_vec", rope_and_cache_vec_kernel<Q>, dim3(rows), block, stream, x, stride,
                          cos, sin, kc, vc, slots, num_heads, num_kv_heads, head_dim);
      return;
    }
  }
  LAUNCH_KERNEL_NAMED("rope_and_cache", (rope_and_cache_kernel<Q, KV>), dim3(rows), dim3(kThreads), stream, x, stride,
                      cos, sin, kc, vc, slots, num_heads, num_kv_heads, head_dim);
}

template <typename Q>
void dispatch_rope_and_cache(int kv_dtype, void* qkv, int64_t stride, const float* cos, const float* sin,
                             void* key_cache, void* value_cache, const int64_t* slots, int rows, int nh, int nkv,
                             int hd, cudaStream_t s) {
  if (kv_dtype == kFloat32) launch_rope_and_cache<Q, float>(qkv, stride, cos, sin, key_cache, value_cache, slots, rows, nh, nkv, hd, s);
  if (kv_dtype == kBFloat16) launch_rope_and_cache<Q, bf16>(qkv, stride, cos, sin, key_cache, value_cache, slots, rows, nh, nkv, hd, s);
  if (kv_dtype == kFloat16) launch_rope_and_cache<Q, f16>(qkv, stride, cos, sin, key_cache, value_cache, slots, rows, nh, nkv, hd, s);
}

// qkv [rows, (num_heads + 2 num_kv_heads) x head_dim] (rows `stride` apart): q and k rotated in place,
// k and v written to the caches [num_slots, num_kv_heads x head_dim] at slots[r] (-1: skipped).
extern "C" const char* rope_and_cache_launch(void* qkv, int64_t stride, const float* cos, const float* sin,
                                             void* key_cache, void* value_cache, const int64_t* slots, int rows,
                                             int num_heads, int num_kv_heads, int head_dim, int dtype, int kv_dtype,
                                             void* stream) {
  if (!valid_dtype(dtype) || !valid_dtype(kv_dtype)) return "unsupported dtype";
  if (rows == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == kFloat32) dispatch_rope_and_cache<float>(kv_dtype, qkv, stride, cos, sin, key_cache, value_cache, slots, rows, num_heads, num_kv_heads, head_dim, s);
  if (dtype == kBFloat16) dispatch_rope_and_cache<bf16>(kv_dtype, qkv, stride, cos, sin, key_cache, value_cache, slots, rows, num_heads, num_kv_heads, head_dim, s);
  if (dtype == kFloat16) dispatch_rope_and_cache<f16>(kv_dtype, qkv, stride, cos, sin, key_cache, value_cache, slots, rows, num_heads, num_kv_heads, head_dim, s);
  return last_error();
}

template <typename T>
void launch_silu_and_mul(const void* gate_up, int64_t stride, void* out, int rows, int inter, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = inter % V == 0 && stride % V == 0 && aligned16(gate_up) && aligned16(out);
  const int per_row = vec ? inter / V : inter;                   // threads a row needs
  const dim3 grid(rows, (per_row + kSiluThreads - 1) / kSiluThreads), block(kSiluThreads);
  const T* in = static_cast<const T*>(gate_up);
  T* o = static_cast<T*>(out);
  if (vec) LAUNCH_KERNEL_NAMED("silu_and_mul_vec", silu_and_mul_vec_kernel<T>, grid, block, stream, in, stride, o, inter);
  else LAUNCH_KERNEL_NAMED("silu_and_mul", silu_and_mul_kernel<T>, grid, block, stream, in, stride, o, inter);
}

extern "C" const char* silu_and_mul_launch(const void* gate_up, int64_t stride, void* out, int rows, int inter,
                                           int dtype, void* stream) {
  if (!valid_dtype(dtype)) return "unsupported dtype";
  if (rows == 0) return nullptr;
  if (int64_t(inter) > int64_t(65535) * kSiluThreads) return "intermediate size too large for gridDim.y";
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == kFloat32) launch_silu_and_mul<float>(gate_up, stride, out, rows, inter, s);
  if (dtype == kBFloat16) launch_silu_and_mul<bf16>(gate_up, stride, out, rows, inter, s);
  if (dtype == kFloat16) launch_silu_and_mul<f16>(gate_up, stride, out, rows, inter, s);
  return last_error();
}
