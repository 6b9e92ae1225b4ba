// CUDA kernels behind paged_attention.py's "cuda" backend, with the semantics of
// paged_attention_reference: ragged batch, decode rows and prefill chunks in one call.
//
//   decode_kernel        one thread block per (KV head, sequence, context partition); its warps
//                        stride over 32-token chunks of the context through the block table.
//                        A lane scores its token against every query head of the GQA group
//                        (K read once for the group); online softmax per warp (max via warp
//                        shuffles), warps merged through shared memory.
//   reduce_kernel        merges the partitions of long contexts (flash-decoding style split).
//   prefill_kernel       one thread block per (KV head, sequence, tile of query rows); K/V
//                        chunks staged in shared memory and reused by every query of the tile.
//   reshape_and_cache_kernel  the fused KV write.
// Only plain pointers and ints cross the boundary (see the extern "C" launchers at the end),
// so this file needs only the CUDA toolkit; csrc/paged_attention_cuda_binding.cpp is the thin
// PyTorch side. Without nvcc it compiles against csrc/cuda_emu.h, which is how tests run it.
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define LAUNCH_KERNEL(kernel, grid, block, stream, ...) kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#else
#include "cuda_emu.h"
#define LAUNCH_KERNEL(kernel, grid, block, stream, ...) emu::launch(kernel, grid, block, __VA_ARGS__)
#endif

#include <cstdint>

