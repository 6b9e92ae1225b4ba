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
//   decoder_layers(x, weights, ints, ..., key_caches, value_caches, ..., keep) -> (mlp out, residual)
//
// is every layer of a step in one op (model.Llama.forward's loop): x the embedding, weights and ints
// each layer's in turn, one key and value cache per layer, keep for the last layer.
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

at::Tensor required(const c10::List<OptTensor>& weights, int64_t i, const char* what) {
  OptTensor t = weights.get(i);
  TORCH_CHECK(t.has_value(), "decoder_layer: weights[", i, "] (", what, ") is None");
  return *t;
}

// One layer's slice of the op's arguments: its tensors start at weights[w0], its ints at ints[0].
struct LayerArgs {
  const c10::List<OptTensor>& weights;
  int64_t w0;
  at::IntArrayRef ints;
  at::Tensor get(int i, const char* what) const { return required(weights, w0 + i, what); }
};

// x [T, K] -> [T, out_features of linear i]: linear_q8 with that linear's tensors.
at::Tensor linear(const at::Tensor& x, const LayerArgs& a, int i) {
  const int64_t base = a.w0 + kNorms + kPerLinear * i;
  const auto& w = a.weights;
  return ops().linear_q8.call(x, required(w, base, "w"), w.get(base + 1), w.get(base + 2), w.get(base + 3),
                              a.ints[2 * i], a.ints[2 * i + 1], w.get(base + 4));
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

// What every layer of a step shares: where its tokens go in the caches and the attention's shape.
struct Step {
  const at::Tensor &cos, &sin, &slot_mapping, &block_tables, &context_lens, &query_start_loc;
  double eps, scale;
  int64_t num_heads, num_kv_heads, head_dim;
  bool batch_invariant;
};

// One layer: model.DecoderLayer.forward's calls in its order -> (MLP out, residual).
std::tuple<at::Tensor, at::Tensor> layer(at::Tensor x, std::optional<at::Tensor> residual, const LayerArgs& a,
                                         const Step& st, at::Tensor key_cache, at::Tensor value_cache,
                                         const std::optional<at::Tensor>& keep) {
  const int64_t T = x.size(0), nh = st.num_heads, nkv = st.num_kv_heads, hd = st.head_dim;
  const int64_t q_width = nh * hd, kv_width = nkv * hd;
  TORCH_CHECK(a.ints[2 * kQkv] == q_width + 2 * kv_width, "decoder_layer: qkv_proj's out_features ", a.ints[0],
              " != (num_heads + 2 num_kv_heads) head_dim");

  // attention: norm, qkv, RoPE and the KV-cache write, paged attention over the cache, o_proj
  at::Tensor h = add_norm(x, residual, a.get(0, "input_layernorm"), st.eps);
  at::Tensor qkv = linear(h, a, kQkv);                                        // [T, (nh + 2 nkv) hd]
  const auto kv = key_cache.scalar_type();
  if (value_cache.scalar_type() == kv && (kv == qkv.scalar_type() || kv == at::kBFloat16)) {   // one pass (fused_cpu.cpp)
    ops().rope_and_cache_.call(qkv, st.cos, st.sin, key_cache, value_cache, st.slot_mapping, nh, nkv, hd);
  } else {                                    // another cache dtype (float16): the write converts
    ops().rope_.call(qkv, st.cos, st.sin, nh + nkv, hd);
    ops().reshape_and_cache.call(qkv.narrow(1, q_width, kv_width).view({T, nkv, hd}),
                                 qkv.narrow(1, q_width + kv_width, kv_width).view({T, nkv, hd}),
                                 key_cache, value_cache, st.slot_mapping);
  }
  const at::Tensor q = qkv.narrow(1, 0, q_width).view({T, nh, hd});          // a view of qkv
  at::Tensor o = ops().paged_attention.call(q, key_cache, value_cache, st.block_tables, st.context_lens,
                                            st.query_start_loc, st.scale, st.batch_invariant);   // [T, nh, hd]
  at::Tensor out = linear(o.view({T, q_width}), a, kO);                      // [T, hidden]
  at::Tensor res = *residual;
  if (keep) {                                 // [T, hidden] -> [num_sampled, hidden]
    out = at::index_select(out, 0, *keep);
    res = at::index_select(res, 0, *keep);
  }

  // MLP: norm, gate_up, SwiGLU, down
  std::optional<at::Tensor> r = res;
  h = add_norm(out, r, a.get(1, "post_attention_layernorm"), st.eps);
  at::Tensor act = ops().silu_and_mul.call(linear(h, a, kGateUp));           // [T, inter]
  return {linear(act, a, kDown), res};                                        // [T, hidden], residual
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decoder_layer: x must be float32 [T, hidden]");
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor x, std::optional<at::Tensor> residual, const c10::List<OptTensor>& weights,
    at::IntArrayRef ints, double eps, const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_cache,
    at::Tensor value_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, const at::Tensor& query_start_loc, double scale, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, bool batch_invariant, const std::optional<at::Tensor>& keep) {
  check_x(x);
  TORCH_CHECK(weights.size() == kNorms + kPerLinear * kLinears && ints.size() == 2 * kLinears,
              "decoder_layer: weights must hold 2 norms and 5 tensors per linear, ints 2 per linear");
  const Step st{cos, sin, slot_mapping, block_tables, context_lens, query_start_loc, eps, scale,
                num_heads, num_kv_heads, head_dim, batch_invariant};
  return layer(x, residual, LayerArgs{weights, 0, ints}, st, key_cache, value_cache, keep);
}

// Every layer of the model in one op: model.Llama.forward's loop over them. Between two layers' ops
// the Python loop spent ~90 us a layer here, each trivial statement slow to run once the layer's
// matmuls had streamed megabytes of weights through the caches (bench.py step). weights, ints: the
// layers' decoder_layer arguments one after another; key_caches, value_caches: one per layer.
// The first layer starts the residual stream (x is the embedding), and keep applies to the last.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    at::Tensor x, const c10::List<OptTensor>& weights, at::IntArrayRef ints, double eps, const at::Tensor& cos,
    const at::Tensor& sin, const c10::List<at::Tensor>& key_caches, const c10::List<at::Tensor>& value_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& context_lens,
    const at::Tensor& query_start_loc, double scale, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    bool batch_invariant, const std::optional<at::Tensor>& keep) {
  check_x(x);
  const int64_t L = key_caches.size(), per_layer = kNorms + kPerLinear * kLinears;
  TORCH_CHECK(L > 0 && value_caches.size() == L && (int64_t)weights.size() == L * per_layer &&
              (int64_t)ints.size() == L * 2 * kLinears,
              "decoder_layers: one key and value cache per layer, and decoder_layer's weights and ints per layer");
  const Step st{cos, sin, slot_mapping, block_tables, context_lens, query_start_loc, eps, scale,
                num_heads, num_kv_heads, head_dim, batch_invariant};
  std::optional<at::Tensor> residual;
  for (int64_t i = 0; i < L; ++i) {
    const LayerArgs a{weights, i * per_layer, ints.slice(i * 2 * kLinears, 2 * kLinears)};
    auto [out, res] = layer(x, residual, a, st, key_caches.get(i), value_caches.get(i),
                            i == L - 1 ? keep : std::nullopt);
    x = out, residual = res;
  }
  return {x, *residual};
}

}  // namespace

TORCH_LIBRARY(nanoserve_layer, m) {
  m.def("decoder_layer(Tensor(a!) x, Tensor(b!)? residual, Tensor?[] weights, int[] ints, float eps, Tensor cos, "
        "Tensor sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start_loc, float scale, int num_heads, int num_kv_heads, int head_dim, "
        "bool batch_invariant, Tensor? keep) -> (Tensor, Tensor)");
  m.def("decoder_layers(Tensor(a!) x, Tensor?[] weights, int[] ints, float eps, Tensor cos, Tensor sin, "
        "Tensor(c!)[] key_caches, Tensor(d!)[] value_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens, Tensor query_start_loc, float scale, int num_heads, int num_kv_heads, int head_dim, "
        "bool batch_invariant, Tensor? keep) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nanoserve_layer, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layers", &decoder_layers);
}
