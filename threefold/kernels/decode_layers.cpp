// decode_layers -- every decoder layer of a step whose rows all decode over a dense paged cache,
// in one native call: what CUDA graphs do for vLLM's decode steps, for the CPU.
// decode_layers_kivi -- the same loop over a KIVI cache (kivi2 / kivi4 in every layer): each layer
// puts its rows' K/V in their requests' full-precision windows, encodes the blocks they complete
// (kivi_encode) and attends over blocks and windows (kivi_attention), as worker/kivi_attention.py
// does layer by layer.
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
//         (KIVI: ring[slot(t), p(t) mod size] = k, v; blocks completed: kivi_encode; out = kivi_attention(q))
//   residual += hidden; hidden = rms_norm(residual); hidden = down(silu(gate) * up)
//   end: residual += hidden; return rms_norm(residual)
//
// A linear runs as the Python `Linear` does: `linear_small` (`linear_small_int8` for an int8
// stream) while the rows fit its kernel, else
// oneDNN's prepacked weight (mkldnn::_linear_pointwise, called through the dispatcher), else
// at::linear. Llama-style layers only (q/k-norm models keep the Python loop).

// threefold-exports: decode_layers decode_layers_kivi

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>
#include <vector>

bool linear_small(at::Tensor out, at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
bool linear_small_int8(at::Tensor out, at::Tensor x, at::Tensor w, at::Tensor scale, c10::optional<at::Tensor> bias);
void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps, bool add);
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
void silu_and_mul(at::Tensor out, at::Tensor gate_up);
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window,
                            at::Tensor tree_starts, at::Tensor tree_bits);
void kivi_attention(at::Tensor out, at::Tensor q, at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_scales,
                    at::Tensor k_zeros, at::Tensor v_scales, at::Tensor v_zeros, at::Tensor ring,
                    at::Tensor block_tables, at::Tensor quant_lens, at::Tensor seq_lens, at::Tensor slots,
                    at::Tensor bases, double scale);
void kivi_encode(at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_scales, at::Tensor k_zeros,
                 at::Tensor v_scales, at::Tensor v_zeros, at::Tensor block_ids, at::Tensor k, at::Tensor v,
                 int64_t fine, at::Tensor low);

