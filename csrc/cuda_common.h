// What every CUDA source under csrc/ shares: the prelude that compiles a file with nvcc or, without
// it, against csrc/cuda_emu.h (LAUNCH_KERNEL, block_shared<T>(), copy16, the cp.async trio
// copy16_async (or _or_zero) / async_commit / async_wait<N>, the tensor-core pair mma_m16n8k16 / ldmatrix_x4), and the storage types
// (raw 16-bit bf16/fp16 patterns, converted to float on load and rounded to nearest even on store).
// Holds no kernel. Each library includes csrc/cuda_emu.h through here, from any number of files.
#pragma once
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define LAUNCH_KERNEL(kernel, grid, block, stream, ...) kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#define LAUNCH_KERNEL_NAMED(name, kernel, grid, block, stream, ...) kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
template <typename T>
__device__ __forceinline__ T& block_shared() {
  __shared__ T storage;
  return storage;
}
__device__ __forceinline__ void copy16(void* dst, const void* src) {
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
}
// Global -> shared, 16 bytes, without holding a register until it lands: cp.async on sm_80+
// (.cg: through L2 only, the K/V stream is read once), a plain copy16 before. A thread's copies
// form a group at async_commit(); async_wait<N>() returns when at most the N newest of its groups
// are in flight. Another lane's copies are visible after a __syncwarp/__syncthreads that follows
// its wait.
__device__ __forceinline__ void copy16_async(void* shared_dst, const void* global_src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src) : "memory");
#else
  copy16(shared_dst, global_src);
#endif
}
// The same copy, or 16 zero bytes with nothing read when `read` is false (cp.async's src-size 0):
// a warp's copies of a tile stay one instruction when some of its rows lie past the end.
__device__ __forceinline__ void copy16_async_or_zero(void* shared_dst, const void* global_src, bool read) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src), "r"(read ? 16 : 0)
               : "memory");
#else
  if (read) copy16(shared_dst, global_src);
  else *static_cast<uint4*>(shared_dst) = make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
#else
#include "cuda_emu.h"
#define LAUNCH_KERNEL(kernel, grid, block, stream, ...) emu::launch(#kernel, kernel, grid, block, __VA_ARGS__)
#define LAUNCH_KERNEL_NAMED(name, kernel, grid, block, stream, ...) emu::launch(name, kernel, grid, block, __VA_ARGS__)
using emu::async_commit;
using emu::async_wait;
using emu::copy16;
using emu::copy16_async;
using emu::copy16_async_or_zero;
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// ---- tensor cores (sm_80+): one warp's 16x8x16 MMA and 8x8 shared-memory matrix loads ---------
// Fragment layouts as in the PTX ISA (mma.m16n8k16 with 16-bit A/B and float C/D; ldmatrix .x4);
// csrc/cuda_emu.h computes the same layouts element by element.
#ifdef __CUDACC__
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same_v<T, bf16> || std::is_same_v<T, f16>, "16-bit inputs only");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, bf16>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();   // the tensor-core kernels are launched on sm_80+ only
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#else
  __trap();
#endif
}
#endif   // else: cuda_emu.h's

// Two 16-bit values in one register, `lo` in the low half (an MMA fragment's column order).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return uint32_t(from_float<T>(lo).bits) | uint32_t(from_float<T>(hi).bits) << 16;
}
