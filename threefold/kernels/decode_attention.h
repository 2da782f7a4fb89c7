// Decode attention: the pieces every vector path shares, and the generic path (any head_dim,
// fp32 or bf16) that the compiler vectorizes. Included by decode_attention.cpp (and, for its
// helpers and split_by_cost, kivi_attention.cpp).
#pragma once

#include "kernel_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

using threefold::to_float;

namespace {

// D > 0: head_dim known at compile time (fully unrolled, vectorized without
// epilogues); D == 0: the runtime `d`.
template <int D, typename T>
inline void widen(const T* __restrict src, float* __restrict dst, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <int D>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];  // vectorized: -ffast-math allows reassociation
  return sum;
}

template <int D>
inline void axpy(float a, const float* __restrict x, float* __restrict acc, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  for (int64_t i = 0; i < n; ++i) acc[i] += a * x[i];
}

// One decode-attention call's operands as raw pointers and element strides; the cache is
// [num_blocks, block_size, kv_heads, head_dim] with contiguous rows.
template <typename T>
struct DecodeArgs {
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, group, table_width;
  int64_t q_seq, q_head, o_seq, o_head, kv_block, kv_token, kv_head;
  const T* q_ptr;
  const T* k_ptr;
  const T* v_ptr;
  T* out_ptr;
  const int64_t* tables;
  const int64_t* lens;
  float fscale;

  DecodeArgs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale)
      : num_seqs(q.size(0)), num_heads(q.size(1)), head_dim(q.size(2)), block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)), group(num_heads / num_kv_heads), table_width(block_tables.size(1)),
        q_seq(q.stride(0)), q_head(q.stride(1)), o_seq(out.stride(0)), o_head(out.stride(1)),
        kv_block(k_cache.stride(0)), kv_token(k_cache.stride(1)), kv_head(k_cache.stride(2)),
        q_ptr(q.data_ptr<T>()), k_ptr(k_cache.data_ptr<T>()), v_ptr(v_cache.data_ptr<T>()),
        out_ptr(out.data_ptr<T>()), tables(block_tables.data_ptr<int64_t>()), lens(seq_lens.data_ptr<int64_t>()),
        fscale(static_cast<float>(scale)) {}
};

// The work items (sequence, kv head) cut into up to 8 parts per thread of equal cost (keys
// read plus a fixed per-item cost); returns the parts' item bounds. The runner sorts decodes
// by context length, so an even split by count would hand one thread all the long ones.
inline std::vector<int64_t> split_by_cost(const int64_t* lens, int64_t num_seqs, int64_t num_kv_heads,
                                          int64_t window, int64_t item_cost) {
  const int64_t num_items = num_seqs * num_kv_heads;
  std::vector<int64_t> cost_prefix(num_items + 1, 0);
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t len = lens[item / num_kv_heads];
    cost_prefix[item + 1] = cost_prefix[item] + (window > 0 ? std::min(len, window) : len) + item_cost;
  }
  const int64_t num_parts = std::min<int64_t>(num_items, 8 * at::get_num_threads());
  std::vector<int64_t> bounds(num_parts + 1, num_items);
  bounds[0] = 0;
  for (int64_t part = 1, item = 0; part < num_parts; ++part) {
    const int64_t target = cost_prefix[num_items] * part / num_parts;
    while (item < num_items && cost_prefix[item] < target) ++item;
    bounds[part] = item;
  }
  return bounds;
}

// Query groups: runs of consecutive rows that read their keys through the same blocks (a
// speculative verify's k+1 rows, a candidate tree's rows, a prefill chunk's rows read in place).
// Row b joins the group of row `first` when their block tables agree over every block row b
// reads; the group then reads each K and V row once for all its rows, through row `first`'s
// table (which holds, for each key a member reads, the member's own block). Returns the groups'
// first rows, then num_seqs.
inline std::vector<int64_t> query_groups(const int64_t* tables, const int64_t* lens, int64_t num_seqs,
                                         int64_t width, int64_t block_size, int64_t max_rows) {
  std::vector<int64_t> starts{0};
  for (int64_t b = 1; b < num_seqs; ++b) {
    const int64_t first = starts.back();
    const int64_t blocks = std::min(width, (lens[b] + block_size - 1) / block_size);
    const bool joins = b - first < max_rows &&
                       std::equal(tables + b * width, tables + b * width + blocks, tables + first * width);
    if (!joins) starts.push_back(b);
  }
  starts.push_back(num_seqs);
  return starts;
}

constexpr int64_t kMaxGroupRows = 16;  // a verify's k+1 rows, or a tree's, per group (scores stay small)

