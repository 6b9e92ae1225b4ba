// One Llama decoder layer as one op on the CPU, for layers whose four linears run 8-bit activations
// (csrc/int8_cpu.cpp's linear_q8): model.DecoderLayer.forward in C++, so a decode step makes one op
// call per layer instead of ~10 ops, ~20 views and reshapes, and 9 Python module calls.
//
//   decoder_layer(x, residual, weights, ints, cos, sin, key_cache, value_cache, slot_mapping,
//                 block_tables, context_lens, query_start_loc, scale, num_heads, num_kv_heads,
//                 head_dim, batch_invariant, keep) -> (mlp out, residual)
//
// x [T, hidden] float32 is the last layer's MLP output, residual the stream without it (None before
// the first layer: then x is the embedding, the residual it). weights: the two norms' weights, then
// per linear (qkv, o, gate_up, down) its linear_q8 tensors w, d, m, sw and its bias; ints: per
// linear its out_features and activation group (cpu_linear.Q8Panels, Linear.q8_panels).
// keep: the rows to carry past attention (the last layer's rows that get logits), or None.
// x and residual are rewritten in place, as model.py's fused add + RMSNorm does.
//
// It holds no math of its own: it calls the ops that model.py's Python path calls, through the
// dispatcher (each handle looked up once), so the kernels stay in their files (int8_cpu.cpp,
// fused_cpu.cpp, paged_attention_cpu.cpp) and this file is only the layer's order of calls. Those
// libraries are loaded before this one (extensions.py). Registered as torch.ops.nanoserve_layer.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/index_select.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using OptTensor = std::optional<at::Tensor>;

// The ops' C++ signatures, exactly as their files register them (the dispatcher checks).
using LinearQ8 = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                            const OptTensor&, int64_t, int64_t, const OptTensor&);
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = void(at::Tensor, at::Tensor, const at::Tensor&, double);
using Rope = void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using RopeAndCache = void(at::Tensor, const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
                          const at::Tensor&, int64_t, int64_t, int64_t);
using SiluAndMul = at::Tensor(const at::Tensor&);
using PagedAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, double, bool);
using ReshapeAndCache = void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&);