namespace {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = 4;
constexpr int kThreads = kWarpSize * kNumWarps;
constexpr int kMaxGroup = 8;          // query heads per KV head
constexpr int kMaxHeadDim = 128;      // head_dim must be a multiple of 32, at most this
constexpr int kPerLane = kMaxHeadDim / kWarpSize;
constexpr int kChunk = kWarpSize;     // tokens a warp scores at once, one per lane
constexpr int kTileVectors = 16;      // prefill: query vectors (row, head) per thread block
constexpr int kVectorsPerWarp = kTileVectors / kNumWarps;
constexpr int kDefaultPartition = 512;  // decode: context tokens per thread block when split

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

// ---- shared pieces ------------------------------------------------------------------------

struct Params {
  const void* query;                  // [num_tokens, num_heads, head_dim]
  void* out;                          // same
  const void* key_cache;              // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;
  const int* block_tables;            // [num_seqs, max_blocks]
  const int* context_lens;            // [num_seqs]
  const int* query_start_loc;         // [num_seqs + 1]
  float* partial_out;                 // [num_seqs, num_heads, num_partitions, head_dim] if split
  float* partial_max;                 // [num_seqs, num_heads, num_partitions]
  float* partial_sum;
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks, group;
  int num_partitions, partition_size, rows_per_tile;
  float scale;
};

// Offset of (token pos, kv_head, 0) of a sequence in the cache, through its block table.
__device__ __forceinline__ int64_t kv_offset(const Params& p, const int* table, int pos, int kv_head) {
  const int64_t slot = int64_t(table[pos / p.block_size]) * p.block_size + pos % p.block_size;
  return (slot * p.num_kv_heads + kv_head) * p.head_dim;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

// ---- decode: one query row per sequence ---------------------------------------------------

template <typename Q, typename KV>
__global__ void decode_kernel(Params p) {
  const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int q_row = p.query_start_loc[seq];
  if (p.query_start_loc[seq + 1] - q_row != 1) return;        // prefill rows: prefill_kernel
  const int start = part * p.partition_size, ctx = p.context_lens[seq];
  if (start >= ctx) return;                                    // partition past this context
  const int end = min(ctx, start + p.partition_size);
  const int G = p.group, D = p.head_dim, lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const KV* key_cache = static_cast<const KV*>(p.key_cache);
  const KV* value_cache = static_cast<const KV*>(p.value_cache);
  const int* table = p.block_tables + int64_t(seq) * p.max_blocks;

  __shared__ float q_s[kMaxGroup][kMaxHeadDim];                // the group's queries, pre-scaled
  __shared__ float probs[kNumWarps][kMaxGroup][kChunk];
  __shared__ float warp_max_s[kNumWarps][kMaxGroup], warp_sum_s[kNumWarps][kMaxGroup];
  __shared__ float warp_acc_s[kNumWarps][kMaxGroup][kMaxHeadDim];
  const Q* query = static_cast<const Q*>(p.query) + (int64_t(q_row) * p.num_heads + kv_head * G) * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) q_s[i / D][i % D] = to_float(query[i]) * p.scale;
  __syncthreads();

  // per warp running softmax state; lane owns output elements d = e * 32 + lane
  float run_max[kMaxGroup], run_sum[kMaxGroup], acc[kMaxGroup][kPerLane];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    run_max[g] = -INFINITY;
    run_sum[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[g][e] = 0.f;
  }
  for (int c = start + warp * kChunk; c < end; c += kNumWarps * kChunk) {
    const int pos = c + lane, n = min(kChunk, end - c);
    float score[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) score[g] = lane < n ? 0.f : -INFINITY;
    if (lane < n) {                                            // K row read once for the group
      const KV* k = key_cache + kv_offset(p, table, pos, kv_head);
      for (int d = 0; d < D; ++d) {
        const float kd = to_float(k[d]);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g)
          if (g < G) score[g] += q_s[g][d] * kd;
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= G) break;
      const float new_max = fmaxf(run_max[g], warp_max(score[g]));
      const float correction = expf(run_max[g] - new_max);     // 0 on the first chunk
      probs[warp][g][lane] = lane < n ? expf(score[g] - new_max) : 0.f;
      run_max[g] = new_max;
      run_sum[g] *= correction;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[g][e] *= correction;
    }
    __syncwarp();
    for (int t = 0; t < n; ++t) {                              // V rows, coalesced across lanes
      const KV* v = value_cache + kv_offset(p, table, c + t, kv_head);
      float vd[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) vd[e] = e * kWarpSize < D ? to_float(v[e * kWarpSize + lane]) : 0.f;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= G) break;
        const float prob = probs[warp][g][t];
        run_sum[g] += prob;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[g][e] += prob * vd[e];
      }
    }
    __syncwarp();                                              // probs are read before reuse
  }

  // merge the warps: rescale each to the block's max, then sum
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= G) break;
    if (lane == 0) {
      warp_max_s[warp][g] = run_max[g];
      warp_sum_s[warp][g] = run_sum[g];
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      if (e * kWarpSize < D) warp_acc_s[warp][g][e * kWarpSize + lane] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int g = i / D, d = i % D, head = kv_head * G + g;
    float m = -INFINITY, sum = 0.f, o = 0.f;
    for (int w = 0; w < kNumWarps; ++w) m = fmaxf(m, warp_max_s[w][g]);
    for (int w = 0; w < kNumWarps; ++w) {
      const float f = warp_max_s[w][g] == -INFINITY ? 0.f : expf(warp_max_s[w][g] - m);  // idle warp
      sum += warp_sum_s[w][g] * f;
      o += warp_acc_s[w][g][d] * f;
    }
    if (p.num_partitions == 1) {
      static_cast<Q*>(p.out)[(int64_t(q_row) * p.num_heads + head) * D + d] = from_float<Q>(o / sum);
    } else {                                                   // unnormalized; reduce_kernel merges
      const int64_t idx = (int64_t(seq) * p.num_heads + head) * p.num_partitions + part;
      p.partial_out[idx * D + d] = o;
      if (d == 0) {
        p.partial_max[idx] = m;
        p.partial_sum[idx] = sum;
      }
    }
  }
}