// mask: candidate-tree rows (kernel_common.h's TreeMask; inactive for plain decodes).
// Work item = (query group, kv head): every row of the group and its G heads score each K row it
// loads, then accumulate each V row it loads (a lone decode is a group of one).
template <int D, typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
         const threefold::TreeMask& mask = {}) {
  const DecodeArgs<T> a(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  const std::vector<int64_t> groups =
      query_groups(a.tables, a.lens, a.num_seqs, a.table_width, a.block_size, kMaxGroupRows);
  const int64_t num_groups = static_cast<int64_t>(groups.size()) - 1;
  // split_by_cost over groups: a group costs the keys its rows read (its "length" below).
  std::vector<int64_t> group_cost(num_groups);
  for (int64_t gi = 0; gi < num_groups; ++gi) {
    int64_t cost = 0;
    for (int64_t b = groups[gi]; b < groups[gi + 1]; ++b) cost += window > 0 ? std::min(a.lens[b], window) : a.lens[b];
    group_cost[gi] = cost;
  }
  const std::vector<int64_t> bounds = split_by_cost(group_cost.data(), num_groups, a.num_kv_heads, 0, 16);
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t gd = a.group * a.head_dim;

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> qf, acc, row(a.head_dim), scores, inv_sum;
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t gi = item / a.num_kv_heads, kvh = item % a.num_kv_heads;
      const int64_t b0 = groups[gi], rows = groups[gi + 1] - b0;
      // Row r of the group sees keys [first_r, len_r), and of its tree keys only those its bits allow.
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t len = a.lens[b0 + r];
        lo = std::min(lo, window > 0 ? std::max<int64_t>(0, len - window) : 0);
        hi = std::max(hi, len);
      }
      const int64_t n = hi - lo;
      const int64_t* table = a.tables + b0 * a.table_width;
      auto sees = [&](int64_t r, int64_t pos) {
        const int64_t b = b0 + r, len = a.lens[b];
        if (pos >= len || (window > 0 && pos < len - window)) return false;
        const int64_t tree_start = mask.start(b, len);
        return pos < tree_start || mask.visible(b, tree_start, pos);
      };
      qf.resize(rows * gd);
      acc.assign(rows * gd, 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < a.group; ++g) {
          const T* src = a.q_ptr + (b0 + r) * a.q_seq + (kvh * a.group + g) * a.q_head;
          for (int64_t i = 0; i < a.head_dim; ++i) qf[(r * a.group + g) * a.head_dim + i] = to_float(src[i]) * a.fscale;
        }
      }
      // body(t, row) for the keys t = 0..n-1 (positions lo..hi-1), walking the block table once:
      // no division per row.
      auto for_each_row = [&](const T* cache, auto&& body) {
        for (int64_t pos = lo; pos < hi;) {
          const int64_t blk = pos / a.block_size;
          const int64_t end_in_block = std::min(a.block_size, hi - blk * a.block_size);
          const T* base = cache + table[blk] * a.kv_block + kvh * a.kv_head;
          for (int64_t off = pos - blk * a.block_size; off < end_in_block; ++off, ++pos) {
            body(pos - lo, base + off * a.kv_token);
          }
        }
      };
      // scores[(r, g), t]: each K row loaded (and widened) once for the group's rows and heads.
      const int64_t num_scores = rows * a.group;
      scores.resize(num_scores * n);
      for_each_row(a.k_ptr, [&](int64_t t, const T* krow) {
        bool widened = false;
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * a.group * n + t;
          if (!sees(r, t + lo)) {
            for (int64_t g = 0; g < a.group; ++g) s[g * n] = threefold::kHiddenScore;
            continue;
          }
          if (!widened) widen<D>(krow, row.data(), a.head_dim), widened = true;
          for (int64_t g = 0; g < a.group; ++g) s[g * n] = dot<D>(qf.data() + (r * a.group + g) * a.head_dim, row.data(), a.head_dim);
        }
      });
      // Softmax per (row, head) in fp32; the 1 / sum is folded into the output.
      inv_sum.resize(num_scores);
      for (int64_t rg = 0; rg < num_scores; ++rg) {
        float* s = scores.data() + rg * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - mx);  // vectorized (libmvec)
        for (int64_t t = 0; t < n; ++t) sum += s[t];
        inv_sum[rg] = 1.f / sum;
      }
      // acc[(r, g)] = sum_t p[(r, g), t] * V[t], each V row loaded once.
      for_each_row(a.v_ptr, [&](int64_t t, const T* vrow) {
        bool widened = false;
        for (int64_t r = 0; r < rows; ++r) {
          if (!sees(r, t + lo)) continue;
          if (!widened) widen<D>(vrow, row.data(), a.head_dim), widened = true;
          for (int64_t g = 0; g < a.group; ++g) {
            const int64_t rg = r * a.group + g;
            axpy<D>(scores[rg * n + t], row.data(), acc.data() + rg * a.head_dim, a.head_dim);
          }
        }
      });
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < a.group; ++g) {
          const int64_t rg = r * a.group + g;
          T* dst = a.out_ptr + (b0 + r) * a.o_seq + (kvh * a.group + g) * a.o_head;
          for (int64_t i = 0; i < a.head_dim; ++i) dst[i] = static_cast<T>(acc[rg * a.head_dim + i] * inv_sum[rg]);
        }
      }
    }
  });
}

}  // namespace
