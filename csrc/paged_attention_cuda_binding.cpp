// PyTorch binding of csrc/paged_attention_cuda.cu: checks every input (with the CPU backend's
// messages where the rule is the same), plans the launch on the host, allocates the output and
// the split-context workspace, and hands raw pointers to the launchers on torch's current stream.
// Registered as torch.ops.nanoserve_cuda.{paged_attention, reshape_and_cache}.
//
// The checks and the plan read query_start_loc, context_lens, block_tables and slot_mapping on
// the host: one small device-to-host copy (a sync) per call, the price of refusing a bad block
// id or slot before it becomes an illegal address that poisons the CUDA context.
// Built with -DNANOSERVE_CUDA_EMU (tests only), the same code runs on CPU tensors through
// csrc/cuda_emu.h and registers as torch.ops.nanoserve_cuda_emu, with a fixed fake SM count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>

#ifdef NANOSERVE_CUDA_EMU
#define NANOSERVE_LIBRARY nanoserve_cuda_emu
#define NANOSERVE_DISPATCH CompositeExplicitAutograd   // every device: the tests pass meta tensors to reach the device checks
struct int2 { int x, y; };
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#define NANOSERVE_LIBRARY nanoserve_cuda
#define NANOSERVE_DISPATCH CUDA
#endif

extern "C" int64_t paged_attention_plan(const int* query_start_loc, const int* context_lens, int num_seqs,
                                        int group, int num_kv_heads, int num_sms, int partition_size, int2* plan,
                                        int64_t* counts);
extern "C" int64_t paged_attention_workspace_floats(const int64_t* counts, int num_heads, int head_dim);
extern "C" const char* paged_attention_launch(
    void* out, const void* query, const void* key_cache, const void* value_cache, const int* block_tables,
    const int* context_lens, const int* query_start_loc, const int2* plan, const int64_t* counts, float* workspace,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int q_dtype, int kv_dtype,
    float scale, void* stream);
extern "C" const char* reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                                void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                                int row, int q_dtype, int kv_dtype, void* stream);

namespace {

#ifdef NANOSERVE_CUDA_EMU
constexpr auto kDevice = at::kCPU;
constexpr int kEmulatedSMs = 4;   // small, so the tests' short contexts get split
int sm_count() { return kEmulatedSMs; }
void* current_stream() { return nullptr; }
struct DeviceGuard { explicit DeviceGuard(at::Device) {} };
#else
constexpr auto kDevice = at::kCUDA;
int sm_count() {   // of the current device (the guard has set it)
  int sms = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()) == cudaSuccess,
              "cannot read the device's SM count");
  return sms;
}
void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
using DeviceGuard = c10::cuda::CUDAGuard;
#endif

int dtype_code(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, name, " dtype must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return -1;
}

// Every tensor of a call on the query's (or key's) device, and that device the kernel's kind.
void check_devices(std::initializer_list<std::pair<const at::Tensor*, const char*>> tensors) {
  const auto device = tensors.begin()->first->device();
  TORCH_CHECK(device.type() == kDevice, tensors.begin()->second, " must be on a ", kDevice, " device, got ", device);
  for (const auto& [t, name] : tensors)
    TORCH_CHECK(t->device() == device, name, " is on ", t->device(), " but ", tensors.begin()->second, " is on ",
                device, ": all tensors must be on one device");
}

void check_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache) {   // as the CPU backend
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.dtype() == key_cache.dtype(),
              "value_cache must match key_cache in shape and dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  dtype_code(key_cache, "KV cache");
}

