// The tensor-core decode kernel of csrc/paged_attention_cuda.cu (decode_mma_kernel), kept apart for
// length: included once, inside that file's anonymous namespace, after Params, part_range and the
// block constants it uses. Not a header of its own: it compiles only there.
#pragma once

// ---- decode on tensor cores (sm_80+): the GQA group as the rows of an MMA tile ---------------
// One block per (row x part, KV head), as decode_kernel. The group's G <= 8 query heads are rows
// 0..G-1 of a 16-row mma.m16n8k16 A tile held in registers (the other rows zero): S = Q.K^T, then
// out^T = V^T.P^T, whose B fragment (head g, tokens 2t, 2t+1) is S's C fragment as it stands, and
// whose 8 columns are the group's heads, so no accumulator is spent on padding rows. K and V rows
// are read from shared memory once for the whole group. Each warp walks 16-token
// tiles (K, then V, of every 4th chunk of its part) through a 3-stage cp.async ring: two tiles in
// flight while the third is used. A warp-wide copy moves whole rows (lane l: 16-byte piece
// l % pieces of a row, 2 rows of 256 bytes or 4 of 128 at once), so each copy instruction touches
// 4 whole 128-byte lines. The page ids of a chunk are read one chunk ahead (lane r holds row r's
// slot, shuffled to the lanes that copy it), so no copy waits on a table load. The online softmax
// stays in float32 (row g of the tile is lane quad g's), P is rounded to the KV dtype to feed the
// second MMA; the warps merge through shared memory (store_decode_result).
//
// Bytes in flight: two tiles a warp (D 128: 2 x 4 KB; D 64: 2 x 2 KB), 4 warps a block, 4 blocks an
// SM (48 KB of shared memory and <= 128 registers a block at D 128): 128 KB an SM at D 128, 64 KB
// at D 64, over the >= 32 KB that 3 TB/s needs (23 B/ns an SM x ~1.4 us loaded latency), once the
// planner gives every SM its blocks.

constexpr int kMmaTokens = 16;   // tokens per staged tile: one k-step of P.V, two n-tiles of Q.K^T
constexpr int kMmaStages = 3;    // a warp's ring of tiles

template <int D>
struct MmaDecodeShared {
  union alignas(16) {
    unsigned char tiles[kMmaStages][kMmaTokens * D * 2];   // 16-bit K or V rows, pieces swizzled
    struct {
      float o[kMaxGroup][D];
      float m[kMaxGroup], l[kMaxGroup];
    } merge;                                                // after the last tile: the warp's partial output
  } warp[kNumWarps];
};
static_assert(sizeof(MmaDecodeShared<128>) <= 48 * 1024, "static shared memory is limited to 48 KB");

// Byte offset of 16-byte piece `piece` of staged row `row`: pieces are XOR-swizzled by row % 8, so
// the 8 rows one ldmatrix matrix reads at one piece index sit in 8 different bank groups.
template <int D>
__device__ __forceinline__ int swizzled(int row, int piece) {
  return row * D * 2 + (piece ^ (row % 8)) * 16 + (PLANTED(kUnalignedTile) ? 8 : 0);
}

