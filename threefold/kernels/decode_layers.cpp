// decode_layers -- every decoder layer of a step whose rows all decode over a dense paged cache,
// in one native call: what CUDA graphs do for vLLM's decode steps, for the CPU.
//
// A batch-1 decode step of SmolLM2-135M spends ~10 ms in kernels and ~3 ms in the Python
// between them (module calls, views, the cache write, the attention dispatch: ~100 us a
// layer). This loop calls the very kernels the Python path calls, in the same order on the
// same inputs, so its output is bit-identical (tests/test_decode_layers.py):
//
//   first layer: residual = hidden;  hidden = rms_norm(hidden)
//   otherwise:   residual += hidden; hidden = rms_norm(residual)           (add_rms_norm)
//   qkv = linear(hidden); rope on q and k in place; cache[slot(t)] = k, v
//   out = paged_decode_attention(q) per decode group; hidden = linear_o(out)
//   residual += hidden; hidden = rms_norm(residual); hidden = down(silu(gate) * up)
//   end: residual += hidden; return rms_norm(residual)
//
// A linear runs as the Python `Linear` does: `linear_small` while the rows fit its kernel, else
// oneDNN's prepacked weight (mkldnn::_linear_pointwise, called through the dispatcher), else
// at::linear. Llama-style layers only (q/k-norm models keep the Python loop).

// threefold-exports: decode_layers

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>
#include <vector>

bool linear_small(at::Tensor out, at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps, bool add);
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
void silu_and_mul(at::Tensor out, at::Tensor gate_up);
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window,
                            at::Tensor tree_starts, at::Tensor tree_bits);

namespace {

constexpr int kNorms = 2, kLinears = 4, kPerLinear = 4;  // per linear: stream, packed, weight, bias
constexpr int kPerLayer = kNorms + kLinears * kPerLinear;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

// One Linear: weights[i..i+3] = stream (the few-row kernel's weight, or None where it does not
// run), packed (oneDNN's, or None), weight (possibly on the meta device once packed), bias.
at::Tensor linear(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& weights, size_t i,
                  int64_t max_rows) {
  const auto& stream = weights[i];
  const auto& packed = weights[i + 1];
  const at::Tensor& weight = *weights[i + 2];
  const auto& bias = weights[i + 3];
  if (stream.has_value() && x.size(0) <= max_rows) {
    at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
    if (linear_small(out, x, *stream, bias)) return out;
  }
  if (packed.has_value()) return packed_linear(x, *packed, bias);
  return at::linear(x, weight, bias);
}

// k and v rows of the step into their cache slots: k_cache [N, bs, kvh, d] viewed as [N * bs, kvh, d].
void write_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                 const int64_t* slots) {
  const int64_t rows = k.size(0), width = k.size(1) * k.size(2), num_slots = k_cache.size(0) * k_cache.size(1);
  const size_t bytes = width * k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "decode_layers: slot ", slots[t], " out of range");
    std::memcpy(kc + slots[t] * bytes, kp + t * k.stride(0) * k.element_size(), bytes);
    std::memcpy(vc + slots[t] * bytes, vp + t * v.stride(0) * v.element_size(), bytes);
  }
}

}  // namespace

