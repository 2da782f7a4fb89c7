// Native CPU kernels for the hot path of a step.
//
// paged_decode_attention -- decode attention for CPU: one query token per sequence, K/V read in
// place from the block pool (no gather copy), GQA, optional sliding window.
//
//   out[b, h] = softmax_t(scale * q[b, h] . K[slot(b, t), h / G]) @ V[slot(b, t), h / G]
//   slot(b, t) = block_table[b, t / block_size] * block_size + t % block_size
//   t in [max(0, seq_len[b] - window), seq_len[b])
//
// A speculative verify is a multi-query decode: its rows share a block table and each sees one
// more key. A candidate tree's rows also carry an ancestor mask (tree_starts, tree_bits: see
// kernel_common.h's TreeMask): row b sees the context before the tree and, of the tree's rows,
// only itself and its ancestors. Masked calls take the generic path.
//
// Work item = (sequence, kv head): its G query heads share every K/V row it
// loads. Two passes per item: scores (reads K once), then the weighted sum of
// V (reads V once); the softmax runs in fp32 in between. Items are spread over
// torch's own intra-op thread pool (at::parallel_for).
//
// The generic path and the shared pieces: decode_attention.h; the AMX-tile path:
// decode_attention_amx.h; the AVX2 path: decode_attention_avx2.h.

// threefold-exports: paged_decode_attention set_amx

#include "decode_attention.h"
#include "decode_attention_amx.h"
#include "decode_attention_avx2.h"

namespace {

// The generic path for head_dim d (specialized for 64 and 128).
void generic(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
            const threefold::TreeMask& mask) {
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  switch (q.size(2)) {
    case 64:
      return bf16 ? run<64, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, mask)
                  : run<64, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, mask);
    case 128:
      return bf16 ? run<128, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, mask)
                  : run<128, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, mask);
    default:
      return bf16 ? run<0, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, mask)
                  : run<0, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, mask);
  }
}

}  // namespace

// out, q: [B, H, d]; k_cache, v_cache: [num_blocks, block_size, kv_heads, d] (last dim contiguous);
// block_tables: [B, width] int64; seq_lens: [B] int64 (>= 1); window <= 0 means no sliding window;
// tree_starts [B], tree_bits [B, words] int64: a candidate tree's ancestor mask (empty: none).
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window,
                            at::Tensor tree_starts, at::Tensor tree_bits) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, H, d] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v cache must be [N, bs, kvh, d]");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim of q and cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  k_cache.strides() == v_cache.strides(),
              "head_dim must be contiguous and k/v cache strides equal");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, cache and out must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  [[maybe_unused]] const bool bf16 = q.scalar_type() == at::kBFloat16;  // the vector paths' choice
  const threefold::TreeMask mask(tree_starts, tree_bits, seq_lens);
  // Candidate-tree rows (a few a step) take the generic path; every plain decode keeps its vector path.
  if (!mask.active()) {
#ifdef THREEFOLD_AMX
    if (bf16 && q.size(1) / k_cache.size(2) <= 16 && amx::enabled && amx::permitted()) {
      if (q.size(2) == 64) return amx::run<64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
      if (q.size(2) == 128) return amx::run<128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
    }
#endif
#if defined(THREEFOLD_AVX2) && !defined(THREEFOLD_AMX)  // (AVX-512 without AMX too: decode_attention_avx2.h)
    if (q.size(2) == 64)
      return bf16 ? avx2::run<64, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window)
                  : avx2::run<64, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
    if (q.size(2) == 128)
      return bf16 ? avx2::run<128, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window)
                  : avx2::run<128, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
#endif
  }
  generic(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, mask);
}

// Turns the AMX decode-attention path on or off (tests compare both); returns whether bf16
// decode attention now runs on AMX tiles (false where the CPU or the OS has none).
bool set_amx(bool enable) {
#ifdef THREEFOLD_AMX
  amx::enabled = enable;
  return enable && amx::permitted();
#else
  (void)enable;
  return false;
#endif
}
