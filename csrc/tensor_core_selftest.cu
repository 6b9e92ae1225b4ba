// Tests only: the smallest kernels that use each warp-level primitive the tensor-core decode kernel
// relies on (mma_m16n8k16, ldmatrix_x4 with and without .trans, a multi-stage cp.async ring), so that
// test_all.py can check csrc/cuda_emu.h's emulation of each against a plain matmul or copy, and show
// that the emulation catches the bug planted for each (flags). Built with nvcc, the same kernels check
// a GPU's fragment layouts against the same oracles. Holds nothing the engine runs.
#include "cuda_common.h"

namespace {

enum Flag { kPlantNoTrans = 1, kPlantMisaligned = 2, kPlantWaitOffByOne = 4 };

template <typename T>
struct MmaShared {
  alignas(16) T a[16][16];   // row-major A [m][k]
  alignas(16) T b[16][16];   // row-major B [k][n]: ldmatrix.trans makes the MMA's "col" fragments
};

// c [16 x 16] = a [16 x 16] . b [16 x 16] with one warp: A through ldmatrix, B through ldmatrix.trans,
// two m16n8k16 MMAs (n-tiles 0-7 and 8-15).
template <typename T>
__global__ void mma_selftest_kernel(const T* a, const T* b, float* c, int flags) {
  MmaShared<T>& s = block_shared<MmaShared<T>>();
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) {
    s.a[i / 16][i % 16] = a[i];
    s.b[i / 16][i % 16] = b[i];
  }
  __syncwarp();
  const int m = lane / 8, row = m % 2 * 8 + lane % 8, col = m / 2 * 8;   // matrix m: rows lo | hi x cols lo | hi
  const int skew = flags & kPlantMisaligned ? 4 : 0;                       // 8 bytes off a 16-byte row
  uint32_t af[4], bf[4];
  ldmatrix_x4(af, &s.a[row][col + skew], false);
  ldmatrix_x4(bf, &s.b[row][col], !(flags & kPlantNoTrans));
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  const uint32_t a4[4] = {af[0], af[1], af[2], af[3]}, b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
  mma_m16n8k16<T>(acc[0], a4, b0);
  mma_m16n8k16<T>(acc[1], a4, b1);
  const int g = lane / 4, t = lane % 4;
  for (int nt = 0; nt < 2; ++nt)
    for (int e = 0; e < 4; ++e) c[(g + 8 * (e / 2)) * 16 + nt * 8 + 2 * t + e % 2] = acc[nt][e];
}

constexpr int kStages = 3;

struct RingShared {
  alignas(16) unsigned char tiles[kStages][32 * 16];
};

// dst = src, `tiles` tiles of 512 bytes through a 3-stage cp.async ring with one warp, the decode
// kernel's schedule: issue tile j + 2, wait until at most 2 groups are in flight, use tile j.
__global__ void ring_selftest_kernel(const unsigned char* src, unsigned char* dst, int tiles, int flags) {
  RingShared& s = block_shared<RingShared>();
  const int lane = threadIdx.x, skew = flags & kPlantMisaligned ? 8 : 0;
  const auto issue = [&](int j) {
    if (j < tiles) copy16_async(s.tiles[j % kStages] + lane * 16, src + j * 512 + lane * 16 + skew);
    async_commit();
  };
  issue(0);
  issue(1);
  for (int j = 0; j < tiles; ++j) {
    issue(j + 2);
    if (flags & kPlantWaitOffByOne) async_wait<kStages>();
    else async_wait<kStages - 1>();
    __syncwarp();
    for (int i = lane; i < 512; i += 32) dst[j * 512 + i] = s.tiles[j % kStages][i];   // another lane's bytes too
    __syncwarp();
  }
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

// dtype: 1 bfloat16, 2 float16 (a and b: 16 x 16 row-major; c: float 16 x 16).
extern "C" const char* mma_selftest_launch(const void* a, const void* b, float* c, int dtype, int flags) {
  if (dtype == kBFloat16)
    LAUNCH_KERNEL_NAMED("mma", mma_selftest_kernel<bf16>, dim3(1), dim3(32), nullptr, static_cast<const bf16*>(a),
                        static_cast<const bf16*>(b), c, flags);
  else
    LAUNCH_KERNEL_NAMED("mma", mma_selftest_kernel<f16>, dim3(1), dim3(32), nullptr, static_cast<const f16*>(a),
                        static_cast<const f16*>(b), c, flags);
  return last_error();
}

extern "C" const char* ring_selftest_launch(const void* src, void* dst, int tiles, int flags) {
  LAUNCH_KERNEL_NAMED("ring", ring_selftest_kernel, dim3(1), dim3(32), nullptr,
                      static_cast<const unsigned char*>(src), static_cast<unsigned char*>(dst), tiles, flags);
  return last_error();
}