// Merge the partitions of one (sequence, head) of a split decode.
template <typename Q>
__global__ void reduce_kernel(Params p) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int q_row = p.query_start_loc[seq];
  if (p.query_start_loc[seq + 1] - q_row != 1) return;
  const int used = (p.context_lens[seq] + p.partition_size - 1) / p.partition_size;
  const int64_t base = (int64_t(seq) * p.num_heads + head) * p.num_partitions;
  float m = -INFINITY, sum = 0.f;
  for (int i = 0; i < used; ++i) m = fmaxf(m, p.partial_max[base + i]);
  for (int i = 0; i < used; ++i) sum += p.partial_sum[base + i] * expf(p.partial_max[base + i] - m);
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < used; ++i) o += p.partial_out[(base + i) * p.head_dim + d] * expf(p.partial_max[base + i] - m);
    static_cast<Q*>(p.out)[(int64_t(q_row) * p.num_heads + head) * p.head_dim + d] = from_float<Q>(o / sum);
  }
}

// ---- prefill: a tile of query rows x the GQA group ------------------------------------------

template <typename Q, typename KV>
__global__ void prefill_kernel(Params p) {
  const int kv_head = blockIdx.x, seq = blockIdx.y, G = p.group, D = p.head_dim;
  const int q_begin = p.query_start_loc[seq], q_len = p.query_start_loc[seq + 1] - q_begin;
  const int row0 = blockIdx.z * p.rows_per_tile;
  if (q_len <= 1 || row0 >= q_len) return;                     // decode rows: decode_kernel
  const int rows = min(p.rows_per_tile, q_len - row0), num_vectors = rows * G;
  const int first_pos = p.context_lens[seq] - q_len + row0;    // absolute position of row0
  const int kv_len = first_pos + rows;                         // the tile's last row sees [0, kv_len)
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const KV* key_cache = static_cast<const KV*>(p.key_cache);
  const KV* value_cache = static_cast<const KV*>(p.value_cache);
  const int* table = p.block_tables + int64_t(seq) * p.max_blocks;

  __shared__ float q_s[kTileVectors][kMaxHeadDim];             // vector m = (row m / G, head m % G)
  __shared__ float k_s[kChunk][kMaxHeadDim + 1];               // +1: lanes read rows without bank conflicts
  __shared__ float v_s[kChunk][kMaxHeadDim];
  __shared__ float probs[kNumWarps][kVectorsPerWarp][kChunk];
  for (int i = threadIdx.x; i < num_vectors * D; i += blockDim.x) {
    const int m = i / D, d = i % D;
    const int64_t src = (int64_t(q_begin + row0 + m / G) * p.num_heads + kv_head * G + m % G) * D + d;
    q_s[m][d] = to_float(static_cast<const Q*>(p.query)[src]) * p.scale;
  }

  // warp w owns vectors w, w + 4, ...; lane owns output elements d = e * 32 + lane
  float run_max[kVectorsPerWarp], run_sum[kVectorsPerWarp], acc[kVectorsPerWarp][kPerLane];
#pragma unroll
  for (int j = 0; j < kVectorsPerWarp; ++j) {
    run_max[j] = -INFINITY;
    run_sum[j] = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[j][e] = 0.f;
  }
  for (int c = 0; c < kv_len; c += kChunk) {
    const int n = min(kChunk, kv_len - c);
    __syncthreads();                                           // previous chunk fully consumed
    for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
      const int t = i / D, d = i % D;
      const int64_t off = kv_offset(p, table, c + t, kv_head) + d;
      k_s[t][d] = to_float(key_cache[off]);
      v_s[t][d] = to_float(value_cache[off]);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kVectorsPerWarp; ++j) {
      const int m = warp + j * kNumWarps;
      if (m >= num_vectors) break;                             // warp-uniform
      const int q_pos = first_pos + m / G;
      const bool visible = lane < n && c + lane <= q_pos;      // causal
      float score = -INFINITY;
      if (visible) {
        score = 0.f;
        for (int d = 0; d < D; ++d) score += q_s[m][d] * k_s[lane][d];
      }
      const float chunk_max = warp_max(score);
      if (chunk_max == -INFINITY) continue;                    // chunk entirely in this row's future
      const float new_max = fmaxf(run_max[j], chunk_max);
      const float correction = expf(run_max[j] - new_max);
      probs[warp][j][lane] = visible ? expf(score - new_max) : 0.f;
      run_max[j] = new_max;
      run_sum[j] *= correction;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[j][e] *= correction;
      __syncwarp();
      for (int t = 0; t < n; ++t) {
        const float prob = probs[warp][j][t];
        run_sum[j] += prob;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e)
          if (e * kWarpSize < D) acc[j][e] += prob * v_s[t][e * kWarpSize + lane];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kVectorsPerWarp; ++j) {
    const int m = warp + j * kNumWarps;
    if (m >= num_vectors) break;
    Q* out = static_cast<Q*>(p.out) + (int64_t(q_begin + row0 + m / G) * p.num_heads + kv_head * G + m % G) * D;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      if (e * kWarpSize < D) out[e * kWarpSize + lane] = from_float<Q>(acc[j][e] / run_sum[j]);
  }
}

