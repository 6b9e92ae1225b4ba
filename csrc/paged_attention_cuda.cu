// CUDA kernels behind paged_attention.py's "cuda" backend, with the semantics of
// paged_attention_reference: ragged batch, decode rows and prefill chunks in one call.
//
// The host plans each step once (paged_attention.plan_cuda_launch, from the lists the model
// runner already holds) into a small device buffer: the partition size, then the prefill tiles.
// The grids depend only on ints the host passes (rows, max_parts, prefill tiles), never on the
// data, so a step padded to a bucket (rows, max_parts, prefill items padded with empty ones) has
// one fixed launch sequence and a CUDA graph can replay it whatever the contexts and the mix of
// prefill and decode rows: gridDim.x grows with the batch, gridDim.y <= num_heads.
//   decode_kernel        one thread block per (row x one of max_parts context partitions, KV
//                        head). The partition size is read from the plan on the device; a block
//                        past its row's last partition, or of a row that is not decoding, exits
//                        at once. Each warp walks 32-token chunks, each as tiles of K rows, then
//                        V rows, staged into shared memory with coalesced 16-byte cp.async copies,
//                        double-buffered: the next tile loads while this one is used. A lane
//                        scores its token against every query head of the GQA group (K/V read
//                        once per group); online softmax per warp, warps merged through shared
//                        memory. A row with context_len == 0 (a padding row) gets zeros.
//                        head_dim 64 and 128 (16-bit) have their own instances, others the
//                        generic one; __launch_bounds__ keeps 4 blocks resident per SM.
//   decode_mma_kernel    the same blocks on tensor cores for bf16/fp16 at head_dim 64 and 128
//                        (csrc/decode_mma_cuda.cuh).
//   reduce_kernel        one block per (row, head), launched whenever max_parts > 1; merges the
//                        partitions of a split row (flash-decoding style), other rows exit.
//   prefill_kernel       one thread block per (prefill item = tile of query rows, KV head); K/V
//                        chunks staged in shared memory and reused by every query of the tile.
//                        Not launched in a pure-decode step. An item of sequence -1 is empty (it
//                        exits): a mixed step's graph bucket pads its work list to a fixed length.
//   reshape_and_cache_kernel  the fused KV write; slot -1 means "do not cache this row". Its _vec
//                        twin moves 16-byte pieces when the cache has the keys' dtype.
// Queries and new K/V rows may be strided views (rows of the fused qkv output): only the row
// stride is free, the heads of a row are contiguous. Only plain pointers and ints cross the
// boundary (the extern "C" functions at the end), so this file needs only the CUDA toolkit;
// csrc/paged_attention_cuda_binding.cpp is the PyTorch side. Without nvcc it compiles against csrc/cuda_emu.h, which is how
// the tests run it; -DPLANT_BUGS adds bugs a test can switch on (plant_bug) to prove that the
// emulation catches them. Shared memory is taken with block_shared<T>(), one struct per kernel.
#include "cuda_common.h"

#include <cstdint>
#include <type_traits>

