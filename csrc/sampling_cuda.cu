// The GPU sampler's filters and draw in one launch, without sorting the vocabulary: for each row of
// logits, temperature, then top-k, top-p over what top-k kept, min-p (vLLM's order, sampler.py's
// apply_top_k_top_p_min_p as the oracle), then the inverse-CDF draw of sampler.inverse_cdf with the
// row's uniform. One block per row; each thread owns a contiguous chunk of the vocabulary, so "in
// index order" is thread order, then order within the chunk.
//   top-k   the k-th largest logit is found by a radix select on order-preserving 32-bit keys,
//           2 bits a pass (16 passes): each pass counts, per digit, the tokens under the prefix found
//           so far, and walks the 4 digits from the top. Ties with the k-th stay (as topk's floor).
//   top-p   the same select, weighting each token by exp(z - max) instead of 1, finds the crossing
//           value: tokens above it stay; of the tokens equal to it, in index order, those whose
//           mass before them is still below top_p's share stay (the sort-based reference's order,
//           equal logits by lower index).
//   min-p   a floor at max + log(min_p): no softmax needed.
//   draw    the kept tokens' exp(z - max), summed per chunk, scanned, and the one chunk that holds
//           u * total walked token by token.
// Masses in double. Only plain pointers and ints cross the boundary (sample_launch). Without nvcc it
// compiles against csrc/cuda_emu.h (the tests run it there against the PyTorch reference).
#include "cuda_common.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBits = 2;             // a radix pass: 2 bits (16 passes); 4 digits fit in registers
constexpr int kDigits = 1 << kBits;

struct SampleShared {
  double warp_part[kWarps][kDigits];
  double digit_total[kDigits];
  double chunk[kThreads];            // per-thread sums, then their exclusive scan
  float warp_max[kWarps];
  int pick;                          // the thread whose chunk holds the draw
  double rest;                       // the draw's mass left inside that chunk
};

