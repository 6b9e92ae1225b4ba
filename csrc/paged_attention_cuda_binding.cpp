// PyTorch binding of csrc/paged_attention_cuda.cu, csrc/fused_cuda.cu and csrc/sampling_cuda.cu:
// checks shapes, dtypes, devices and strides (with the CPU backend's messages where the rule is the
// same), allocates the outputs and the split-context workspace, and hands raw pointers to the
// launchers on torch's current stream. Registered as torch.ops.nanoserve_cuda.{paged_attention,
// reshape_and_cache, rms_norm, add_rms_norm_, rope_, rope_and_cache_, silu_and_mul, sample}.
//
// It reads no tensor data: the model runner validated the batch and planned the launch on the
// host, from the lists it built the tensors from (paged_attention.plan_cuda_launch), so a call
// never waits for the GPU and can be captured in a CUDA graph. NANOSERVE_CHECK_INPUTS=1 turns on
// the fully checked path: block tables, context lengths, query offsets, the plan and every slot
// are copied to the host (a sync per call) and refused before a bad id becomes an illegal address
// that poisons the CUDA context.
// Built with -DNANOSERVE_CUDA_EMU (tests only), the same code runs on CPU tensors through
// csrc/cuda_emu.h and registers as torch.ops.nanoserve_cuda_emu; there a host read during an
// emulated capture is an error, as in a real one.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>

#ifdef NANOSERVE_CUDA_EMU
#define NANOSERVE_LIBRARY nanoserve_cuda_emu
#define NANOSERVE_DISPATCH CompositeExplicitAutograd   // every device: the tests pass meta tensors to reach the device checks
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#define NANOSERVE_LIBRARY nanoserve_cuda
#define NANOSERVE_DISPATCH CUDA
#endif

extern "C" int64_t paged_attention_workspace_floats(int num_seqs, int max_parts, int num_heads, int head_dim);
extern "C" const char* paged_attention_launch(
    void* out, const void* query, int64_t q_row_stride, const void* key_cache, const void* value_cache,
    const int* block_tables, const int* context_lens, const int* query_start_loc, const int* plan, int num_seqs,
    int max_parts, int num_prefill_items, float* workspace, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks, int q_dtype, int kv_dtype, float scale, void* stream);
extern "C" const char* reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                                void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                                int row, int64_t key_stride, int64_t value_stride, int q_dtype,
                                                int kv_dtype, void* stream);
extern "C" const char* rms_norm_launch(const void* x, int64_t x_stride, void* residual, int64_t r_stride,
                                       const void* weight, float eps, void* out, int64_t out_stride, int rows,
                                       int hidden, int dtype, int w_dtype, void* stream);
extern "C" const char* rope_launch(void* qkv, int64_t stride, const float* cos, const float* sin, int rows,
                                   int num_heads, int head_dim, int dtype, void* stream);
extern "C" const char* rope_and_cache_launch(void* qkv, int64_t stride, const float* cos, const float* sin,
                                             void* key_cache, void* value_cache, const int64_t* slots, int rows,
                                             int num_heads, int num_kv_heads, int head_dim, int dtype, int kv_dtype,
                                             void* stream);
extern "C" const char* silu_and_mul_launch(const void* gate_up, int64_t stride, void* out, int rows, int inter,
                                           int dtype, void* stream);
extern "C" const char* sample_launch(const float* logits, int64_t stride, int rows, int vocab, const float* params,
                                     int64_t* out, uint8_t* kept, void* stream);
#ifdef NANOSERVE_CUDA_EMU
extern "C" const char* cuda_emu_host_read(const char* what);
#endif

namespace {

#ifdef NANOSERVE_CUDA_EMU
constexpr auto kDevice = at::kCPU;
void* current_stream() { return nullptr; }
struct DeviceGuard { explicit DeviceGuard(at::Device) {} };
#else
constexpr auto kDevice = at::kCUDA;
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

// NANOSERVE_CHECK_INPUTS=1: read the batch back and check it (tests, debugging); read per call, so
// a test can turn it on and off.
bool check_inputs() {
  const char* flag = std::getenv("NANOSERVE_CHECK_INPUTS");
  return flag != nullptr && flag[0] == '1';
}

// The only way this file reads device data: a host copy, refused during an (emulated) capture.
at::Tensor host_copy(const at::Tensor& t, const char* what) {
#ifdef NANOSERVE_CUDA_EMU
  const char* capture_error = cuda_emu_host_read(what);
  TORCH_CHECK(capture_error == nullptr, capture_error);
  return t.clone();   // emulated device memory is host memory: the copy stands for the download
#else
  return t.cpu();
#endif
}

void check_index(const at::Tensor& t, const char* name, at::ScalarType type, int dims) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == dims && t.is_contiguous(), name, " must be a contiguous ",
              dims, "-D ", type, " tensor, got ", t.scalar_type(), " ", t.sizes());
}