namespace {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = 4;
constexpr int kThreads = kWarpSize * kNumWarps;
constexpr int kBlocksPerSM = 4;       // decode blocks resident per SM (paged_attention.BLOCKS_PER_SM)
constexpr int kMaxGroup = 8;          // query heads per KV head
constexpr int kMaxHeadDim = 128;      // head_dim must be a multiple of 32, at most this
constexpr int kPerLane = kMaxHeadDim / kWarpSize;
constexpr int kChunk = kWarpSize;     // tokens a warp scores at once, one per lane
constexpr int kTileVectors = 16;      // prefill: query vectors (row, head) per thread block
constexpr int kVectorsPerWarp = kTileVectors / kNumWarps;
constexpr int kStageRowBytes = kMaxHeadDim * 2 + 16;   // a 16-bit K/V row, +16: no bank conflicts
constexpr int kStageBytes = kChunk * kStageRowBytes;  // per warp: 32 such rows (16 float rows)
constexpr int kTileBytes = kStageBytes / 2;           // per warp, two tiles in flight: 16 such rows each
constexpr unsigned kMaxGridX = 2147483647u, kMaxGridY = 65535;

#ifdef PLANT_BUGS
// Bugs a GPU would show and a lenient emulation would not; tests switch one on with plant_bug.
enum Bug { kNoBug, kOldPrefillGrid, kTooManyThreads, kSharedOver48KB, kSharedOptIn, kUnzeroedTail,
           kGlobalQuery, kLastBlockMerges, kNoAsyncWait, kOffByOneWait, kLdmatrixNoTrans, kUnalignedTile };
int planted_bug = kNoBug;
__device__ float planted_global_query[kMaxGroup][kMaxHeadDim];   // a "forgot __shared__" scratch
#define PLANTED(bug) (planted_bug == (bug))
#else
#define PLANTED(bug) false
#endif


// ---- shared pieces ------------------------------------------------------------------------

struct Params {
  const void* query;                  // [num_tokens, num_heads, head_dim]
  void* out;                          // same
  const void* key_cache;              // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;
  const int* block_tables;            // [num_seqs, max_blocks]
  const int* context_lens;            // [num_seqs]
  const int* query_start_loc;         // [num_seqs + 1]
  const int* partition_size;          // plan[0], on the device: context tokens per decode block
  const int2* prefill_items;          // plan[2:]: [num_prefill_items] (sequence, first query row of the tile)
  float* partial_out;                 // [num_seqs * max_parts, num_heads, head_dim] if max_parts > 1
  float* partial_max;                 // [num_seqs * max_parts, num_heads]
  float* partial_sum;
  int64_t q_row_stride;               // elements between query rows (heads contiguous)
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks, group;
  int max_parts, rows_per_tile;
  float scale;
};

// Decode items of a row: its context in partitions (a row with no context still gets one). The
// planner makes the partition whole pages; part i of n takes pages [i * pages / n, (i + 1) * pages / n),
// so a row's parts differ by at most one page (paged_attention.part_pages).
__host__ __device__ __forceinline__ int num_parts(int context_len, int partition_size) {
  return context_len <= partition_size ? 1 : (context_len + partition_size - 1) / partition_size;
}

// Tokens [x, y) of part `part` of `parts`: the row's pages split evenly at page boundaries.
__device__ __forceinline__ int2 part_range(int ctx, int part, int parts, int block_size) {
  const int64_t pages = (ctx + block_size - 1) / block_size;
  return {int(part * pages / parts) * block_size, min(ctx, int((part + 1) * pages / parts) * block_size)};
}

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

struct DecodeShared {
  float q[kMaxGroup][kMaxHeadDim];               // the group's queries, pre-scaled
  float probs[kNumWarps][kMaxGroup][kChunk];     // a warp's chunk: scores, then softmax weights
  float warp_max[kNumWarps][kMaxGroup], warp_sum[kNumWarps][kMaxGroup];
  union alignas(16) {                            // per warp: two tiles of staged K/V rows, then its partial output
    unsigned char tiles[2][kTileBytes];
    float acc[kMaxGroup][kMaxHeadDim];
  } warp_area[kNumWarps];
};
static_assert(sizeof(DecodeShared) <= 48 * 1024, "static shared memory is limited to 48 KB");

// K/V rows per staged tile: the most of a 32-token chunk (halving) whose padded rows fit a tile.
__host__ __device__ constexpr int tile_rows(int row_bytes) {
  int rows = kChunk;
  while (rows > 1 && rows * row_bytes > kTileBytes) rows /= 2;
  return rows;
}

// A warp's unit of staging: `first`.. of the K (or V) rows of the 32-token chunk at `chunk`. A warp
// walks its chunks (start + warp * 32, then every 128 tokens), each as its K tiles, then its V tiles.
struct Tile {
  int chunk, first, is_value;
};

__device__ __forceinline__ Tile next_tile(Tile t, int rows_per_tile, int end) {
  if (t.first + rows_per_tile < min(kChunk, end - t.chunk)) return {t.chunk, t.first + rows_per_tile, t.is_value};
  if (!t.is_value) return {t.chunk, 0, 1};
  return {t.chunk + kNumWarps * kChunk, 0, 0};
}

// Start copying a tile's rows into `stage` (cp.async), row_bytes apart. Lane i issues 16-byte
// pieces i, i + 32, ...: neighbouring lanes read neighbouring pieces of a row, so each row
// arrives as whole sectors (coalesced) wherever its block sits in the pool.
template <typename KV>
__device__ __forceinline__ void issue_tile(const Params& p, const KV* cache, const int* table, int first, int n,
                                           int kv_head, int D, unsigned char* stage, int row_bytes, int lane) {
  const int pieces = D * int(sizeof(KV)) / 16, per_piece = 16 / int(sizeof(KV));
  for (int i = lane; i < n * pieces; i += kWarpSize) {
    const int t = i / pieces, piece = i % pieces;
    copy16_async(stage + t * row_bytes + piece * 16,
                 cache + kv_offset(p, table, first + t, kv_head) + piece * per_piece);
  }
}

// score[g] += q[g] . k for a staged K row, read 16 bytes at a time (rows are padded so the
// 8 lanes of a quarter warp hit distinct banks). kHeadDim 0: D at run time.
template <typename KV, int kHeadDim>
__device__ __forceinline__ void add_scores(const unsigned char* row, const float (&q)[kMaxGroup][kMaxHeadDim], int G,
                                           int D, float (&score)[kMaxGroup]) {
  constexpr int kVec = 16 / sizeof(KV);
  const int dims = kHeadDim ? kHeadDim : D;
#pragma unroll 2   // fully unrolled, head_dim 128 would need over 128 registers (spills under the bound)
  for (int d0 = 0; d0 < dims; d0 += kVec) {
    alignas(16) KV k[kVec];
    copy16(k, row + d0 * sizeof(KV));
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float kd = to_float(k[j]);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g)
        if (g < G) score[g] += q[g][d0 + j] * kd;
    }
  }
}