namespace {

constexpr int kNorms = 2, kLinears = 4, kPerLinear = 5;  // per linear: stream, its scale, packed, weight, bias
constexpr int kPerLayer = kNorms + kLinears * kPerLinear;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

// One Linear: weights[i..i+4] = stream (the few-row kernel's weight, or None where it does not
// run), its per-row scales (int8 streams; else None), packed (oneDNN's, or None), weight (possibly
// on the meta device once packed), bias.
at::Tensor linear(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& weights, size_t i,
                  int64_t max_rows) {
  const auto& stream = weights[i];
  const auto& stream_scale = weights[i + 1];
  const auto& packed = weights[i + 2];
  const at::Tensor& weight = *weights[i + 3];
  const auto& bias = weights[i + 4];
  if (stream.has_value() && x.size(0) <= max_rows) {
    at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
    if (stream_scale.has_value() ? linear_small_int8(out, x, *stream, *stream_scale, bias)
                                 : linear_small(out, x, *stream, bias))
      return out;
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

// The layer loop both entry points share: attend(l, q, k, v, out) writes layer l's K/V where its
// cache keeps them and fills out [T, num_heads, d] with the attention of q.
template <class Attend>
at::Tensor run_layers(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<c10::optional<at::Tensor>>& weights, const std::vector<int64_t>& max_rows,
                      const at::Tensor& final_norm, double eps, size_t num_layers, int64_t d, int64_t num_heads,
                      int64_t num_kv_heads, Attend&& attend) {
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layers: hidden must be contiguous [T, H]");
  TORCH_CHECK(weights.size() == num_layers * kPerLayer && max_rows.size() == num_layers * kLinears,
              "decode_layers: ", kPerLayer, " weights and ", kLinears, " row limits per layer");
  const int64_t qk_heads = num_heads + num_kv_heads;
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
    at::Tensor out = at::empty({rows, num_heads, d}, hidden.options());
    attend(l, q, k, v, out);
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

}  // namespace

// hidden [T, H] (the embeddings; becomes the first residual); positions [T] int64; cos, sin the
// RoPE tables; weights: per layer input norm, post-attention norm, then qkv, o, gate_up, down as
// (stream, packed, weight, bias); max_rows: per layer, the few-row limit of each of the 4 linears;
// k_caches, v_caches: per layer [N, bs, kvh, d] in hidden's dtype; slot_mapping [T]; decode groups
// (rows group_starts[g] .. + group_tables[g].size(0)) with their block tables, seq_lens and tree
// masks (empty tensors: none), as paged_decode_attention takes them. Returns the final-normed hidden.
at::Tensor decode_layers(at::Tensor hidden, at::Tensor positions, at::Tensor cos, at::Tensor sin, std::vector<c10::optional<at::Tensor>> weights, std::vector<int64_t> max_rows, at::Tensor final_norm, double eps, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, at::Tensor slot_mapping, std::vector<int64_t> group_starts, std::vector<at::Tensor> group_tables, std::vector<at::Tensor> group_lens, std::vector<at::Tensor> group_tree_starts, std::vector<at::Tensor> group_tree_bits, int64_t num_heads, int64_t num_kv_heads, double scale, int64_t window) {
  const size_t num_layers = k_caches.size();
  const int64_t rows = hidden.size(0), d = k_caches.empty() ? 0 : k_caches[0].size(3);
  TORCH_CHECK(v_caches.size() == num_layers, "decode_layers: one k and one v cache per layer");
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
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto attend = [&](size_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out) {
    write_cache(k_caches[l], v_caches[l], k, v, slots);
    for (size_t g = 0; g < groups; ++g) {
      const int64_t n = group_tables[g].size(0);
      paged_decode_attention(out.narrow(0, group_starts[g], n), q.narrow(0, group_starts[g], n), k_caches[l],
                             v_caches[l], group_tables[g], group_lens[g], scale, window, group_tree_starts[g],
                             group_tree_bits[g]);
    }
  };
  return run_layers(hidden, positions, cos, sin, weights, max_rows, final_norm, eps, num_layers, d, num_heads,
                    num_kv_heads, attend);
}

// decode_layers over a KIVI cache. blocks: per layer k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros
// (kivi_attention's operands); rings: per layer [2, slots, size, kvh, d] (the windows, in hidden's dtype or
// float16 beside float32); block_tables [T, width]; meta [4, T]: quantized lengths, seq lengths, ring slots,
// ring bases (kivi_attention's), row t being position seq_len - 1 of its request; encode_rows [E]: the rows
// whose token completes a block, encode_blocks [E] that block's id (its tokens are the ring's last bs).
at::Tensor decode_layers_kivi(at::Tensor hidden, at::Tensor positions, at::Tensor cos, at::Tensor sin, std::vector<c10::optional<at::Tensor>> weights, std::vector<int64_t> max_rows, at::Tensor final_norm, double eps, std::vector<at::Tensor> blocks, std::vector<at::Tensor> rings, at::Tensor block_tables, at::Tensor meta, at::Tensor encode_rows, at::Tensor encode_blocks, int64_t num_heads, int64_t num_kv_heads, double scale) {
  constexpr size_t kBlockTensors = 6;
  const size_t num_layers = rings.size();
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(blocks.size() == num_layers * kBlockTensors, "decode_layers_kivi: 6 block tensors and a ring per layer");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.is_contiguous() && meta.dim() == 2 && meta.size(0) == 4 &&
                  meta.size(1) == rows,
              "decode_layers_kivi: meta must be contiguous int64 [4, T]");
  const int64_t num_encode = encode_rows.numel();
  TORCH_CHECK(encode_rows.scalar_type() == at::kLong && encode_blocks.scalar_type() == at::kLong &&
                  encode_rows.is_contiguous() && encode_blocks.is_contiguous() && encode_blocks.numel() == num_encode,
              "decode_layers_kivi: encode_rows and encode_blocks must be contiguous int64 [E]");
  const int64_t d = num_layers ? rings[0].size(4) : 0;
  for (size_t l = 0; l < num_layers; ++l)
    TORCH_CHECK(rings[l].dim() == 5 && rings[l].size(0) == 2 && rings[l].size(3) == num_kv_heads &&
                    rings[l].size(4) == d && rings[l].is_contiguous() && rings[l].sizes() == rings[0].sizes(),
                "decode_layers_kivi: every ring must be contiguous [2, slots, size, kvh, d], of one shape");
  const int64_t* lens = meta[1].data_ptr<int64_t>();
  const int64_t* ring_slots = meta[2].data_ptr<int64_t>();
  const int64_t* enc = encode_rows.data_ptr<int64_t>();
  const int64_t num_slots = num_layers ? rings[0].size(1) : 0, size = num_layers ? rings[0].size(2) : 1;
  const int64_t bs = num_layers ? blocks[0].size(1) : 1;
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(ring_slots[t] >= 0 && ring_slots[t] < num_slots && lens[t] >= 1,
                "decode_layers_kivi: a row's ring slot is out of range");
  for (int64_t e = 0; e < num_encode; ++e)
    TORCH_CHECK(enc[e] >= 0 && enc[e] < rows && lens[enc[e]] % bs == 0 && bs <= size,
                "decode_layers_kivi: an encoded row must complete its block, inside its ring");
  // Per step, not per layer: each row's ring row (its token), and the ring rows of each completed block.
  std::vector<int64_t> at_rows(rows);
  for (int64_t t = 0; t < rows; ++t) at_rows[t] = ring_slots[t] * size + (lens[t] - 1) % size;
  at::Tensor gather = at::empty({num_encode * bs}, encode_rows.options());
  int64_t* g = gather.data_ptr<int64_t>();
  for (int64_t e = 0; e < num_encode; ++e)
    for (int64_t i = 0; i < bs; ++i) g[e * bs + i] = ring_slots[enc[e]] * size + (lens[enc[e]] - bs + i) % size;
  at::Tensor no_low = at::empty({0}, hidden.options().dtype(at::kByte));
  auto attend = [&](size_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out) {
    const at::Tensor& ring = rings[l];
    const at::Tensor* b = blocks.data() + l * kBlockTensors;
    write_cache(ring[0], ring[1], k.to(ring.scalar_type()), v.to(ring.scalar_type()), at_rows.data());
    if (num_encode) {  // the completed blocks, gathered from the rings (their tokens are its last bs)
      auto block_rows = [&](const at::Tensor& side) {
        return side.view({-1, num_kv_heads, d}).index_select(0, gather).view({num_encode, bs, num_kv_heads, d});
      };
      const int64_t bits = b[0].size(-1) * 8 / d;
      kivi_encode(b[0], b[1], b[2], b[3], b[4], b[5], encode_blocks, block_rows(ring[0]), block_rows(ring[1]), bits,
                  no_low);
    }
    kivi_attention(out, q, b[0], b[1], b[2], b[3], b[4], b[5], ring, block_tables, meta[0], meta[1], meta[2], meta[3],
                   scale);
  };
  return run_layers(hidden, positions, cos, sin, weights, max_rows, final_norm, eps, num_layers, d, num_heads,
                    num_kv_heads, attend);
}