// hidden [T, H] (the embeddings; becomes the first residual); positions [T] int64; cos, sin the
// RoPE tables; weights: per layer input norm, post-attention norm, then qkv, o, gate_up, down as
// (stream, packed, weight, bias); max_rows: per layer, the few-row limit of each of the 4 linears;
// k_caches, v_caches: per layer [N, bs, kvh, d] in hidden's dtype; slot_mapping [T]; decode groups
// (rows group_starts[g] .. + group_tables[g].size(0)) with their block tables, seq_lens and tree
// masks (empty tensors: none), as paged_decode_attention takes them. Returns the final-normed hidden.
at::Tensor decode_layers(at::Tensor hidden, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                         std::vector<c10::optional<at::Tensor>> weights, std::vector<int64_t> max_rows,
                         at::Tensor final_norm, double eps, std::vector<at::Tensor> k_caches,
                         std::vector<at::Tensor> v_caches, at::Tensor slot_mapping, std::vector<int64_t> group_starts,
                         std::vector<at::Tensor> group_tables, std::vector<at::Tensor> group_lens,
                         std::vector<at::Tensor> group_tree_starts, std::vector<at::Tensor> group_tree_bits,
                         int64_t num_heads, int64_t num_kv_heads, double scale, int64_t window) {
  const size_t num_layers = k_caches.size();
  const int64_t rows = hidden.size(0), d = k_caches.empty() ? 0 : k_caches[0].size(3);
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layers: hidden must be contiguous [T, H]");
  TORCH_CHECK(weights.size() == num_layers * kPerLayer && max_rows.size() == num_layers * kLinears &&
                  v_caches.size() == num_layers,
              "decode_layers: ", kPerLayer, " weights and ", kLinears, " row limits per layer");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == rows,
              "decode_layers: slot_mapping must be contiguous int64 [T]");
  const size_t groups = group_starts.size();
  TORCH_CHECK(group_tables.size() == groups && group_lens.size() == groups && group_tree_starts.size() == groups &&
                  group_tree_bits.size() == groups,
              "decode_layers: one table, seq_lens and tree mask per decode group");
  int64_t covered = 0;
  for (size_t g = 0; g < groups; ++g) {
    TORCH_CHECK(group_starts[g] == covered, "decode_layers: decode groups must cover the rows in order");
    covered += group_tables[g].size(0);
  }
  TORCH_CHECK(covered == rows, "decode_layers: every row must decode (", covered, " of ", rows, ")");
  for (size_t l = 0; l < num_layers; ++l)
    TORCH_CHECK(k_caches[l].scalar_type() == hidden.scalar_type() && v_caches[l].is_contiguous() &&
                    k_caches[l].is_contiguous() && k_caches[l].size(3) == d,
                "decode_layers: each layer's cache must be contiguous [N, bs, kvh, d] in the model's dtype");

  const int64_t qk_heads = num_heads + num_kv_heads;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::Tensor residual = hidden;
  for (size_t l = 0; l < num_layers; ++l) {
    const size_t w = l * kPerLayer;
    const int64_t* limit = max_rows.data() + l * kLinears;
    if (l == 0) {
      hidden = hidden.clone();
      add_rms_norm(hidden, hidden, *weights[w], eps, false);
    } else {
      add_rms_norm(hidden, residual, *weights[w], eps, true);
    }
    at::Tensor qkv = linear(hidden, weights, w + kNorms, limit[0]);  // [T, (H + 2 KVH) d]
    at::Tensor qk = qkv.narrow(1, 0, qk_heads * d).view({rows, qk_heads, d});
    at::Tensor v = qkv.narrow(1, qk_heads * d, num_kv_heads * d).view({rows, num_kv_heads, d});
    rotary_embedding(qk, positions, cos, sin);
    at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
    write_cache(k_caches[l], v_caches[l], k, v, slots);
    at::Tensor out = at::empty({rows, num_heads, d}, hidden.options());
    for (size_t g = 0; g < groups; ++g) {
      const int64_t n = group_tables[g].size(0);
      paged_decode_attention(out.narrow(0, group_starts[g], n), q.narrow(0, group_starts[g], n), k_caches[l],
                             v_caches[l], group_tables[g], group_lens[g], scale, window, group_tree_starts[g],
                             group_tree_bits[g]);
    }
    hidden = linear(out.view({rows, num_heads * d}), weights, w + kNorms + kPerLinear, limit[1]);
    add_rms_norm(hidden, residual, *weights[w + 1], eps, true);
    at::Tensor gate_up = linear(hidden, weights, w + kNorms + 2 * kPerLinear, limit[2]);
    at::Tensor act = at::empty({rows, gate_up.size(1) / 2}, hidden.options());
    silu_and_mul(act, gate_up);
    hidden = linear(act, weights, w + kNorms + 3 * kPerLinear, limit[3]);
  }
  if (num_layers == 0) {
    hidden = hidden.clone();
    add_rms_norm(hidden, hidden, final_norm, eps, false);
    return hidden;
  }
  add_rms_norm(hidden, residual, final_norm, eps, true);
  return hidden;
}