// Output element d of `head` for a row split into `parts` decode items starting at `first`.
__device__ __forceinline__ float merge_partitions(const Params& p, int first, int parts, int head, int d) {
  float m = -INFINITY, sum = 0.f, o = 0.f;
  for (int i = 0; i < parts; ++i) m = fmaxf(m, p.partial_max[int64_t(first + i) * p.num_heads + head]);
  for (int i = 0; i < parts; ++i) {
    const int64_t idx = int64_t(first + i) * p.num_heads + head;
    const float f = expf(p.partial_max[idx] - m);
    sum += p.partial_sum[idx] * f;
    o += p.partial_out[idx * p.head_dim + d] * f;
  }
  return o / sum;
}

// One warp's share of a decode item for query head g of the group: its unnormalized output row
// (head_dim floats in shared memory), the running max of its scores and the sum of their weights.
struct WarpPartial {
  const float* o;
  float m, l;
};

// The end of a decode item, shared by decode_kernel and decode_mma_kernel: the block's warps merged
// (each rescaled to their common max; a warp that saw no token has max -inf and counts 0), then the
// group's heads written: normalized into out when the row is one part (context_len 0: zeros), else
// unnormalized into the partials that reduce_kernel merges. partial(w, g) -> WarpPartial.
template <typename T, typename Partial>
__device__ __forceinline__ void store_decode_result(const Params& p, int q_row, int kv_head, int parts, int D,
                                                    Partial partial) {
  for (int i = threadIdx.x; i < p.group * D; i += blockDim.x) {
    const int g = i / D, d = i % D, head = kv_head * p.group + g;
    float mx = -INFINITY, sum = 0.f, out = 0.f;
    for (int w = 0; w < kNumWarps; ++w) mx = fmaxf(mx, partial(w, g).m);
    for (int w = 0; w < kNumWarps; ++w) {
      const WarpPartial part = partial(w, g);
      const float f = part.m == -INFINITY ? 0.f : expf(part.m - mx);
      sum += part.l * f;
      out += part.o[d] * f;
    }
    if (parts == 1) {
      static_cast<T*>(p.out)[(int64_t(q_row) * p.num_heads + head) * D + d] = from_float<T>(sum > 0.f ? out / sum : 0.f);
    } else {
      const int64_t idx = int64_t(blockIdx.x) * p.num_heads + head;
      p.partial_out[idx * D + d] = out;
      if (d == 0) {
        p.partial_max[idx] = mx;
        p.partial_sum[idx] = sum;
      }
    }
  }
}

