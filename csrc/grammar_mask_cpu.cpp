// CPU kernel behind structured_output.py's grammar mask: applies llguidance's packed bitmask to
// the logits in place, so no [rows, vocab] bool tensor and no gather/scatter of logit rows exist.
//   apply_token_bitmask_(logits, bitmask, rows)   for each j: logits[rows[j], t] = -inf wherever
//                                                  bit t of bitmask[j] is 0 (bit t is bit t % 32 of
//                                                  word t / 32, llguidance's layout)
// logits: [num_rows, vocab] float32 or bfloat16, rows contiguous; bitmask: [g, ceil(vocab / 32)]
// int32; rows: [g] int64, distinct. A word with every bit set (32 allowed tokens) costs one compare,
// one with none set 32 stores; any other is a branch-free select over its 32 logits, which the
// compiler turns into vector blends.
// Parallel over the g rows with torch's threads. Registered as torch.ops.nanoserve_grammar.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

// One row: tokens [w * 32, w * 32 + width) are word w's; the last word may be partial.
template <typename T>
void ban_row(T* row, const int32_t* words, int64_t vocab) {
  const T neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t w = 0; w * 32 < vocab; ++w) {
    const uint32_t banned = ~uint32_t(words[w]);
    if (banned == 0) continue;                                  // all 32 allowed: common inside strings
    T* x = row + w * 32;
    if (vocab - w * 32 >= 32 && banned == 0xffffffffu) {
      for (int b = 0; b < 32; ++b) x[b] = neg_inf;             // all 32 banned: stores only, no loads
    } else if (vocab - w * 32 >= 32) {
      for (int b = 0; b < 32; ++b)                              // branch-free select: vector blends
        x[b] = (banned >> b) & 1 ? neg_inf : x[b];
    } else {
      for (int b = 0; b < vocab - w * 32; ++b)                  // never touch memory past the row
        x[b] = (banned >> b) & 1 ? neg_inf : x[b];
    }
  }
}

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [num_rows, vocab] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  const int64_t vocab = logits.size(1), g = rows.numel();
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "bitmask must be a contiguous int32 [g, words] tensor");
  TORCH_CHECK(bitmask.size(0) >= g && bitmask.size(1) == (vocab + 31) / 32,
              "bitmask must have at least one row per entry of rows and ceil(vocab / 32) words");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong, "rows must be int64 [g]");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < g; ++j)
    TORCH_CHECK(0 <= row_ids[j] && row_ids[j] < logits.size(0), "rows entry out of range");
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  const int64_t words = bitmask.size(1), stride = logits.stride(0);
  // a row is ~0.02 ms of work: waking a sleeping thread costs more than that, so batches up to
  // 64 rows run on the calling thread and only larger ones are split
  at::parallel_for(0, g, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (logits.scalar_type() == at::kFloat)
        ban_row(logits.data_ptr<float>() + row_ids[j] * stride, bits + j * words, vocab);
      else
        ban_row(logits.data_ptr<at::BFloat16>() + row_ids[j] * stride, bits + j * words, vocab);
    }
  });
}

}  // namespace

TORCH_LIBRARY(nanoserve_grammar, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(nanoserve_grammar, CPU, m) {
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
}
