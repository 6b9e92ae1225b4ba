// Just enough of CUDA to run paged_attention_cuda.cu on the CPU, for tests only, and strict
// enough to fail where a GPU would.
//
// Each block's threads are real std::threads, so __syncthreads is a real barrier, and warp
// shuffles exchange values through a per-warp buffer between two warp barriers. What a lenient
// emulation would hide, this one makes visible:
//   - launch limits: gridDim.x < 2^31, y and z <= 65,535, <= 1,024 threads per block, and
//     <= 48 KB of shared memory unless cudaFuncSetAttribute opted in. A violation runs nothing
//     and is reported by cudaGetLastError, like a failed launch.
//   - shared memory is per block (kernels take it with block_shared<T>(); a raw __shared__
//     does not compile here) and filled with 0xff bytes, a NaN in every float type, before
//     each block: code that reads it before writing it gets NaN, not a lucky zero.
//   - the blocks of a grid run in a shuffled order, several at once (one worker per core),
//     so a kernel that depends on block order or shares global scratch between blocks fails.
//   - 16-byte loads (copy16) must be 16-byte aligned, as on the GPU.
//   - cp.async (copy16_async, async_commit, async_wait<N>) lands as late as the GPU may let it:
//     a thread's copies are held (their source and alignment checked at issue) and made only
//     when async_wait<N> retires their group, so a kernel that reads a buffer before waiting
//     for it reads the old contents (NaN poison at first), not a lucky early copy.
//   - the warp-wide tensor-core ops (mma_m16n8k16, ldmatrix_x4 and its .trans) gather every lane's
//     fragment or row address between two warp barriers and compute the PTX ISA's fragment layouts
//     element by element; ldmatrix refuses a row address that is not 16-byte aligned shared memory.
//   - graph capture (cuda_emu_capture): while it is on, a host read of device data, which the
//     binding asks for through cuda_emu_host_read, fails as it would inside a real CUDA graph
//     capture (a copy to the host there is an error that invalidates the capture).
// cuda_emu_configure() turns each of these off (and forgets opt-ins), so a test can show which one caught a bug.
// Slow and obvious on purpose: never a production path. Any number of files of one library may
// include it (its state and extern "C" controls are inline).
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct int2 { int x, y; };
using cudaStream_t = void*;
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
constexpr cudaError_t cudaErrorInvalidConfiguration = 9;
constexpr cudaError_t cudaErrorMisalignedAddress = 716;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

using std::max;
using std::min;
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

namespace emu {

constexpr int kWarpSize = 32;
constexpr unsigned kMaxGridX = 2147483647u, kMaxGridYZ = 65535, kMaxThreads = 1024, kMaxBlockZ = 64;
constexpr size_t kSharedLimit = 48 * 1024;         // static shared memory without an opt-in
constexpr size_t kSharedOptInLimit = 227 * 1024;   // sm_90's most, with cudaFuncSetAttribute

struct Config {
  bool shuffle = true;     // run blocks in a shuffled order
  bool poison = true;      // 0xff-fill shared memory before each block (else zero it)
  int workers = 0;         // blocks run at once; 0 = one per core
  bool dry_run = false;    // check and log launches, run no block
};
inline Config config;
inline bool capturing = false;   // a CUDA graph capture is under way: no host read of device data

// ---- errors: sticky until cudaGetLastError reads them ---------------------------------------

inline std::mutex error_mutex;
inline cudaError_t last_error = cudaSuccess;
inline std::string last_message = "no error";

inline void fail(cudaError_t code, const std::string& message) {
  std::lock_guard lock(error_mutex);
  if (last_error == cudaSuccess) {   // the first error wins, as on a GPU
    last_error = code;
    last_message = message;
  }
}

// ---- one block ------------------------------------------------------------------------------

struct Warp {
  std::barrier<> barrier{kWarpSize};
  uint64_t lanes[kWarpSize];          // what each lane offers to a shuffle
  uint32_t frags[kWarpSize][10];      // what each lane offers to an mma.sync (a, b, c) or ldmatrix (address)
};

struct Abort {};                      // thrown by every thread of a block that overflows shared memory

struct Block {                        // what the threads of the running block share
  std::barrier<> barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::unique_ptr<unsigned char[]> shared{new unsigned char[kSharedOptInLimit + 16]};
  size_t shared_limit;
  Block(int threads, size_t limit) : barrier(threads), shared_limit(limit) {
    for (int w = 0; w < (threads + kWarpSize - 1) / kWarpSize; ++w) warps.push_back(std::make_unique<Warp>());
  }
  unsigned char* shared_base() {      // 16-byte aligned, like a GPU's shared window
    return shared.get() + (16 - reinterpret_cast<uintptr_t>(shared.get()) % 16) % 16;
  }
};

inline thread_local dim3 thread_idx, block_idx;
inline thread_local Block* current_block;
inline thread_local size_t shared_top;   // bytes of the block's shared memory this thread has taken
inline dim3 grid_dim, block_dim;

inline Warp& my_warp() { return *current_block->warps[thread_idx.x / kWarpSize]; }

// Every thread of a block asks for the same objects in the same order, so each computes the
// same offsets on its own. Over the limit: report and leave the block (all threads throw here).
inline void* take_shared(size_t bytes, size_t align) {
  const size_t offset = (shared_top + align - 1) / align * align;
  shared_top = offset + bytes;
  if (shared_top > current_block->shared_limit) {
    fail(cudaErrorInvalidValue, "too much shared memory: a block needs more than " +
                                    std::to_string(current_block->shared_limit) + " bytes");
    throw Abort{};
  }
  return current_block->shared_base() + offset;
}

inline bool aligned16(const void* dst, const void* src) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) return true;
  fail(cudaErrorMisalignedAddress, "misaligned address: a 16-byte access not 16-byte aligned");
  return false;
}