// ---- the fused KV write -------------------------------------------------------------------

template <typename Q, typename KV>
__global__ void reshape_and_cache_kernel(const Q* key, const Q* value, KV* key_cache, KV* value_cache,
                                         const int64_t* slot_mapping, int row) {
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;                                        // padding token: nothing to store
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    key_cache[slot * row + i] = from_float<KV>(to_float(key[int64_t(blockIdx.x) * row + i]));
    value_cache[slot * row + i] = from_float<KV>(to_float(value[int64_t(blockIdx.x) * row + i]));
  }
}

// ---- launchers ----------------------------------------------------------------------------

int num_partitions(const Params& p) {
  return (p.max_blocks * p.block_size + p.partition_size - 1) / p.partition_size;
}

template <typename Q, typename KV>
void launch_attention(Params p, int num_seqs, int num_tokens, cudaStream_t stream) {
  auto* decode = decode_kernel<Q, KV>;      // named pointers: a template's comma would split the macro
  auto* reduce = reduce_kernel<Q>;
  auto* prefill = prefill_kernel<Q, KV>;
  LAUNCH_KERNEL(decode, dim3(p.num_kv_heads, num_seqs, p.num_partitions), dim3(kThreads), stream, p);
  if (p.num_partitions > 1) LAUNCH_KERNEL(reduce, dim3(p.num_heads, num_seqs), dim3(kThreads), stream, p);
  // the host does not know each sequence's q_len (that would be a device sync), so the grid
  // covers the worst case and tiles past a sequence's rows exit at once
  const int tiles = (num_tokens + p.rows_per_tile - 1) / p.rows_per_tile;
  LAUNCH_KERNEL(prefill, dim3(p.num_kv_heads, num_seqs, tiles), dim3(kThreads), stream, p);
}

template <typename Q>
void dispatch_kv(int kv_dtype, Params p, int num_seqs, int num_tokens, cudaStream_t stream) {
  if (kv_dtype == kFloat32) launch_attention<Q, float>(p, num_seqs, num_tokens, stream);
  if (kv_dtype == kBFloat16) launch_attention<Q, bf16>(p, num_seqs, num_tokens, stream);
  if (kv_dtype == kFloat16) launch_attention<Q, f16>(p, num_seqs, num_tokens, stream);
}

template <typename Q, typename KV>
void launch_cache(const void* key, const void* value, void* key_cache, void* value_cache, const int64_t* slots,
                  int num_tokens, int row, cudaStream_t stream) {
  auto* kernel = reshape_and_cache_kernel<Q, KV>;
  LAUNCH_KERNEL(kernel, dim3(num_tokens), dim3(kThreads), stream, static_cast<const Q*>(key),
                static_cast<const Q*>(value), static_cast<KV*>(key_cache), static_cast<KV*>(value_cache), slots, row);
}

template <typename Q>
void dispatch_cache(int kv_dtype, const void* key, const void* value, void* key_cache, void* value_cache,
                    const int64_t* slots, int num_tokens, int row, cudaStream_t stream) {
  if (kv_dtype == kFloat32) launch_cache<Q, float>(key, value, key_cache, value_cache, slots, num_tokens, row, stream);
  if (kv_dtype == kBFloat16) launch_cache<Q, bf16>(key, value, key_cache, value_cache, slots, num_tokens, row, stream);
  if (kv_dtype == kFloat16) launch_cache<Q, f16>(key, value, key_cache, value_cache, slots, num_tokens, row, stream);
}