// kHeadDim 64 or 128: loops over head_dim have fixed trip counts and registers hold only
// head_dim / 32 output elements per lane; 0: the generic kernel, any multiple of 32 up to 128.
// __launch_bounds__: at most 128 registers a thread, so 4 blocks (16 warps) fit an SM's registers,
// as many as its shared memory holds (5 x 43 KB).
template <typename Q, typename KV, int kHeadDim>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM) decode_kernel(Params p) {
  static_assert(kHeadDim % kWarpSize == 0 && kHeadDim <= kMaxHeadDim, "head_dim: a multiple of 32, at most 128");
  constexpr int kLanesPerHead = kHeadDim ? kHeadDim / kWarpSize : kPerLane;   // output elements per lane
  const int seq = blockIdx.x / p.max_parts, part = blockIdx.x % p.max_parts, kv_head = blockIdx.y;
  const int q_row = p.query_start_loc[seq], ctx = p.context_lens[seq], partition = *p.partition_size;
  const int parts = num_parts(ctx, partition);
  if (p.query_start_loc[seq + 1] - q_row != 1 || part >= parts) return;   // not decoding, or a spare block
  const int2 range = part_range(ctx, part, parts, p.block_size);
  const int start = range.x, end = range.y;
  const int G = p.group, D = kHeadDim ? kHeadDim : p.head_dim;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const KV* key_cache = static_cast<const KV*>(p.key_cache);
  const KV* value_cache = static_cast<const KV*>(p.value_cache);
  const int* table = p.block_tables + int64_t(seq) * p.max_blocks;
  const int row_bytes = D * int(sizeof(KV)) + 16;
  const int rows_per_tile = tile_rows(row_bytes);   // 32; 16 for 16-bit rows of 128 or float rows of 64; 8 for float rows of 128

  DecodeShared& s = block_shared<DecodeShared>();
  unsigned char (&stage)[2][kTileBytes] = s.warp_area[warp].tiles;
  // the warp's first tile is under way while the block loads its queries
  Tile tile{start + warp * kChunk, 0, 0};
  if (tile.chunk < end)
    issue_tile(p, key_cache, table, tile.chunk, min(rows_per_tile, end - tile.chunk), kv_head, D, stage[0], row_bytes,
               lane);
  async_commit();
#ifdef PLANT_BUGS
  if (PLANTED(kSharedOver48KB) || PLANTED(kSharedOptIn)) block_shared<unsigned char[2][kStageBytes]>()[0][0] = 0;
  float (&q_s)[kMaxGroup][kMaxHeadDim] = PLANTED(kGlobalQuery) ? planted_global_query : s.q;
#else
  float (&q_s)[kMaxGroup][kMaxHeadDim] = s.q;
#endif
  const Q* query = static_cast<const Q*>(p.query) + int64_t(q_row) * p.q_row_stride + kv_head * G * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) q_s[i / D][i % D] = to_float(query[i]) * p.scale;
  __syncthreads();

  // per warp running softmax state; lane owns output elements d = e * 32 + lane
  float run_max[kMaxGroup], run_sum[kMaxGroup], acc[kMaxGroup][kLanesPerHead], score[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    run_max[g] = -INFINITY;
    run_sum[g] = score[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kLanesPerHead; ++e) acc[g][e] = 0.f;
  }
  // Double buffering: tile i + 1 is in flight while tile i is used (a chunk's V rows load while
  // its K rows are scored, the next chunk's K rows while V is summed).
  for (int buf = 0; tile.chunk < end; buf ^= 1) {
    const int n = min(kChunk, end - tile.chunk), rows = min(rows_per_tile, n - tile.first);
    const Tile next = next_tile(tile, rows_per_tile, end);
    if (next.chunk < end)
      issue_tile(p, next.is_value ? value_cache : key_cache, table, next.chunk + next.first,
                 min(rows_per_tile, min(kChunk, end - next.chunk) - next.first), kv_head, D, stage[buf ^ 1],
                 row_bytes, lane);
    async_commit();                                            // (empty at the end: the count stays right)
    if (!PLANTED(kNoAsyncWait)) async_wait<1>();               // this lane's copies of `tile` have landed...
    __syncwarp();                                              // ...and every lane's
    if (!tile.is_value) {                                      // lane t scores token chunk + t
      if (tile.first == 0) {
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) score[g] = lane < n ? 0.f : -INFINITY;
      }
      if (lane >= tile.first && lane < tile.first + rows)
        add_scores<KV, kHeadDim>(stage[buf] + (lane - tile.first) * row_bytes, q_s, G, D, score);
      if (tile.first + rows == n) {                            // the chunk's last K tile: its softmax
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= G) break;
          const float new_max = fmaxf(run_max[g], warp_max(score[g]));
          const float correction = expf(run_max[g] - new_max); // 0 on the first chunk
          s.probs[warp][g][lane] = lane < n ? expf(score[g] - new_max) : 0.f;
          run_max[g] = new_max;
          run_sum[g] *= correction;
#pragma unroll
          for (int e = 0; e < kLanesPerHead; ++e) acc[g][e] *= correction;
        }
      }
    } else {                                                   // V rows: lane reads d = e * 32 + lane
      for (int t = 0; t < rows; ++t) {
        const KV* v = reinterpret_cast<const KV*>(stage[buf] + t * row_bytes);
        float vd[kLanesPerHead];
#pragma unroll
        for (int e = 0; e < kLanesPerHead; ++e)
          vd[e] = kHeadDim || e * kWarpSize < D ? to_float(v[e * kWarpSize + lane]) : 0.f;
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= G) break;
          const float prob = s.probs[warp][g][tile.first + t];
          run_sum[g] += prob;
#pragma unroll
          for (int e = 0; e < kLanesPerHead; ++e) acc[g][e] += prob * vd[e];
        }
      }
    }
    __syncwarp();                                              // tile (and probs) read before they are refilled
    tile = next;
  }

  // merge the warps: rescale each to the block's max, then sum. A warp's tiles are free now
  // (every copy waited for, the last group empty), so its partial output goes there.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= G) break;
    if (lane == 0) {
      s.warp_max[warp][g] = run_max[g];
      s.warp_sum[warp][g] = run_sum[g];
    }