inline bool in_shared(const void* p, size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  return c >= current_block->shared_base() && c + bytes <= current_block->shared_base() + current_block->shared_limit;
}

inline void copy16(void* dst, const void* src) {   // misaligned: an error, and zeros (a GPU would fault)
  if (aligned16(dst, src)) std::memcpy(dst, src, 16);
  else std::memset(dst, 0, 16);
}

// cp.async: this thread's copies, grouped by commit (the last group is the one being filled).
// Each block's threads are fresh std::threads, so a block starts with none in flight.
struct AsyncCopy { void* dst; const void* src; };   // src nullptr: 16 zero bytes
inline thread_local std::vector<std::vector<AsyncCopy>> async_groups{{}};

inline void copy16_async(void* dst, const void* src) {
  if (aligned16(dst, src)) async_groups.back().push_back({dst, src});
}
inline void copy16_async_or_zero(void* dst, const void* src, bool read) {   // zeros land at the wait too
  if (aligned16(dst, src)) async_groups.back().push_back({dst, read ? src : nullptr});
}
inline void async_commit() { async_groups.emplace_back(); }
template <int N>
void async_wait() {                  // retire every committed group but the N newest
  const size_t committed = async_groups.size() - 1;
  const size_t retire = committed > size_t(N) ? committed - N : 0;
  for (size_t g = 0; g < retire; ++g)
    for (const AsyncCopy& c : async_groups[g]) {
      if (c.src) std::memcpy(c.dst, c.src, 16);
      else std::memset(c.dst, 0, 16);
    }
  async_groups.erase(async_groups.begin(), async_groups.begin() + retire);
}

// ---- launches -------------------------------------------------------------------------------

inline std::map<const void*, size_t> shared_opt_in;   // kernel -> its shared memory limit
inline std::string launch_log;                        // "name gx,gy,gz threads;" per launch
inline uint64_t launch_count;

inline bool check_launch(const char* name, dim3 grid, dim3 block) {
  char entry[160];
  std::snprintf(entry, sizeof entry, "%s %u,%u,%u %u;", name, grid.x, grid.y, grid.z, block.x * block.y * block.z);
  launch_log += entry;
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > kMaxGridX || grid.y > kMaxGridYZ ||
      grid.z > kMaxGridYZ || threads == 0 || threads > kMaxThreads || block.z > kMaxBlockZ) {
    fail(cudaErrorInvalidConfiguration, std::string("invalid configuration argument: ") + entry);
    return false;
  }
  return true;
}

template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
  if (!check_launch(name, grid, block) || config.dry_run) return;
  grid_dim = grid;
  block_dim = block;
  const int threads = block.x * block.y * block.z;
  const auto opted = shared_opt_in.find(reinterpret_cast<const void*>(kernel));
  const size_t limit = opted == shared_opt_in.end() ? kSharedLimit : opted->second;
  std::vector<dim3> order;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) order.emplace_back(x, y, z);
  if (config.shuffle) std::shuffle(order.begin(), order.end(), std::mt19937_64(++launch_count));
  std::atomic<size_t> next{0};
  std::atomic<bool> aborted{false};
  auto worker = [&] {
    Block state(threads, limit);
    for (size_t i; !aborted && (i = next++) < order.size();) {
      std::memset(state.shared_base(), config.poison ? 0xff : 0, limit);
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          thread_idx = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
          block_idx = order[i];
          current_block = &state;
          shared_top = 0;
          try {
            kernel(args...);
          } catch (const Abort&) {
            aborted = true;
          }
        });
      for (auto& t : pool) t.join();
    }
  };
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  const int workers = std::min<size_t>(config.workers > 0 ? config.workers : cores, order.size());
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
}

}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

template <typename T>
T& block_shared() {   // the block's shared T, uninitialized (poisoned) like __shared__
  return *static_cast<T*>(emu::take_shared(sizeof(T), alignof(T)));
}

inline cudaError_t cudaGetLastError() {
  std::lock_guard lock(emu::error_mutex);
  const cudaError_t e = emu::last_error;
  emu::last_error = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : emu::last_message.c_str(); }