bool valid_dtype(int dtype) { return dtype == kFloat32 || dtype == kBFloat16 || dtype == kFloat16; }

}  // namespace

// Floats of scratch paged_attention_launch needs (0 when no sequence can need a split).
extern "C" int64_t paged_attention_workspace_floats(int num_seqs, int num_heads, int head_dim, int block_size,
                                                    int max_blocks, int partition_size) {
  Params p{};
  p.block_size = block_size;
  p.max_blocks = max_blocks;
  p.partition_size = partition_size > 0 ? partition_size : kDefaultPartition;
  const int parts = num_partitions(p);
  return parts > 1 ? int64_t(num_seqs) * num_heads * parts * (head_dim + 2) : 0;
}

// Returns nullptr on success, else what is unsupported or the CUDA error.
// dtypes: 0 float32, 1 bfloat16, 2 float16. partition_size <= 0 picks the default.
extern "C" const char* paged_attention_launch(
    void* out, const void* query, const void* key_cache, const void* value_cache, const int* block_tables,
    const int* context_lens, const int* query_start_loc, float* workspace, int num_seqs, int num_tokens,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int q_dtype, int kv_dtype,
    float scale, int partition_size, void* stream) {
  if (head_dim % kWarpSize != 0 || head_dim > kMaxHeadDim) return "head_dim must be a multiple of 32, at most 128";
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kMaxGroup)
    return "num_heads / num_kv_heads must be a whole number in [1, 8]";
  if (!valid_dtype(q_dtype) || !valid_dtype(kv_dtype)) return "dtypes must be float32, bfloat16 or float16";
  if (num_seqs == 0 || num_tokens == 0) return nullptr;
  Params p{query, out, key_cache, value_cache, block_tables, context_lens, query_start_loc, nullptr, nullptr,
           nullptr, num_heads, num_kv_heads, head_dim, block_size, max_blocks, num_heads / num_kv_heads, 1,
           partition_size > 0 ? partition_size : kDefaultPartition, 1, scale};
  p.rows_per_tile = kTileVectors / p.group;
  p.num_partitions = num_partitions(p);
  if (p.num_partitions > 1) {                                  // layout of the workspace
    const int64_t heads = int64_t(num_seqs) * num_heads * p.num_partitions;
    p.partial_out = workspace;
    p.partial_max = workspace + heads * head_dim;
    p.partial_sum = p.partial_max + heads;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  if (q_dtype == kFloat32) dispatch_kv<float>(kv_dtype, p, num_seqs, num_tokens, s);
  if (q_dtype == kBFloat16) dispatch_kv<bf16>(kv_dtype, p, num_seqs, num_tokens, s);
  if (q_dtype == kFloat16) dispatch_kv<f16>(kv_dtype, p, num_seqs, num_tokens, s);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// key/value: [num_tokens, row] in q_dtype; caches: [num_slots, row] in kv_dtype. Negative slots are skipped.
extern "C" const char* reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                                void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                                int row, int q_dtype, int kv_dtype, void* stream) {
  if (!valid_dtype(q_dtype) || !valid_dtype(kv_dtype)) return "dtypes must be float32, bfloat16 or float16";
  if (num_tokens == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  if (q_dtype == kFloat32) dispatch_cache<float>(kv_dtype, key, value, key_cache, value_cache, slot_mapping, num_tokens, row, s);
  if (q_dtype == kBFloat16) dispatch_cache<bf16>(kv_dtype, key, value, key_cache, value_cache, slot_mapping, num_tokens, row, s);
  if (q_dtype == kFloat16) dispatch_cache<f16>(kv_dtype, key, value, key_cache, value_cache, slot_mapping, num_tokens, row, s);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}