// Rows of `name` strided, each row's elements contiguous: [rows, a, b] with strides (any, b, 1).
void check_row_view(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must have contiguous heads within each row (a view of the qkv output is fine)");
}

// What the kernels will read through query_start_loc, context_lens, block_tables and the plan,
// checked on host copies (NANOSERVE_CHECK_INPUTS=1); the CPU backend's rules and messages. A row
// with context 0 is a padding row (CUDA graph buckets): allowed; as a decode row its output is
// zeros, as a longer one no prefill item may cover it (its output rows are never written or read).
void check_batch(const at::Tensor& qsl, const at::Tensor& ctx, const at::Tensor& tables, const at::Tensor& plan,
                 int num_tokens, int num_blocks, int block_size, int max_parts, int num_prefill_items) {
  const int num_seqs = ctx.numel(), max_blocks = tables.size(1);
  const int* qs = qsl.const_data_ptr<int>();
  const int* cl = ctx.const_data_ptr<int>();
  const int* bt = tables.const_data_ptr<int>();
  const int* pl = plan.const_data_ptr<int>();
  TORCH_CHECK(qs[0] == 0 && qs[num_seqs] == num_tokens, "query_start_loc must run from 0 to num_tokens");
  TORCH_CHECK(pl[0] >= 1, "plan: partition size ", pl[0], " must be positive");
  for (int i = 0; i < num_seqs; ++i) {
    const int q_len = qs[i + 1] - qs[i];
    TORCH_CHECK(q_len >= 0 && (cl[i] >= q_len || cl[i] == 0), "sequence ", i,
                ": need 0 <= q_len (", q_len, ") <= context_len (", cl[i], ")");
    const int used_blocks = (cl[i] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= max_blocks, "sequence ", i, ": context_len ", cl[i], " needs ", used_blocks,
                " blocks, block_tables has ", max_blocks);
    for (int j = 0; j < (q_len ? used_blocks : 0); ++j) {
      const int block = bt[int64_t(i) * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", i, ": block id ", block, " outside [0, ",
                  num_blocks, ")");
    }
    const int parts = cl[i] <= pl[0] ? 1 : (cl[i] + pl[0] - 1) / pl[0];
    TORCH_CHECK(q_len != 1 || parts <= max_parts, "plan: sequence ", i, " needs ", parts,
                " decode partitions, the grid has ", max_parts);
  }
  for (int k = 0; k < num_prefill_items; ++k) {
    const int seq = pl[2 + 2 * k], row = pl[3 + 2 * k];
    if (seq == -1) continue;                                   // an empty item (a graph bucket's padding)
    TORCH_CHECK(seq >= 0 && seq < num_seqs && qs[seq + 1] - qs[seq] > 1 && row >= 0 &&
                    row < qs[seq + 1] - qs[seq] && cl[seq] >= qs[seq + 1] - qs[seq],
                "plan: prefill item ", k, " (", seq, ", ", row, ") is not a tile of a prefill row");
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start_loc, const at::Tensor& plan, double scale,
                           int64_t max_parts, int64_t num_prefill_items) {
  check_devices({{&query, "query"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                 {&block_tables, "block_tables"}, {&context_lens, "context_lens"},
                 {&query_start_loc, "query_start_loc"}, {&plan, "plan"}});
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
  check_row_view(query, "query");
  check_index(block_tables, "block_tables", at::kInt, 2);
  check_index(context_lens, "context_lens", at::kInt, 1);
  check_index(query_start_loc, "query_start_loc", at::kInt, 1);
  check_index(plan, "plan", at::kInt, 1);
  const int num_seqs = context_lens.numel();
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1, "query_start_loc must have num_seqs + 1 entries");
  TORCH_CHECK(max_parts >= 0 && num_prefill_items >= 0 && plan.numel() == 2 + 2 * num_prefill_items,
              "plan must hold 2 + 2 x num_prefill_items ints (paged_attention.plan_cuda_launch)");
  const DeviceGuard guard(query.device());
  if (check_inputs())
    check_batch(host_copy(query_start_loc, "query_start_loc"), host_copy(context_lens, "context_lens"),
                host_copy(block_tables, "block_tables"), host_copy(plan, "plan"), num_tokens, num_blocks,
                block_size, max_parts, num_prefill_items);
  auto out = at::empty({num_tokens, num_heads, head_dim}, query.options());
  // from the caching allocator: under a graph capture, a fixed address in the graph's pool
  const auto workspace = at::empty({paged_attention_workspace_floats(num_seqs, max_parts, num_heads, head_dim)},
                                   query.options().dtype(at::kFloat));
  const char* err = paged_attention_launch(
      out.data_ptr(), query.const_data_ptr(), query.stride(0), key_cache.const_data_ptr(),
      value_cache.const_data_ptr(), block_tables.const_data_ptr<int>(), context_lens.const_data_ptr<int>(),
      query_start_loc.const_data_ptr<int>(), plan.const_data_ptr<int>(), num_seqs, max_parts, num_prefill_items,
      workspace.numel() ? workspace.data_ptr<float>() : nullptr, num_heads, num_kv_heads, head_dim, block_size,
      block_tables.size(1), q_dtype, dtype_code(key_cache, "KV cache"), static_cast<float>(scale), current_stream());
  TORCH_CHECK(err == nullptr, "paged_attention (cuda): ", err);
  return out;
}

// Under NANOSERVE_CHECK_INPUTS=1, every slot must be in the cache or -1 (a sync: the slots are read back).
void check_slots(const at::Tensor& slot_mapping, int64_t num_slots) {
  if (!check_inputs()) return;
  const auto slots_host = host_copy(slot_mapping, "slot_mapping");
  const int64_t* s = slots_host.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < slot_mapping.numel(); ++i)
    TORCH_CHECK(s[i] >= -1 && s[i] < num_slots, "slot_mapping[", i, "] = ", s[i], " outside [0, ", num_slots,
                ") (or -1: not cached)");
}

// Copy row i of key/value into slot slot_mapping[i] of the caches; slot -1 means "do not cache
// this row" (vLLM's pad slot). Any other slot outside the cache is refused under
// NANOSERVE_CHECK_INPUTS=1; without it the model runner's slots are trusted.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  check_devices({{&key, "key"}, {&value, "value"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                 {&slot_mapping, "slot_mapping"}});
  check_kv_cache(key_cache, value_cache);
  const int q_dtype = dtype_code(key, "key");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "value dtype must match key's");
  check_index(slot_mapping, "slot_mapping", at::kLong, 1);
  const DeviceGuard guard(key.device());
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row = key_cache.size(2) * key_cache.size(3), n = slot_mapping.numel();
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(0) == n && value.size(0) == n &&
                  key.size(1) * key.size(2) == row && value.sizes() == key.sizes(),
              "key/value must be [num_tokens, num_kv_heads, head_dim] matching slot_mapping and the cache");
  check_row_view(key, "key");
  check_row_view(value, "value");
  check_slots(slot_mapping, num_slots);
  const char* err = reshape_and_cache_launch(key.const_data_ptr(), value.const_data_ptr(), key_cache.data_ptr(),
                                             value_cache.data_ptr(), slot_mapping.const_data_ptr<int64_t>(), n, row,
                                             key.stride(0), value.stride(0), q_dtype,
                                             dtype_code(key_cache, "KV cache"), current_stream());
  TORCH_CHECK(err == nullptr, "reshape_and_cache (cuda): ", err);
}

