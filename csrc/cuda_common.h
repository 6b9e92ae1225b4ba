// What every CUDA source under csrc/ shares: the prelude that compiles a file with nvcc or, without
// it, against csrc/cuda_emu.h (LAUNCH_KERNEL, block_shared<T>(), copy16), and the storage types
// (raw 16-bit bf16/fp16 patterns, converted to float on load and rounded to nearest even on store).
// Holds no kernel. Each library includes csrc/cuda_emu.h through here, from any number of files.
#pragma once
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define LAUNCH_KERNEL(kernel, grid, block, stream, ...) kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
template <typename T>
__device__ __forceinline__ T& block_shared() {
  __shared__ T storage;
  return storage;
}
__device__ __forceinline__ void copy16(void* dst, const void* src) {
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
}
#else
#include "cuda_emu.h"
#define LAUNCH_KERNEL(kernel, grid, block, stream, ...) emu::launch(#kernel, kernel, grid, block, __VA_ARGS__)
using emu::copy16;
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

// ---- storage types: raw 16-bit patterns, converted to float on load -----------------------

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };
enum DType { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };   // codes the launchers take

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }
__device__ __forceinline__ float to_float(f16 x) {
#ifdef __CUDACC__
  return __half2float(__ushort_as_half(x.bits));
#else
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return float(h);
#endif
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
#ifdef __CUDACC__
  return bf16{__bfloat16_as_ushort(__float2bfloat16(x))};
#else
  const uint32_t u = __float_as_uint(x);          // round to nearest even, like torch
  return bf16{uint16_t(std::isnan(x) ? 0x7fc0 : (u + 0x7fff + ((u >> 16) & 1)) >> 16)};
#endif
}
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
#ifdef __CUDACC__
  return f16{__half_as_ushort(__float2half(x))};
#else
  const _Float16 h = _Float16(x);
  f16 out;
  std::memcpy(&out.bits, &h, 2);
  return out;
#endif
}

inline bool valid_dtype(int dtype) { return dtype == kFloat32 || dtype == kBFloat16 || dtype == kFloat16; }