#pragma unroll
    for (int e = 0; e < kLanesPerHead; ++e)
      if (kHeadDim || e * kWarpSize < D) s.warp_area[warp].acc[g][e * kWarpSize + lane] = acc[g][e];
  }
  __syncthreads();
  store_decode_result<Q>(p, q_row, kv_head, parts, D, [&](int w, int g) {
    return WarpPartial{s.warp_area[w].acc[g], s.warp_max[w][g], s.warp_sum[w][g]};
  });
#ifdef PLANT_BUGS
  if (PLANTED(kLastBlockMerges) && parts > 1 && part == parts - 1) {   // trusts the other parts ran first
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x)
      static_cast<Q*>(p.out)[(int64_t(q_row) * p.num_heads + kv_head * G) * D + i] =
          from_float<Q>(merge_partitions(p, blockIdx.x - part, parts, kv_head * G + i / D, i % D));
  }
#endif
}

#include "decode_mma_cuda.cuh"   // decode_mma_kernel: the group's heads as the rows of an MMA tile

// Merge the partitions of one (split row, head).
template <typename Q>
__global__ void reduce_kernel(Params p) {
  const int seq = blockIdx.x, first = seq * p.max_parts, head = blockIdx.y;
  const int parts = num_parts(p.context_lens[seq], *p.partition_size);
  if (p.query_start_loc[seq + 1] - p.query_start_loc[seq] != 1 || parts == 1) return;   // nothing to merge
  Q* out = static_cast<Q*>(p.out) + (int64_t(p.query_start_loc[seq]) * p.num_heads + head) * p.head_dim;
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) out[d] = from_float<Q>(merge_partitions(p, first, parts, head, d));
}

// ---- prefill: a tile of query rows x the GQA group ------------------------------------------

struct PrefillShared {
  float q[kTileVectors][kMaxHeadDim];            // vector m = (row m / G, head m % G)
  float k[kChunk][kMaxHeadDim + 1];              // +1: lanes read rows without bank conflicts
  float v[kChunk][kMaxHeadDim];
  float probs[kNumWarps][kVectorsPerWarp][kChunk];
};
static_assert(sizeof(PrefillShared) <= 48 * 1024, "static shared memory is limited to 48 KB");

