// Thin PyTorch binding of csrc/paged_attention_cuda.cu: checks tensors, allocates the output
// and the split-context workspace, and hands raw pointers to the launchers on torch's current
// stream. Registered as torch.ops.nanoserve_cuda.{paged_attention, reshape_and_cache}.
// Built only with a CUDA build of torch (paged_attention.py does it on first use).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

extern "C" int64_t paged_attention_workspace_floats(int num_seqs, int num_heads, int head_dim, int block_size,
                                                    int max_blocks, int partition_size);
extern "C" const char* paged_attention_launch(
    void* out, const void* query, const void* key_cache, const void* value_cache, const int* block_tables,
    const int* context_lens, const int* query_start_loc, float* workspace, int num_seqs, int num_tokens,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int q_dtype, int kv_dtype,
    float scale, int partition_size, void* stream);
extern "C" const char* reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                                void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                                int row, int q_dtype, int kv_dtype, void* stream);

namespace {

int dtype_code(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, name, " dtype must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return -1;
}

void check_cuda_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), name, " must be a contiguous CUDA tensor");
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "query [num_tokens, num_heads, head_dim], caches [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(key_cache.dtype() == value_cache.dtype(), "key_cache and value_cache dtypes differ");
  const c10::cuda::CUDAGuard guard(query.device());
  const auto q = query.contiguous();
  const auto tables = block_tables.to(at::kInt).contiguous();
  const auto ctx = context_lens.to(at::kInt).contiguous();
  const auto qsl = query_start_loc.to(at::kInt).contiguous();
  check_cuda_contiguous(key_cache, "key_cache");
  check_cuda_contiguous(value_cache, "value_cache");
  check_cuda_contiguous(q, "query");
  check_cuda_contiguous(tables, "block_tables");
  check_cuda_contiguous(ctx, "context_lens");
  check_cuda_contiguous(qsl, "query_start_loc");
  const int num_seqs = ctx.numel(), head_dim = key_cache.size(3), block_size = key_cache.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && qsl.numel() == num_seqs + 1,
              "block_tables must be [num_seqs, max_blocks] and query_start_loc [num_seqs + 1]");
  auto out = at::empty_like(q);
  const auto workspace = at::empty({paged_attention_workspace_floats(num_seqs, q.size(1), head_dim, block_size,
                                                                     tables.size(1), 0)},
                                   q.options().dtype(at::kFloat));
  const char* err = paged_attention_launch(
      out.data_ptr(), q.const_data_ptr(), key_cache.const_data_ptr(), value_cache.const_data_ptr(),
      tables.const_data_ptr<int>(), ctx.const_data_ptr<int>(), qsl.const_data_ptr<int>(),
      workspace.numel() ? workspace.data_ptr<float>() : nullptr, num_seqs, q.size(0), q.size(1), key_cache.size(2),
      head_dim, block_size, tables.size(1), dtype_code(q, "query"), dtype_code(key_cache, "KV cache"),
      static_cast<float>(scale), 0, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "paged_attention (cuda): ", err);
  return out;
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  const c10::cuda::CUDAGuard guard(key.device());
  const auto k = key.contiguous(), v = value.to(key.scalar_type()).contiguous();
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  check_cuda_contiguous(k, "key");
  check_cuda_contiguous(v, "value");
  check_cuda_contiguous(key_cache, "key_cache");
  check_cuda_contiguous(value_cache, "value_cache");
  check_cuda_contiguous(slots, "slot_mapping");
  const int64_t row = key_cache.size(2) * key_cache.size(3);
  TORCH_CHECK(k.numel() == slots.numel() * row && v.numel() == k.numel(),
              "key/value must be [num_tokens, num_kv_heads, head_dim] matching slot_mapping and the cache");
  const char* err = reshape_and_cache_launch(k.const_data_ptr(), v.const_data_ptr(), key_cache.data_ptr(),
                                             value_cache.data_ptr(), slots.const_data_ptr<int64_t>(), slots.numel(),
                                             row, dtype_code(k, "key"), dtype_code(key_cache, "KV cache"),
                                             c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "reshape_and_cache (cuda): ", err);
}

}  // namespace

TORCH_LIBRARY(nanoserve_cuda, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(nanoserve_cuda, CUDA, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