// What the kernels will read through query_start_loc, context_lens and block_tables, checked
// on host copies; the CPU backend's rules and messages.
void check_batch(const at::Tensor& qsl, const at::Tensor& ctx, const at::Tensor& tables, int num_tokens,
                 int num_blocks, int block_size) {
  const int num_seqs = ctx.numel(), max_blocks = tables.size(1);
  const int* qs = qsl.const_data_ptr<int>();
  const int* cl = ctx.const_data_ptr<int>();
  const int* bt = tables.const_data_ptr<int>();
  TORCH_CHECK(qs[0] == 0 && qs[num_seqs] == num_tokens, "query_start_loc must run from 0 to num_tokens");
  for (int i = 0; i < num_seqs; ++i) {
    const int q_len = qs[i + 1] - qs[i];
    TORCH_CHECK(q_len >= 0 && cl[i] >= q_len, "sequence ", i, ": need 0 <= q_len (", q_len, ") <= context_len (",
                cl[i], ")");
    const int used_blocks = (cl[i] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= max_blocks, "sequence ", i, ": context_len ", cl[i], " needs ", used_blocks,
                " blocks, block_tables has ", max_blocks);
    for (int j = 0; j < (q_len ? used_blocks : 0); ++j) {
      const int block = bt[int64_t(i) * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", i, ": block id ", block, " outside [0, ",
                  num_blocks, ")");
    }
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start_loc, double scale) {
  check_devices({{&query, "query"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                 {&block_tables, "block_tables"}, {&context_lens, "context_lens"},
                 {&query_start_loc, "query_start_loc"}});
  check_kv_cache(key_cache, value_cache);
  TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, head_dim], got ", query.sizes());
  const int num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const int num_tokens = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(query.size(2) == head_dim, "query head_dim ", query.size(2), " != cache head_dim ", head_dim);
  TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 128, "head_dim must be a multiple of 32, at most 128, got ",
              head_dim);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads ", num_heads, " must be a multiple of num_kv_heads ",
              num_kv_heads);
  TORCH_CHECK(num_heads / num_kv_heads <= 8, "num_heads / num_kv_heads must be at most 8, got ",
              num_heads / num_kv_heads);
  const int q_dtype = dtype_code(query, "query");
  const DeviceGuard guard(query.device());
  const auto q = query.contiguous();
  const auto tables = block_tables.to(at::kInt).contiguous();
  const auto ctx = context_lens.to(at::kInt).contiguous();
  const auto qsl = query_start_loc.to(at::kInt).contiguous();
  const int num_seqs = ctx.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(qsl.numel() == num_seqs + 1, "query_start_loc must have num_seqs + 1 entries");
  const auto tables_host = tables.cpu(), ctx_host = ctx.cpu(), qsl_host = qsl.cpu();   // one sync
  check_batch(qsl_host, ctx_host, tables_host, num_tokens, num_blocks, block_size);

  int64_t counts[4];
  const int group = num_heads / num_kv_heads, sms = sm_count();
  const int64_t plan_ints = paged_attention_plan(qsl_host.const_data_ptr<int>(), ctx_host.const_data_ptr<int>(),
                                                 num_seqs, group, num_kv_heads, sms, 0, nullptr, counts);
  auto plan_host = at::empty({plan_ints}, qsl_host.options());
  paged_attention_plan(qsl_host.const_data_ptr<int>(), ctx_host.const_data_ptr<int>(), num_seqs, group,
                       num_kv_heads, sms, 0, reinterpret_cast<int2*>(plan_host.mutable_data_ptr<int>()), counts);
  const auto plan = plan_host.to(q.device());
  auto out = at::empty_like(q);
  const auto workspace = at::empty({paged_attention_workspace_floats(counts, num_heads, head_dim)},
                                   q.options().dtype(at::kFloat));
  const char* err = paged_attention_launch(
      out.data_ptr(), q.const_data_ptr(), key_cache.const_data_ptr(), value_cache.const_data_ptr(),
      tables.const_data_ptr<int>(), ctx.const_data_ptr<int>(), qsl.const_data_ptr<int>(),
      reinterpret_cast<const int2*>(plan.const_data_ptr<int>()), counts,
      workspace.numel() ? workspace.data_ptr<float>() : nullptr, num_heads, num_kv_heads, head_dim, block_size,
      tables.size(1), q_dtype, dtype_code(key_cache, "KV cache"), static_cast<float>(scale), current_stream());
  TORCH_CHECK(err == nullptr, "paged_attention (cuda): ", err);
  return out;
}

// Copy row i of key/value into slot slot_mapping[i] of the caches; slot -1 means "do not cache
// this row" (vLLM's pad slot), any other slot outside the cache is refused.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  check_devices({{&key, "key"}, {&value, "value"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                 {&slot_mapping, "slot_mapping"}});
  check_kv_cache(key_cache, value_cache);
  const int q_dtype = dtype_code(key, "key");
  const DeviceGuard guard(key.device());
  const auto k = key.contiguous(), v = value.to(key.scalar_type()).contiguous();
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row = key_cache.size(2) * key_cache.size(3), n = slots.numel();
  TORCH_CHECK(k.numel() == n * row && v.numel() == n * row,
              "key/value must be [num_tokens, num_kv_heads, head_dim] matching slot_mapping and the cache");
  const auto slots_host = slots.cpu();                                                   // one sync
  const int64_t* s = slots_host.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(s[i] >= -1 && s[i] < num_slots, "slot_mapping[", i, "] = ", s[i], " outside [0, ", num_slots,
                ") (or -1: not cached)");
  const char* err = reshape_and_cache_launch(k.const_data_ptr(), v.const_data_ptr(), key_cache.data_ptr(),
                                             value_cache.data_ptr(), slots.const_data_ptr<int64_t>(), n, row,
                                             q_dtype, dtype_code(key_cache, "KV cache"), current_stream());
  TORCH_CHECK(err == nullptr, "reshape_and_cache (cuda): ", err);
}

}  // namespace

// through a second macro, so the library's name and dispatch key are expanded first
#define DEFINE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define IMPLEMENT_LIBRARY(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

DEFINE_LIBRARY(NANOSERVE_LIBRARY, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

IMPLEMENT_LIBRARY(NANOSERVE_LIBRARY, NANOSERVE_DISPATCH, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