template <typename Q, typename KV>
__global__ void prefill_kernel(Params p) {
  const int seq = p.prefill_items[blockIdx.x].x, row0 = p.prefill_items[blockIdx.x].y, kv_head = blockIdx.y;
  if (seq < 0) return;                                         // an empty item: a graph bucket's fixed grid
  const int G = p.group, D = p.head_dim;
  const int q_begin = p.query_start_loc[seq], q_len = p.query_start_loc[seq + 1] - q_begin;
  const int rows = min(p.rows_per_tile, q_len - row0), num_vectors = rows * G;
  const int first_pos = p.context_lens[seq] - q_len + row0;    // absolute position of row0
  const int kv_len = first_pos + rows;                         // the tile's last row sees [0, kv_len)
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const KV* key_cache = static_cast<const KV*>(p.key_cache);
  const KV* value_cache = static_cast<const KV*>(p.value_cache);
  const int* table = p.block_tables + int64_t(seq) * p.max_blocks;

  PrefillShared& s = block_shared<PrefillShared>();
  for (int i = threadIdx.x; i < num_vectors * D; i += blockDim.x) {
    const int m = i / D, d = i % D;
    const int64_t src = int64_t(q_begin + row0 + m / G) * p.q_row_stride + (kv_head * G + m % G) * D + d;
    s.q[m][d] = to_float(static_cast<const Q*>(p.query)[src]) * p.scale;
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
      s.k[t][d] = to_float(key_cache[off]);
      s.v[t][d] = to_float(value_cache[off]);
    }
    __syncthreads();
    const int v_rows = PLANTED(kUnzeroedTail) ? kChunk : n;   // the plant reads rows never written
#pragma unroll
    for (int j = 0; j < kVectorsPerWarp; ++j) {
      const int m = warp + j * kNumWarps;
      if (m >= num_vectors) break;                             // warp-uniform
      const int q_pos = first_pos + m / G;
      const bool visible = lane < n && c + lane <= q_pos;      // causal
      float score = -INFINITY;
      if (visible) {
        score = 0.f;
        for (int d = 0; d < D; ++d) score += s.q[m][d] * s.k[lane][d];
      }
      const float chunk_max = warp_max(score);
      if (chunk_max == -INFINITY) continue;                    // chunk entirely in this row's future
      const float new_max = fmaxf(run_max[j], chunk_max);
      const float correction = expf(run_max[j] - new_max);
      s.probs[warp][j][lane] = visible ? expf(score - new_max) : 0.f;
      run_max[j] = new_max;
      run_sum[j] *= correction;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[j][e] *= correction;
      __syncwarp();
      for (int t = 0; t < v_rows; ++t) {
        const float prob = s.probs[warp][j][t];
        run_sum[j] += prob;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e)
          if (e * kWarpSize < D) acc[j][e] += prob * s.v[t][e * kWarpSize + lane];
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
__global__ void reshape_and_cache_kernel(const Q* __restrict__ key, const Q* __restrict__ value,
                                         KV* __restrict__ key_cache, KV* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int row, int64_t key_stride,
                                         int64_t value_stride) {
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;                                        // -1: padding row, not cached
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    key_cache[slot * row + i] = from_float<KV>(to_float(key[int64_t(blockIdx.x) * key_stride + i]));
    value_cache[slot * row + i] = from_float<KV>(to_float(value[int64_t(blockIdx.x) * value_stride + i]));
  }
}

// The same write for a cache of the keys' own dtype, 16 bytes a thread: thread t loads piece t of
// the token's K and V rows (both loads issued before either store), then stores both. One pass while
// the row has at most 1,024 pieces (8 KV heads x 128 in bf16: 128).
template <typename T>
__global__ void reshape_and_cache_vec_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                             T* __restrict__ key_cache, T* __restrict__ value_cache,
                                             const int64_t* __restrict__ slot_mapping, int row, int64_t key_stride,
                                             int64_t value_stride) {
  constexpr int V = 16 / sizeof(T);
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;                                        // -1: padding row, not cached
  for (int i = threadIdx.x * V; i < row; i += blockDim.x * V) {
    alignas(16) T k[V], v[V];
    copy16(k, key + int64_t(blockIdx.x) * key_stride + i);
    copy16(v, value + int64_t(blockIdx.x) * value_stride + i);
    copy16(key_cache + slot * row + i, k);
    copy16(value_cache + slot * row + i, v);
  }
}

// ---- host: planning and launchers -----------------------------------------------------------

// The decode kernel for a head_dim, and the name the emulator's launch log gives it.
template <typename Q, typename KV>
struct DecodeKernel {
  void (*kernel)(Params);
  const char* name;
};

// head_dim 64 and 128 in what a GPU serves (bf16 or fp16 queries and cache alike, query rows 4-byte
// aligned) run on tensor cores; every other case (float32 or mixed dtypes, head_dim 32 or 96) the
// generic kernel.
template <typename Q, typename KV>
DecodeKernel<Q, KV> pick_decode(const Params& p) {
  if constexpr (std::is_same_v<Q, KV> && sizeof(KV) == 2) {
    const bool aligned = reinterpret_cast<uintptr_t>(p.query) % 4 == 0 && p.q_row_stride % 2 == 0;
    if (aligned && p.head_dim == 64) return {decode_mma_kernel<Q, 64>, "decode_mma_d64"};
    if (aligned && p.head_dim == 128) return {decode_mma_kernel<Q, 128>, "decode_mma_d128"};
  }
  return {decode_kernel<Q, KV, 0>, "decode"};
}