// Start copying the tile of 16 tokens from token0 (rows past `end` are zero-filled by the copy: P is
// 0 there, and 0 x a stale NaN would not be). row_slot: lane r's (r < 16) is row r's cache slot. Copy i moves
// rows i x 32 / pieces.. whole: lane l takes piece l % pieces of row i x 32 / pieces + l / pieces.
template <typename T, int D>
__device__ __forceinline__ void issue_mma_tile(const Params& p, const T* cache, int row_slot, int token0, int end,
                                               int kv_head, unsigned char* tile, int lane) {
  constexpr int kPieces = D * 2 / 16, kRowsPerCopy = kWarpSize / kPieces, kPer = 16 / sizeof(T);
  const int piece = lane % kPieces;
#pragma unroll
  for (int i = 0; i < kMmaTokens / kRowsPerCopy; ++i) {      // a row past the end: zeros, nothing read
    const int row = i * kRowsPerCopy + lane / kPieces;
    const int slot = __shfl_sync(0xffffffffu, row_slot, row);
    const T* src = cache + (int64_t(slot) * p.num_kv_heads + kv_head) * D + piece * kPer;
    copy16_async_or_zero(tile + swizzled<D>(row, piece), src, token0 + row < end);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM) decode_mma_kernel(Params p) {
  constexpr int kSteps = D / 16;   // k-steps of Q.K^T, pairs of 8-wide n-tiles of P.V
  const int seq = blockIdx.x / p.max_parts, part = blockIdx.x % p.max_parts, kv_head = blockIdx.y;
  const int q_row = p.query_start_loc[seq], ctx = p.context_lens[seq];
  const int parts = num_parts(ctx, *p.partition_size);
  if (p.query_start_loc[seq + 1] - q_row != 1 || part >= parts) return;   // not decoding, or a spare block
  const int2 range = part_range(ctx, part, parts, p.block_size);
  const int start = range.x, end = range.y, G = p.group;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, g = lane / 4, t = lane % 4;
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int* table = p.block_tables + int64_t(seq) * p.max_blocks;
  MmaDecodeShared<D>& s = block_shared<MmaDecodeShared<D>>();
  unsigned char (&ring)[kMmaStages][kMmaTokens * D * 2] = s.warp[warp].tiles;
  // tile j: the K (j even) or V (j odd) rows of the warp's chunk j / 2
  const auto tile_token = [&](int j) { return start + (warp + j / 2 * kNumWarps) * kMmaTokens; };
  // the page id of row lane % 16 of the chunk at token0 (0 past the end: that row is zeroed, not read)
  const auto page_of = [&](int token0) {
    const int pos = token0 + lane % kMmaTokens;
    return pos < end ? table[pos / p.block_size] : 0;
  };
  int next_page = page_of(tile_token(0)), row_slot = 0;       // page ids a chunk ahead of their copies
  const auto issue = [&](int j) {
    if (j % 2 == 0) {                                          // a chunk's K tile: its rows' slots, the next chunk's pages
      row_slot = next_page * p.block_size + (tile_token(j) + lane % kMmaTokens) % p.block_size;
      next_page = page_of(tile_token(j + 2));
    }
    if (tile_token(j) < end)
      issue_mma_tile<T, D>(p, j % 2 ? value_cache : key_cache, row_slot, tile_token(j), end, kv_head,
                           ring[j % kMmaStages], lane);
    async_commit();                                            // (empty past the end: the count stays right)
  };
  issue(0);
  issue(1);

  // q as A fragments: row g = query head g of the group, columns 2t, 2t+1 (+8); rows >= G are zero
  uint32_t qa[kSteps][4];
  const T* query = static_cast<const T*>(p.query) + int64_t(q_row) * p.q_row_stride + (kv_head * G + g) * D;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const bool real = g < G;
    qa[ks][0] = real ? *reinterpret_cast<const uint32_t*>(query + ks * 16 + 2 * t) : 0u;
    qa[ks][2] = real ? *reinterpret_cast<const uint32_t*>(query + ks * 16 + 8 + 2 * t) : 0u;
    qa[ks][1] = qa[ks][3] = 0u;                                // rows 8..15
  }
  // out^T [D x 8 heads] in D / 16 C tiles: o[mt] holds dims 16 mt + g (+8) of heads 2t, 2t+1
  float o[kSteps][4];
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float row_max = -INFINITY, row_sum = 0.f;                    // head g's; the sum of this lane's tokens
  uint32_t pb[2] = {0u, 0u};                                   // P^T's B fragment: head g, tokens 2t, 2t+1 (+8)
  for (int j = 0; tile_token(j) < end; ++j) {
    issue(j + 2);
    if (PLANTED(kOffByOneWait)) async_wait<kMmaStages>();
    else async_wait<kMmaStages - 1>();                         // this lane's copies of tile j have landed...
    __syncwarp();                                              // ...and every lane's
    const unsigned char* tile = ring[j % kMmaStages];
    const int m = lane / 8, r8 = lane % 8;                     // the ldmatrix matrix and row this lane addresses
    if (j % 2 == 0) {                                          // scores: [16 rows x 16 tokens] in two n-tiles
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int ks = 0; ks < kSteps; ++ks) {                    // matrices: tokens 0-7 | 8-15 x dims lo | hi
        uint32_t b[4];
        ldmatrix_x4(b, tile + swizzled<D>(m / 2 * 8 + r8, 2 * ks + m % 2), false);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<T>(sc[0], qa[ks], b0);
        mma_m16n8k16<T>(sc[1], qa[ks], b1);
      }
      const int token0 = tile_token(j);
      float tile_max = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {                          // row g, token 8 nt + 2t + e
          sc[nt][e] = token0 + 8 * nt + 2 * t + e < end ? sc[nt][e] * p.scale : -INFINITY;
          tile_max = fmaxf(tile_max, sc[nt][e]);
        }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max, tile_max);          // finite: the tile has a token
      const float correction = expf(row_max - new_max);        // 0 on the first tile
      row_max = new_max;
      row_sum *= correction;
      const float c_lo = __shfl_sync(0xffffffffu, correction, 8 * t);       // heads 2t and 2t + 1 (quads 2t, 2t+1)
      const float c_hi = __shfl_sync(0xffffffffu, correction, 8 * t + 4);
#pragma unroll
      for (int mt = 0; mt < kSteps; ++mt) {
        o[mt][0] *= c_lo;
        o[mt][1] *= c_hi;
        o[mt][2] *= c_lo;
        o[mt][3] *= c_hi;
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {                         // rounded as the MMA sees them, and summed so
        const T p0 = from_float<T>(expf(sc[nt][0] - new_max)), p1 = from_float<T>(expf(sc[nt][1] - new_max));
        row_sum += to_float(p0) + to_float(p1);
        pb[nt] = uint32_t(p0.bits) | uint32_t(p1.bits) << 16;     // head g, tokens 8 nt + 2t, +1
      }
    } else {                                                   // out^T += V^T . P^T (A: V rows transposed)
#pragma unroll
      for (int mt = 0; mt < kSteps; ++mt) {                    // matrices: tokens 0-7 | 8-15 x dims lo | hi
        uint32_t a[4];
        ldmatrix_x4(a, tile + swizzled<D>(m / 2 * 8 + r8, 2 * mt + m % 2), !PLANTED(kLdmatrixNoTrans));
        const uint32_t va[4] = {a[0], a[1], a[2], a[3]};
        mma_m16n8k16<T>(o[mt], va, pb);
      }
    }
    __syncwarp();                                              // the tile is read before the ring refills it
  }
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 2);

  // merge the warps (their rings are free: every real copy waited for) as decode_kernel does
  auto& mine = s.warp[warp].merge;
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {                              // head 2t + e % 2, dim 16 mt + g + 8 (e / 2)
      if (2 * t + e % 2 < G) mine.o[2 * t + e % 2][16 * mt + g + 8 * (e / 2)] = o[mt][e];
    }
  if (g < G && t == 0) {
    mine.m[g] = row_max;
    mine.l[g] = row_sum;
  }
  __syncthreads();
  store_decode_result<T>(p, q_row, kv_head, parts, D, [&](int w, int gi) {
    return WarpPartial{s.warp[w].merge.o[gi], s.warp[w].merge.m[gi], s.warp[w].merge.l[gi]};
  });
}