template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute, int bytes) {
  if (bytes < 0 || size_t(bytes) + emu::kSharedLimit > emu::kSharedOptInLimit) return cudaErrorInvalidValue;
  emu::shared_opt_in[reinterpret_cast<const void*>(kernel)] = emu::kSharedLimit + bytes;
  return cudaSuccess;
}

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

template <typename T>
T __shfl_sync(unsigned, T value, int src_lane, int = emu::kWarpSize) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  emu::Warp& w = emu::my_warp();
  std::memcpy(&w.lanes[threadIdx.x % emu::kWarpSize], &value, sizeof(T));
  w.barrier.arrive_and_wait();
  T other;
  std::memcpy(&other, &w.lanes[src_lane % emu::kWarpSize], sizeof(T));
  w.barrier.arrive_and_wait();
  return other;
}

// ---- tensor cores: mma.sync m16n8k16 and ldmatrix, as the PTX ISA lays out their fragments ----
// Lane l = 4 * g + t (g = l / 4, t = l % 4). A (16x16, row-major): register r holds row g + 8 * (r % 2),
// columns 2t + 8 * (r / 2) and the one after (low half first). B (16x8, "col"): register r holds rows
// 2t + 8r and the one after, column g. C/D (16x8 float): element e is row g + 8 * (e / 2), column 2t + e % 2.

template <typename T>
float half_of(uint32_t reg, int half) {   // element `half` (0 = low 16 bits) of a packed pair, as float
  T x;
  x.bits = uint16_t(reg >> (16 * half));
  return to_float(x);
}

// d += a * b for the warp's 16x8 tile (T: bf16 or f16 storage, float accumulators)
template <typename T>
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  emu::Warp& w = emu::my_warp();
  const int lane = threadIdx.x % emu::kWarpSize, g = lane / 4, t = lane % 4;
  std::memcpy(w.frags[lane], a, 16);
  std::memcpy(w.frags[lane] + 4, b, 8);
  w.barrier.arrive_and_wait();                      // every lane's fragments are in
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    float acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const uint32_t a_reg = w.frags[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)];
      const uint32_t b_reg = w.frags[col * 4 + (k % 8) / 2][4 + k / 8];
      acc += half_of<T>(a_reg, k % 2) * half_of<T>(b_reg, k % 2);
    }
    out[e] = acc;
  }
  w.barrier.arrive_and_wait();                      // every lane has read before the next exchange
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// ldmatrix.x4 (.trans when `trans`): lanes 8j..8j+7 give the row addresses of 8x8 16-bit matrix j;
// register j of lane l gets matrix j's row l / 4, elements 2 (l % 4) and the next; transposed, its
// elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  emu::Warp& w = emu::my_warp();
  const int lane = threadIdx.x % emu::kWarpSize;
  if (reinterpret_cast<uintptr_t>(row) % 16 || !emu::in_shared(row, 16))
    emu::fail(cudaErrorMisalignedAddress, "misaligned address: an ldmatrix row not 16-byte aligned in shared memory");
  std::memcpy(w.frags[lane], &row, sizeof row);
  w.barrier.arrive_and_wait();
  for (int j = 0; j < 4; ++j) {
    uint16_t half[2];
    for (int h = 0; h < 2; ++h) {
      const int row_in = trans ? 2 * (lane % 4) + h : lane / 4, col = trans ? lane / 4 : 2 * (lane % 4) + h;
      const unsigned char* base;
      std::memcpy(&base, w.frags[8 * j + row_in], sizeof base);
      if (reinterpret_cast<uintptr_t>(base) % 16 || !emu::in_shared(base, 16)) half[h] = 0xffff;   // reported above
      else std::memcpy(&half[h], base + 2 * col, 2);
    }
    r[j] = uint32_t(half[0]) | uint32_t(half[1]) << 16;
  }
  w.barrier.arrive_and_wait();
}

// ---- controls for tests (ctypes) ------------------------------------------------------------

#define CUDA_EMU_CONTROL extern "C" __attribute__((visibility("default"), used)) inline

CUDA_EMU_CONTROL void cuda_emu_configure(int shuffle, int poison, int workers, int dry_run) {
  emu::config = {shuffle != 0, poison != 0, workers, dry_run != 0};
  emu::shared_opt_in.clear();        // as a fresh process: no kernel opted in
}

// The launches since the last call, "name gx,gy,gz threads;" each; then the log is cleared.
CUDA_EMU_CONTROL const char* cuda_emu_take_launch_log() {
  static std::string taken;
  taken = std::move(emu::launch_log);
  emu::launch_log.clear();
  return taken.c_str();
}

// Start (1) or end (0) an emulated graph capture.
CUDA_EMU_CONTROL void cuda_emu_capture(int on) { emu::capturing = on != 0; }

// The binding calls this before it reads device data on the host: an error message while a capture
// is under way (the caller raises it), else nullptr.
CUDA_EMU_CONTROL const char* cuda_emu_host_read(const char* what) {
  static thread_local std::string message;
  if (!emu::capturing) return nullptr;
  message = std::string("host read of device data (") + what + ") during CUDA graph capture";
  return message.c_str();
}