// ---- the fused per-layer ops (csrc/fused_cuda.cu): fused_ops.py's contract --------------------

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be 2-D with contiguous rows");
  dtype_code(x, name);
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK((weight.scalar_type() == at::kFloat || weight.scalar_type() == x.scalar_type()) &&
                  weight.dim() == 1 && weight.numel() == x.size(1) && weight.is_contiguous(),
              "weight must be [hidden], float32 or x's dtype");
  check_devices({{&x, "x"}, {&weight, "weight"}});
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  const DeviceGuard guard(x.device());
  auto out = at::empty(x.sizes(), x.options());
  const char* err = rms_norm_launch(x.const_data_ptr(), x.stride(0), nullptr, 0, weight.const_data_ptr(), float(eps),
                                    out.data_ptr(), out.stride(0), x.size(0), x.size(1), dtype_code(x, "x"),
                                    dtype_code(weight, "weight"), current_stream());
  TORCH_CHECK(err == nullptr, "rms_norm (cuda): ", err);
  return out;
}

void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device() == x.device(), "residual must match x in shape, dtype and device");
  const DeviceGuard guard(x.device());
  const char* err = rms_norm_launch(x.const_data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                                    weight.const_data_ptr(), float(eps), x.data_ptr(), x.stride(0), x.size(0),
                                    x.size(1), dtype_code(x, "x"), dtype_code(weight, "weight"), current_stream());
  TORCH_CHECK(err == nullptr, "add_rms_norm_ (cuda): ", err);
}