// The step's fixed launch sequence: decode over rows x max_parts (max_parts 0: no decode row),
// reduce whenever a row may be split, prefill over the planned tiles.
template <typename Q, typename KV>
void launch_attention(const Params& p, int num_seqs, int num_prefill_items, cudaStream_t stream) {
  const DecodeKernel<Q, KV> decode = pick_decode<Q, KV>(p);
  auto* reduce = reduce_kernel<Q>;          // named pointers: a template's comma would split the macro
  auto* prefill = prefill_kernel<Q, KV>;
#ifdef PLANT_BUGS
  if (PLANTED(kSharedOptIn)) cudaFuncSetAttribute(decode.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 32 * 1024);
#endif
  const dim3 block(kThreads);
  const unsigned decode_blocks = unsigned(num_seqs) * unsigned(p.max_parts);
  if (decode_blocks)
    LAUNCH_KERNEL_NAMED(decode.name, decode.kernel, dim3(decode_blocks, p.num_kv_heads), block, stream, p);
  if (num_seqs && p.max_parts > 1 && !PLANTED(kLastBlockMerges))
    LAUNCH_KERNEL(reduce, dim3(unsigned(num_seqs), p.num_heads), block, stream, p);
  if (num_prefill_items && PLANTED(kOldPrefillGrid))           // the tiles on gridDim.z, as before
    LAUNCH_KERNEL(prefill, dim3(p.num_kv_heads, 1, unsigned(num_prefill_items)), block, stream, p);
  else if (num_prefill_items)
    LAUNCH_KERNEL(prefill, dim3(unsigned(num_prefill_items), p.num_kv_heads), block, stream, p);
}

template <typename Q>
void dispatch_kv(int kv_dtype, const Params& p, int num_seqs, int num_prefill, cudaStream_t stream) {
  if (kv_dtype == kFloat32) launch_attention<Q, float>(p, num_seqs, num_prefill, stream);
  if (kv_dtype == kBFloat16) launch_attention<Q, bf16>(p, num_seqs, num_prefill, stream);
  if (kv_dtype == kFloat16) launch_attention<Q, f16>(p, num_seqs, num_prefill, stream);
}

// 16-byte pieces when the cache has the keys' dtype and every row starts 16-byte aligned; else
// one element a thread (a cast on the way, or a view of odd offset).
template <typename Q, typename KV>
void launch_cache(const void* key, const void* value, void* key_cache, void* value_cache, const int64_t* slots,
                  int num_tokens, int row, int64_t key_stride, int64_t value_stride, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(Q);
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool vec = std::is_same_v<Q, KV> && row % V == 0 && key_stride % V == 0 && value_stride % V == 0 &&
                   aligned(key) && aligned(value) && aligned(key_cache) && aligned(value_cache);
  if (vec && !PLANTED(kTooManyThreads)) {
    const dim3 block(min(1024, (row / V + kWarpSize - 1) / kWarpSize * kWarpSize));
    LAUNCH_KERNEL_NAMED("reshape_and_cache_vec", (reshape_and_cache_vec_kernel<Q>), dim3(num_tokens), block, stream,
                        static_cast<const Q*>(key), static_cast<const Q*>(value), static_cast<Q*>(key_cache),
                        static_cast<Q*>(value_cache), slots, row, key_stride, value_stride);
    return;
  }
  auto* kernel = reshape_and_cache_kernel<Q, KV>;
  const dim3 block(PLANTED(kTooManyThreads) ? 2 * 1024 : kThreads);
  LAUNCH_KERNEL(kernel, dim3(num_tokens), block, stream, static_cast<const Q*>(key), static_cast<const Q*>(value),
                static_cast<KV*>(key_cache), static_cast<KV*>(value_cache), slots, row, key_stride, value_stride);
}

template <typename Q>
void dispatch_cache(int kv_dtype, const void* key, const void* value, void* key_cache, void* value_cache,
                    const int64_t* slots, int num_tokens, int row, int64_t ks, int64_t vs, cudaStream_t stream) {
  if (kv_dtype == kFloat32) launch_cache<Q, float>(key, value, key_cache, value_cache, slots, num_tokens, row, ks, vs, stream);
  if (kv_dtype == kBFloat16) launch_cache<Q, bf16>(key, value, key_cache, value_cache, slots, num_tokens, row, ks, vs, stream);
  if (kv_dtype == kFloat16) launch_cache<Q, f16>(key, value, key_cache, value_cache, slots, num_tokens, row, ks, vs, stream);
}

}  // namespace

