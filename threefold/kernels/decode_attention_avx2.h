// Decode attention on AVX2. Included by decode_attention.cpp only.
#pragma once

#include "decode_attention.h"

#if defined(THREEFOLD_AVX2)  // (decode_attention.cpp takes `run` only without AMX; kivi_attention.cpp the helpers)
// Also the path of AVX-512 builds without AMX: on an AVX-512 EPYC it ran 1.7-2.3x faster than the
// compiler's AVX-512 version of the generic loop (benchmarks/kernels_micro.py --only attention, contexts
// 256-1,024, both dtypes). AMX builds keep their tiles for bf16 and the generic loop for fp32 (unmeasured).
// Decode attention on AVX2 (head_dim 64 or 128), the same two passes as the generic `run`, in
// blocks of 16 keys: their rows are widened to fp32 once (bf16) into an L1 buffer; pass 1
// sums each (head, key) dot product in 8 lanes and reduces eight keys' lanes together
// (one hadd tree, not eight horizontal sums); pass 2 keeps 64 dims of a head's output in
// registers across the block. The compiler's version of the generic loop spent ~3x longer.
namespace avx2 {

constexpr int kKeys = 16;

// The rows of keys [t0, t0 + count) as fp32 pointers: in place for fp32, else widened into buf.
template <int D, typename T>
inline void block_rows(const T* const* src, int count, float (&buf)[kKeys][D], const float* (&rows)[kKeys]) {
  for (int j = 0; j < count; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      rows[j] = src[j];
    } else {
      for (int c = 0; c < D; c += 8) _mm256_storeu_ps(buf[j] + c, threefold::load8(src[j] + c));
      rows[j] = buf[j];
    }
  }
}

template <int D>
inline void score_block(const float* const (&rows)[kKeys], int count, const float* qf, int64_t group, float* scores,
                        int64_t n) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * D;
    for (int j0 = 0; j0 < count; j0 += 8) {
      __m256 part[8];
      for (int j = 0; j < 8; ++j) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        if (j0 + j < count)
          for (int c = 0; c < D; c += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(rows[j0 + j] + c), _mm256_loadu_ps(qg + c), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(rows[j0 + j] + c + 8), _mm256_loadu_ps(qg + c + 8), a1);
          }
        part[j] = _mm256_add_ps(a0, a1);
      }
      alignas(32) float s[8];
      _mm256_store_ps(s, threefold::reduce8(part));
      for (int j = 0; j < std::min(8, count - j0); ++j) scores[g * n + j0 + j] = s[j];
    }
  }
}

template <int D>
inline void accumulate_block(const float* const (&rows)[kKeys], int count, const float* p, int64_t group, int64_t n,
                             float* acc) {
  for (int64_t g = 0; g < group; ++g)
    for (int c0 = 0; c0 < D; c0 += 64) {
      __m256 o[8];
      float* dst = acc + g * D + c0;
      for (int c = 0; c < 8; ++c) o[c] = _mm256_loadu_ps(dst + 8 * c);
      for (int j = 0; j < count; ++j) {
        const __m256 pj = _mm256_broadcast_ss(p + g * n + j);
        for (int c = 0; c < 8; ++c) o[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(rows[j] + c0 + 8 * c), o[c]);
      }
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(dst + 8 * c, o[c]);
    }
}

template <int D, typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  const DecodeArgs<T> a(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  const std::vector<int64_t> bounds = split_by_cost(a.lens, a.num_seqs, a.num_kv_heads, window, 16);
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> qf(a.group * D), acc(a.group * D), scores;
    std::vector<const T*> krows, vrows;
    alignas(32) float buf[kKeys][D];
    const float* rows[kKeys];
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t b = item / a.num_kv_heads, kvh = item % a.num_kv_heads;
      const int64_t len = a.lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = a.tables + b * a.table_width;
      krows.resize(n);
      vrows.resize(n);
      for (int64_t pos = first; pos < len;) {  // one walk of the block table, no division per row
        const int64_t blk = pos / a.block_size;
        const int64_t end_in_block = std::min(a.block_size, len - blk * a.block_size);
        const int64_t base = table[blk] * a.kv_block + kvh * a.kv_head;
        for (int64_t off = pos - blk * a.block_size; off < end_in_block; ++off, ++pos) {
          krows[pos - first] = a.k_ptr + base + off * a.kv_token;
          vrows[pos - first] = a.v_ptr + base + off * a.kv_token;
        }
      }
      for (int64_t g = 0; g < a.group; ++g) {
        const T* src = a.q_ptr + b * a.q_seq + (kvh * a.group + g) * a.q_head;
        for (int64_t i = 0; i < D; ++i) qf[g * D + i] = to_float(src[i]) * a.fscale;
      }
      scores.resize(a.group * n);
      for (int64_t t0 = 0; t0 < n; t0 += kKeys) {
        const int count = static_cast<int>(std::min<int64_t>(kKeys, n - t0));
        block_rows<D, T>(krows.data() + t0, count, buf, rows);
        score_block<D>(rows, count, qf.data(), a.group, scores.data() + t0, n);
      }
      std::vector<float> inv_sum(a.group);  // softmax per head in fp32; 1 / sum folded into the output
      threefold::softmax_rows(scores.data(), a.group, n, inv_sum.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += kKeys) {
        const int count = static_cast<int>(std::min<int64_t>(kKeys, n - t0));
        block_rows<D, T>(vrows.data() + t0, count, buf, rows);
        accumulate_block<D>(rows, count, scores.data() + t0, a.group, n, acc.data());
      }
      for (int64_t g = 0; g < a.group; ++g) {
        T* dst = a.out_ptr + b * a.o_seq + (kvh * a.group + g) * a.o_head;
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[g * D + i] * inv_sum[g]);
      }
    }
  });
}

}  // namespace avx2
#endif