template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Ops {   // looked up at the first call: the other libraries register them at their load
  c10::TypedOperatorHandle<LinearQ8> linear_q8 = op<LinearQ8>("nanoserve_linear::linear_q8");
  c10::TypedOperatorHandle<RmsNorm> rms_norm = op<RmsNorm>("nanoserve_fused::rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm_ = op<AddRmsNorm>("nanoserve_fused::add_rms_norm_");
  c10::TypedOperatorHandle<Rope> rope_ = op<Rope>("nanoserve_fused::rope_");
  c10::TypedOperatorHandle<RopeAndCache> rope_and_cache_ = op<RopeAndCache>("nanoserve_fused::rope_and_cache_");
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul = op<SiluAndMul>("nanoserve_fused::silu_and_mul");
  c10::TypedOperatorHandle<PagedAttention> paged_attention = op<PagedAttention>("nanoserve_cpu::paged_attention");
  c10::TypedOperatorHandle<ReshapeAndCache> reshape_and_cache = op<ReshapeAndCache>("nanoserve_cpu::reshape_and_cache");
};

const Ops& ops() {
  static const Ops handles;
  return handles;
}

constexpr int kNorms = 2, kPerLinear = 5, kLinears = 4;   // weights: 2 norms, then (w, d, m, sw, bias) x 4
enum Linear { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

at::Tensor required(const c10::List<OptTensor>& weights, int i, const char* what) {
  OptTensor t = weights.get(i);
  TORCH_CHECK(t.has_value(), "decoder_layer: weights[", i, "] (", what, ") is None");
  return *t;
}

// x [T, K] -> [T, out_features of linear i]: linear_q8 with that linear's tensors.
at::Tensor linear(const at::Tensor& x, const c10::List<OptTensor>& weights, at::IntArrayRef ints, int i) {
  const int base = kNorms + kPerLinear * i;
  return ops().linear_q8.call(x, required(weights, base, "w"), weights.get(base + 1), weights.get(base + 2),
                              weights.get(base + 3), ints[2 * i], ints[2 * i + 1], weights.get(base + 4));
}

// residual += x, x = RMSNorm(residual) in place; before the first layer (no residual) the norm of x
// into a new tensor, and x becomes the residual. -> the normed rows.
at::Tensor add_norm(at::Tensor& x, std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  if (!residual) {
    residual = x;
    return ops().rms_norm.call(x, weight, eps);
  }
  ops().add_rms_norm_.call(x, *residual, weight, eps);
  return x;
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor x, std::optional<at::Tensor> residual, const c10::List<OptTensor>& weights,
    at::IntArrayRef ints, double eps, const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_cache,
    at::Tensor value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, const at::Tensor& query_start_loc, double scale, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, bool batch_invariant, const std::optional<at::Tensor>& keep) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decoder_layer: x must be float32 [T, hidden]");
  TORCH_CHECK(weights.size() == kNorms + kPerLinear * kLinears && ints.size() == 2 * kLinears,
              "decoder_layer: weights must hold 2 norms and 5 tensors per linear, ints 2 per linear");
  const int64_t T = x.size(0), q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  TORCH_CHECK(ints[2 * kQkv] == q_width + 2 * kv_width, "decoder_layer: qkv_proj's out_features ", ints[0],
              " != (num_heads + 2 num_kv_heads) head_dim");

  // attention: norm, qkv, RoPE and the KV-cache write, paged attention over the cache, o_proj
  at::Tensor h = add_norm(x, residual, required(weights, 0, "input_layernorm"), eps);
  at::Tensor qkv = linear(h, weights, ints, kQkv);                            // [T, (nh + 2 nkv) hd]
  const auto kv = key_cache.scalar_type();
  if (value_cache.scalar_type() == kv && (kv == qkv.scalar_type() || kv == at::kBFloat16)) {   // one pass (fused_cpu.cpp)
    ops().rope_and_cache_.call(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
                               head_dim);
  } else {                                    // another cache dtype (float16): the write converts
    ops().rope_.call(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    ops().reshape_and_cache.call(qkv.narrow(1, q_width, kv_width).view({T, num_kv_heads, head_dim}),
                                 qkv.narrow(1, q_width + kv_width, kv_width).view({T, num_kv_heads, head_dim}),
                                 key_cache, value_cache, slot_mapping);
  }
  const at::Tensor q = qkv.narrow(1, 0, q_width).view({T, num_heads, head_dim});   // a view of qkv
  at::Tensor o = ops().paged_attention.call(q, key_cache, value_cache, block_tables, context_lens,
                                            query_start_loc, scale, batch_invariant);   // [T, nh, hd]
  at::Tensor out = linear(o.view({T, q_width}), weights, ints, kO);          // [T, hidden]
  at::Tensor res = *residual;
  if (keep) {                                 // [T, hidden] -> [num_sampled, hidden]
    out = at::index_select(out, 0, *keep);
    res = at::index_select(res, 0, *keep);
  }

  // MLP: norm, gate_up, SwiGLU, down
  std::optional<at::Tensor> r = res;
  h = add_norm(out, r, required(weights, 1, "post_attention_layernorm"), eps);
  at::Tensor act = ops().silu_and_mul.call(linear(h, weights, ints, kGateUp));   // [T, inter]
  return {linear(act, weights, ints, kDown), res};                           // [T, hidden], residual
}

}  // namespace

TORCH_LIBRARY(nanoserve_layer, m) {
  m.def("decoder_layer(Tensor(a!) x, Tensor(b!)? residual, Tensor?[] weights, int[] ints, float eps, Tensor cos, "
        "Tensor sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start_loc, float scale, int num_heads, int num_kv_heads, int head_dim, "
        "bool batch_invariant, Tensor? keep) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nanoserve_layer, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
}