// Floats of scratch paged_attention_launch needs (0 when no row can be split).
extern "C" int64_t paged_attention_workspace_floats(int num_seqs, int max_parts, int num_heads, int head_dim) {
  return max_parts > 1 ? int64_t(num_seqs) * max_parts * num_heads * (head_dim + 2) : 0;
}

// Returns nullptr on success, else what is unsupported or the CUDA error. plan: the device copy of
// paged_attention.plan_cuda_launch's ints ({partition size, 0, prefill items...}); num_seqs rows
// each get max_parts decode blocks (0: no decode launch). dtypes: 0 float32, 1 bfloat16, 2 float16.
// Reads nothing on the host: every pointer may be device memory.
extern "C" const char* paged_attention_launch(
    void* out, const void* query, int64_t q_row_stride, const void* key_cache, const void* value_cache,
    const int* block_tables, const int* context_lens, const int* query_start_loc, const int* plan, int num_seqs,
    int max_parts, int num_prefill_items, float* workspace, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks, int q_dtype, int kv_dtype, float scale, void* stream) {
  if (head_dim % kWarpSize != 0 || head_dim > kMaxHeadDim) return "head_dim must be a multiple of 32, at most 128";
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kMaxGroup)
    return "num_heads / num_kv_heads must be a whole number in [1, 8]";
  if (unsigned(num_heads) > kMaxGridY) return "num_heads must be at most 65535 (gridDim.y)";
  if (num_seqs < 0 || max_parts < 0 || num_prefill_items < 0) return "negative rows, partitions or tiles";
  if ((num_seqs == 0 || max_parts == 0) && num_prefill_items == 0) return nullptr;
  if (int64_t(num_seqs) * max_parts > kMaxGridX || num_prefill_items > int64_t(kMaxGridX))
    return "too many work items for gridDim.x";
  if (!valid_dtype(q_dtype) || !valid_dtype(kv_dtype)) return "dtypes must be float32, bfloat16 or float16";
  if (reinterpret_cast<uintptr_t>(key_cache) % 16 || reinterpret_cast<uintptr_t>(value_cache) % 16)
    return "KV caches must be 16-byte aligned (decode reads them 16 bytes at a time)";
  Params p{query, out, key_cache, value_cache, block_tables, context_lens, query_start_loc, plan,
           reinterpret_cast<const int2*>(plan + 2), nullptr, nullptr, nullptr, q_row_stride, num_heads,
           num_kv_heads, head_dim, block_size, max_blocks, num_heads / num_kv_heads, max_parts, 0, scale};
  p.rows_per_tile = kTileVectors / p.group;
  if (max_parts > 1) {                                         // layout of the workspace
    const int64_t heads = int64_t(num_seqs) * max_parts * num_heads;
    p.partial_out = workspace;
    p.partial_max = workspace + heads * head_dim;
    p.partial_sum = p.partial_max + heads;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  if (q_dtype == kFloat32) dispatch_kv<float>(kv_dtype, p, num_seqs, num_prefill_items, s);
  if (q_dtype == kBFloat16) dispatch_kv<bf16>(kv_dtype, p, num_seqs, num_prefill_items, s);
  if (q_dtype == kFloat16) dispatch_kv<f16>(kv_dtype, p, num_seqs, num_prefill_items, s);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// key/value: [num_tokens, row] in q_dtype, rows key_stride/value_stride elements apart; caches:
// [num_slots, row] in kv_dtype. Slot -1 is skipped (not cached); every other slot must be in range
// (the binding checks them only under NANOSERVE_CHECK_INPUTS=1: the model runner built them).
extern "C" const char* reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                                void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                                int row, int64_t key_stride, int64_t value_stride, int q_dtype,
                                                int kv_dtype, void* stream) {
  if (!valid_dtype(q_dtype) || !valid_dtype(kv_dtype)) return "dtypes must be float32, bfloat16 or float16";
  if (num_tokens == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  if (q_dtype == kFloat32) dispatch_cache<float>(kv_dtype, key, value, key_cache, value_cache, slot_mapping, num_tokens, row, key_stride, value_stride, s);
  if (q_dtype == kBFloat16) dispatch_cache<bf16>(kv_dtype, key, value, key_cache, value_cache, slot_mapping, num_tokens, row, key_stride, value_stride, s);
  if (q_dtype == kFloat16) dispatch_cache<f16>(kv_dtype, key, value, key_cache, value_cache, slot_mapping, num_tokens, row, key_stride, value_stride, s);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

#ifdef PLANT_BUGS
extern "C" void plant_bug(int bug) { planted_bug = bug; }
#endif
