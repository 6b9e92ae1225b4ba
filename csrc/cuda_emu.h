// Just enough of CUDA to run paged_attention_cuda.cu on the CPU, for tests only.
//
// A launch runs the grid's blocks one after another; each block's threads are real
// std::threads, so __syncthreads is a real barrier and a missing one shows up as a wrong
// answer. __shared__ becomes `static` (one block runs at a time, so a static local is
// per-block storage), and warp shuffles exchange values through a per-warp buffer between
// two warp barriers. Slow and obvious on purpose: never a production path.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = void*;
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "no error"; }

using std::max;
using std::min;
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

namespace emu {

constexpr int kWarpSize = 32;

struct Warp {
  std::barrier<> barrier{kWarpSize};
  uint64_t lanes[kWarpSize];          // what each lane offers to a shuffle
};

struct Block {                        // what the threads of the running block share
  std::barrier<> barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  explicit Block(int threads) : barrier(threads) {
    for (int w = 0; w < (threads + kWarpSize - 1) / kWarpSize; ++w) warps.push_back(std::make_unique<Warp>());
  }
};

inline thread_local dim3 thread_idx, block_idx;
inline thread_local Block* current_block;
inline dim3 grid_dim, block_dim;

inline Warp& my_warp() { return *current_block->warps[thread_idx.x / kWarpSize]; }

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
  grid_dim = grid;
  block_dim = block;
  const int threads = block.x * block.y * block.z;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block state(threads);
        std::vector<std::thread> pool;
        for (int i = 0; i < threads; ++i)
          pool.emplace_back([&, i] {
            thread_idx = dim3(i % block.x, i / block.x % block.y, i / (block.x * block.y));
            block_idx = dim3(x, y, z);
            current_block = &state;
            kernel(args...);
          });
        for (auto& t : pool) t.join();
      }
}

}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::current_block->barrier.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::my_warp().barrier.arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask, int = emu::kWarpSize) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  emu::Warp& w = emu::my_warp();
  const int lane = threadIdx.x % emu::kWarpSize;
  std::memcpy(&w.lanes[lane], &value, sizeof(T));
  w.barrier.arrive_and_wait();                      // every lane has offered its value
  T other;
  std::memcpy(&other, &w.lanes[lane ^ lane_mask], sizeof(T));
  w.barrier.arrive_and_wait();                      // every lane has read before the next write
  return other;
}