// Larger float -> larger key (and -inf below every finite value).
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
  for (int mask = 16; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int mask = 16; mask > 0; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

// The block's sums of c[0..kDigits) into s.digit_total (every thread reads them after).
__device__ __forceinline__ void reduce_digits(SampleShared& s, double* c) {
#pragma unroll
  for (int d = 0; d < kDigits; ++d) {
    const double v = warp_sum(c[d]);
    if (threadIdx.x % 32 == 0) s.warp_part[threadIdx.x / 32][d] = v;
  }
  __syncthreads();
  if (threadIdx.x < kDigits) {
    double t = 0.0;
    for (int w = 0; w < kWarps; ++w) t += s.warp_part[w][threadIdx.x];
    s.digit_total[threadIdx.x] = t;
  }
  __syncthreads();
}

// The block's sum of one double per thread (every thread gets it).
__device__ __forceinline__ double block_sum(SampleShared& s, double v) {
  double c[kDigits] = {v};
  reduce_digits(s, c);
  const double total = s.digit_total[0];
  __syncthreads();                   // before the next reduction rewrites the totals
  return total;
}

// Radix select over the chunk's tokens i with weight(i, key) > 0: the largest key K whose tokens at or
// above it weigh >= target. Returns K; *above gets the weight strictly above K.
template <class Key, class Weight>
__device__ __forceinline__ uint32_t radix_select(SampleShared& s, int lo, int hi, double target, Key key_of, Weight weight,
                                 double* above) {
  uint32_t prefix = 0, mask = 0;
  double before = 0.0;
#pragma unroll 1
  for (int shift = 32 - kBits; shift >= 0; shift -= kBits) {
    double c[kDigits] = {};          // registers: indexed by constants only (a computed index spills)
    for (int i = lo; i < hi; ++i) {
      const uint32_t k = key_of(i);
      if ((k & mask) != prefix) continue;
      const uint32_t digit = (k >> shift) & (kDigits - 1);
      const double w = weight(i, k);
#pragma unroll
      for (int d = 0; d < kDigits; ++d) c[d] += digit == uint32_t(d) ? w : 0.0;
    }
    reduce_digits(s, c);
    int d = kDigits - 1;
    for (; d > 0 && before + s.digit_total[d] < target; --d) before += s.digit_total[d];
    __syncthreads();                 // every thread has read the totals
    prefix |= uint32_t(d) << shift;
    mask |= uint32_t(kDigits - 1) << shift;
  }
  *above = before;
  return prefix;
}

// params: [rows, 5] float32 per row: 1 / temperature, top_k (vocab = none), top_p, min_p, uniform in [0, 1).
// out: [rows] int64 sampled ids. kept: [rows, vocab] uint8 or null: the filters' verdicts (for tests).
__global__ void __launch_bounds__(kThreads) sample_kernel(const float* logits, int64_t stride, int vocab,
                                                         const float* params, int64_t* out, uint8_t* kept) {
  SampleShared& s = block_shared<SampleShared>();
  const int row = blockIdx.x, t = threadIdx.x;
  const float* x = logits + int64_t(row) * stride;
  const float* p = params + int64_t(row) * 5;
  const float inv_temp = p[0], top_p = p[2], min_p = p[3], u = p[4];
  const int top_k = int(p[1]);
  const int chunk = (vocab + kThreads - 1) / kThreads;
  const int lo = min(vocab, t * chunk), hi = min(vocab, lo + chunk);
  auto z = [&](int i) { return x[i] * inv_temp; };
  auto key_of = [&](int i) { return order_key(z(i)); };

  float m = -INFINITY;
  for (int i = lo; i < hi; ++i) m = fmaxf(m, z(i));
  m = warp_max(m);
  if (t % 32 == 0) s.warp_max[t / 32] = m;
  __syncthreads();
  m = s.warp_max[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, s.warp_max[w]);
  __syncthreads();
  if (!(m > -INFINITY)) {            // every token masked: nothing to draw from (the reference's token 0)
    for (int i = lo; i < hi; ++i)
      if (kept) kept[int64_t(row) * vocab + i] = 0;
    if (t == 0) out[row] = 0;
    return;
  }
  auto mass = [&](int i) { return double(expf(z(i) - m)); };   // -inf -> 0

  // top-k: keys below the k-th largest go
  double unused;
  const uint32_t k_floor = top_k < vocab
      ? radix_select(s, lo, hi, double(top_k), key_of, [](int, uint32_t) { return 1.0; }, &unused) : 0u;

  // top-p over what top-k kept: the crossing key, and how many of its equal tokens stay
  uint32_t p_key = 0;
  int64_t ties_kept = 0, my_tie_start = 0;
  if (top_p < 1.f) {
    double own = 0.0;
    for (int i = lo; i < hi; ++i) own += key_of(i) >= k_floor ? mass(i) : 0.0;
    const double target = double(top_p) * block_sum(s, own);
    double above;
    p_key = radix_select(s, lo, hi, target, key_of,
                         [&](int i, uint32_t k) { return k >= k_floor ? mass(i) : 0.0; }, &above);
    double ties = 0.0;
    for (int i = lo; i < hi; ++i) ties += key_of(i) == p_key;
    s.chunk[t] = ties;
    __syncthreads();
    if (t == 0) {                    // exclusive scan of the chunks' tie counts; then the ties that stay
      double run = 0.0;
#pragma unroll 1   // serial scans over shared memory: unrolled, sm_80's ptxas spills
      for (int j = 0; j < kThreads; ++j) { const double c = s.chunk[j]; s.chunk[j] = run; run += c; }
      const double e = double(expf(key_value(p_key) - m));
      int64_t n = 0;
      while (n < int64_t(run) && above + double(n) * e < target) ++n;
      s.rest = double(n);
    }
    __syncthreads();
    my_tie_start = int64_t(s.chunk[t]);
    ties_kept = int64_t(s.rest);
    __syncthreads();
  }
  const uint32_t m_floor = min_p > 0.f ? order_key(m + logf(min_p)) : 0u;
  // the verdict on token i of this chunk, with `tie` the count of p_key tokens before it in the chunk
  auto keep = [&](int i, uint32_t k, int64_t tie) {
    if (k < k_floor || k < m_floor) return false;
    if (top_p >= 1.f || k > p_key) return true;
    return k == p_key && my_tie_start + tie < ties_kept;
  };

  // the draw: the first kept token whose cumulative mass passes u * total
  double own = 0.0;
  int64_t tie = 0;
  for (int i = lo; i < hi; ++i) {
    const uint32_t k = key_of(i);
    const bool ok = keep(i, k, tie);
    tie += top_p < 1.f && k == p_key;
    if (ok) own += mass(i);
    if (kept) kept[int64_t(row) * vocab + i] = ok;
  }
  s.chunk[t] = own;
  __syncthreads();
  if (t == 0) {
    double total = 0.0;
#pragma unroll 1
    for (int j = 0; j < kThreads; ++j) total += s.chunk[j];
    const double target = fmin(double(u) * total, total * (1.0 - 1.0 / (1 << 20)));
    double run = 0.0;
    int j = 0, last = 0;
#pragma unroll 1
    for (; j < kThreads; ++j) {
      if (!(s.chunk[j] > 0.0)) continue;
      last = j;
      if (run + s.chunk[j] > target) break;
      run += s.chunk[j];
    }
    if (j == kThreads) run -= s.chunk[j = last];   // rounding left the draw past the end: the last mass
    s.pick = j;
    s.rest = target - run;
  }
  __syncthreads();
  if (t == s.pick) {
    double run = 0.0;
    int64_t last = -1;
    tie = 0;
    for (int i = lo; i < hi; ++i) {
      const uint32_t k = key_of(i);
      const bool ok = keep(i, k, tie);
      tie += top_p < 1.f && k == p_key;
      if (!ok) continue;
      last = i;
      run += mass(i);
      if (run > s.rest) break;
    }
    out[row] = last < 0 ? 0 : last;  // a row with nothing kept (all masked) gets token 0
  }
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

// logits: [rows, vocab] float32 (row stride `stride`), params: [rows, 5] float32 (see sample_kernel),
// out: [rows] int64; kept: [rows, vocab] uint8 or null.
extern "C" const char* sample_launch(const float* logits, int64_t stride, int rows, int vocab, const float* params,
                                     int64_t* out, uint8_t* kept, void* stream) {
  if (rows == 0) return nullptr;
  [[maybe_unused]] const auto s = static_cast<cudaStream_t>(stream);   // the emulator runs on no stream
  LAUNCH_KERNEL(sample_kernel, dim3(rows), dim3(kThreads), s, logits, stride, vocab, params, out, kept);
  return last_error();
}