void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "num_heads x head_dim exceeds qkv's row");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == qkv.size(0) &&
                    t->size(1) == head_dim / 2, "cos/sin must be float32 [num_tokens, head_dim / 2]");
  check_devices({{&qkv, "qkv"}, {&cos, "cos"}, {&sin, "sin"}});
  const DeviceGuard guard(qkv.device());
  const char* err = rope_launch(qkv.data_ptr(), qkv.stride(0), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
                                qkv.size(0), num_heads, head_dim, dtype_code(qkv, "qkv"), current_stream());
  TORCH_CHECK(err == nullptr, "rope_ (cuda): ", err);
}

// rope_ on q and k fused with reshape_and_cache of the rotated k and v: qkv [T, (nh + 2 nkv) x hd].
void rope_and_cache_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_cache,
                     at::Tensor value_cache, const at::Tensor& slot_mapping, int64_t num_heads) {
  check_rows(qkv, "qkv");
  check_kv_cache(key_cache, value_cache);
  check_index(slot_mapping, "slot_mapping", at::kLong, 1);
  const int64_t nkv = key_cache.size(2), hd = key_cache.size(3), n = qkv.size(0);
  TORCH_CHECK(hd % 2 == 0 && qkv.size(1) == (num_heads + 2 * nkv) * hd && slot_mapping.numel() == n,
              "qkv must be [num_tokens, (num_heads + 2 num_kv_heads) x head_dim] matching the cache and slot_mapping");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == hd / 2, "cos/sin must be float32 [num_tokens, head_dim / 2]");
  check_devices({{&qkv, "qkv"}, {&cos, "cos"}, {&sin, "sin"}, {&key_cache, "key_cache"},
                 {&value_cache, "value_cache"}, {&slot_mapping, "slot_mapping"}});
  const DeviceGuard guard(qkv.device());
  check_slots(slot_mapping, key_cache.size(0) * key_cache.size(1));
  const char* err = rope_and_cache_launch(qkv.data_ptr(), qkv.stride(0), cos.const_data_ptr<float>(),
                                          sin.const_data_ptr<float>(), key_cache.data_ptr(), value_cache.data_ptr(),
                                          slot_mapping.const_data_ptr<int64_t>(), n, num_heads, nkv, hd,
                                          dtype_code(qkv, "qkv"), dtype_code(key_cache, "KV cache"), current_stream());
  TORCH_CHECK(err == nullptr, "rope_and_cache_ (cuda): ", err);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must be [num_tokens, 2 x intermediate]");
  check_devices({{&gate_up, "gate_up"}});
  const DeviceGuard guard(gate_up.device());
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  const char* err = silu_and_mul_launch(gate_up.const_data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.size(0),
                                        inter, dtype_code(gate_up, "gate_up"), current_stream());
  TORCH_CHECK(err == nullptr, "silu_and_mul (cuda): ", err);
  return out;
}

// ---- the sampler's filters and draw (csrc/sampling_cuda.cu): sampler.draw's contract -------------

at::Tensor sample(const at::Tensor& logits, const at::Tensor& params) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.is_contiguous() && params.dim() == 2 &&
                  params.size(0) == logits.size(0) && params.size(1) == 5,
              "params must be float32 [rows, 5]: 1 / temperature, top_k, top_p, min_p, uniform");
  check_devices({{&logits, "logits"}, {&params, "params"}});
  const DeviceGuard guard(logits.device());
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const char* err = sample_launch(logits.const_data_ptr<float>(), logits.stride(0), logits.size(0), logits.size(1),
                                  params.const_data_ptr<float>(), out.data_ptr<int64_t>(), nullptr, current_stream());
  TORCH_CHECK(err == nullptr, "sample (cuda): ", err);
  return out;
}

}  // namespace

// through a second macro, so the library's name and dispatch key are expanded first
#define DEFINE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define IMPLEMENT_LIBRARY(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

DEFINE_LIBRARY(NANOSERVE_LIBRARY, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start_loc, Tensor plan, float scale, int max_parts, "
        "int num_prefill_items) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def("rope_and_cache_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) key_cache, Tensor(c!) value_cache, "
        "Tensor slot_mapping, int num_heads) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("sample(Tensor logits, Tensor params) -> Tensor");
}

IMPLEMENT_LIBRARY(NANOSERVE_LIBRARY, NANOSERVE_DISPATCH, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("rope_and_cache_", &rope_and_cache_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("sample", &sample);
}
