// threefold-exports: gear_attention
//
// gear_attention -- attention over a GEAR cache (kv/codecs/gear.py) read in place, for the decode rows of
// a step and for a prefill chunk alike, with no dequantized copy of any context: keys and values are
// decoded a tile (at most kTile keys of one block) at a time, inside the kernel, and merged into an
// online softmax.
//
// A GEAR block-head (per block b, kv head, K and V) reads back as
//
//   X^ = D + Q_b P_b^T,  then X^[t, c] = s for each of its outliers (index t d + c, value s)
//
// D the KIVI backbone (codes, scales, zeros as in kivi_attention.cpp; kivi_blocks.h), Q_b [bs, r] and
// P_b [d, r] the low-rank residual's factors (fp16), the outliers exact fp16 with int16 indices:
//   outlier_values  [2, N, kvh, 2c]      fp16 (K, then V)
//   outlier_index   [2, N, kvh, 2c]      int16: t * d + channel within the block-head
//   factor_q        [2, N, kvh, bs, r]   fp16
//   factor_p        [2, N, kvh, d, r]    fp16
//
// Row i attends over keys t < n[i] (meta [4, R]: nq, n, slot, base per row):
//   t <  nq[i]   from block tables[i or 0][t / bs], decoded as above
//   t >= nq[i]   exact, exact_k/exact_v[slot[i], (t - base[i]) mod size]
// Decode rows: a table row each (tables [R, width]) over the rings (base 0). A prefill chunk: one table
// (tables [1, width]) for every row, its exact K/V given whole ([1, E, kvh, d], base = its first position),
// and n = each row's position + 1 (causal).
//
// Work item = (rows reading one table, kv head): a chunk's rows in tiles of kRows, a decode row alone. For
// each key tile, in each form some row of the item reads it (quantized, exact), the keys are decoded once
// to fp32, transposed ([d][kTile]: decode_keys writes them so), and the values ([kTile][d]); every (row,
// query head) of the item is scored against them (a broadcast-FMA micro GEMM) and merged into its running
// softmax (running max, sum and rescaled fp32 accumulator), each row taking only the keys it reads in that
// form. score_tile and accumulate_tile are kivi_prefill.cpp's micro GEMMs (a shared header is a follow-up).

#include "decode_attention.h"
#include "kivi_blocks.h"

#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vectors in inline helpers of non-AVX-512 builds

namespace {

using Half = at::Half;

constexpr int kTile = 32;   // keys per tile
constexpr int kRows = 16;   // a chunk's query rows per work item
constexpr int kLanes = 16;  // floats per Vec
enum Form { kQuantized = 0, kExact = 1 };

// 16 floats: one AVX-512 register, two AVX2 ones or four SSE ones.
typedef float Vec __attribute__((vector_size(64)));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

struct GearArgs : KiviBlocks {
  int64_t rows, head_dim, block_size, num_kv_heads, group, key_group, value_groups, num_blocks;
  int64_t rank, outliers, table_width, exact_slots, exact_size;
  bool shared_table;  // one table for every row (a chunk), else one per row
  const Half* outlier_values;
  const int16_t* outlier_index;
  const Half* factor_q;
  const Half* factor_p;
  const int64_t* tables;
  const int64_t* quant_lens;
  const int64_t* lens;
  const int64_t* slots;
  const int64_t* bases;
  float scale;
};

// s[i][0, kTile) = q[i] . kt[:, 0, kTile) for i < m (m a multiple of 4; q's pad rows are zero).
template <int D>
void score_tile(const float* __restrict q, int64_t m, const float* __restrict kt, float* __restrict s, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  for (int64_t i = 0; i < m; i += 4) {
    Vec a[4][2] = {};
    for (int64_t c = 0; c < n; ++c) {
      const Vec k0 = load(kt + c * kTile), k1 = load(kt + c * kTile + kLanes);
      for (int r = 0; r < 4; ++r) {
        const float x = q[(i + r) * n + c];
        a[r][0] += x * k0;
        a[r][1] += x * k1;
      }
    }
    for (int r = 0; r < 4; ++r) {
      store(s + (i + r) * kTile, a[r][0]);
      store(s + (i + r) * kTile + kLanes, a[r][1]);
    }
  }
}

// acc[i] += sum_j p[i][j] v[j] for i < m (m a multiple of 4), v [kTile][d].
template <int D>
void accumulate_tile(const float* __restrict p, int64_t m, const float* __restrict v, float* __restrict acc,
                     int64_t d) {
  if constexpr (D > 0 && D % kLanes == 0) {
    constexpr int V = D / kLanes, R = V <= 4 ? 4 : 2;  // 16 accumulators
    for (int64_t i = 0; i < m; i += R) {
      Vec a[R][V];
      for (int r = 0; r < R; ++r)
        for (int x = 0; x < V; ++x) a[r][x] = load(acc + (i + r) * D + x * kLanes);
      for (int j = 0; j < kTile; ++j) {
        Vec row[V];
        for (int x = 0; x < V; ++x) row[x] = load(v + j * D + x * kLanes);
        for (int r = 0; r < R; ++r) {
          const float w = p[(i + r) * kTile + j];
          for (int x = 0; x < V; ++x) a[r][x] += w * row[x];
        }
      }
      for (int r = 0; r < R; ++r)
        for (int x = 0; x < V; ++x) store(acc + (i + r) * D + x * kLanes, a[r][x]);
    }
  } else {
    for (int64_t i = 0; i < m; ++i)
      for (int j = 0; j < kTile; ++j) axpy<0>(p[i * kTile + j], v + j * d, acc + i * d, d);
  }
}

// The outliers of one block-head (block blk, whose first key is `first`; side 0: K, 1: V) among keys
// [f0, f1): put(t, channel, value) for each.
template <typename Put>
void for_outliers(const GearArgs& a, int side, int64_t blk, int64_t first, int64_t kvh, int64_t f0, int64_t f1,
                  Put put) {
  const int64_t count = 2 * a.outliers, d = a.head_dim, block_head = (side * a.num_blocks + blk) * a.num_kv_heads + kvh;
  const Half* values = a.outlier_values + block_head * count;
  const int16_t* indices = a.outlier_index + block_head * count;
  for (int64_t e = 0; e < count; ++e) {
    const int64_t pos = indices[e], t = first + pos / d;
    if (pos >= 0 && t >= f0 && t < f1) put(t, pos % d, static_cast<float>(values[e]));
  }
}

// 16 codes of B bits, at `shift` in 16 consecutive bytes, as floats (widened to 32-bit lanes first: a
// byte-to-float conversion is not a vector instruction, and GCC would convert lane by lane).
typedef uint8_t Bytes __attribute__((vector_size(16)));
typedef int32_t Ints __attribute__((vector_size(64)));

template <int B>
inline Vec byte_codes(const uint8_t* p, int shift) {
  Bytes x;
  std::memcpy(&x, p, sizeof(x));
  const Ints w = __builtin_convertvector(x, Ints);
  return __builtin_convertvector((w >> shift) & ((1 << B) - 1), Vec);
}

// Keys [f0, f1) of one block-head decoded straight into kt [d][kTile] (column t - t0): D + Q P^T, then the
// outliers. Codes are gathered byte-transposed (bytes[i][j] = byte i of key j), then each channel is
// decoded across the tile's keys in two vectors, its key group's scale and zero and its low-rank term
// (P's row against Q's columns) fused, and blended into the columns of that key group (the others keep
// what they hold: a vector store, no narrower stores before the scores' vector loads).
template <int B, int D>
void decode_keys(const GearArgs& a, int64_t blk, int64_t first, int64_t kvh, int64_t t0, int64_t f0, int64_t f1,
                 float* __restrict kt, uint8_t* __restrict bytes, float* __restrict qcols, float* __restrict pf) {
  static_assert(kTile == 2 * kLanes, "a key tile is two vectors");
  const int64_t d = D > 0 ? D : a.head_dim, kvh_n = a.num_kv_heads, width = d * B / 8, bs = a.block_size;
  for (int64_t t = f0; t < f1; ++t) {
    const uint8_t* src = a.k_codes + ((blk * bs + t - first) * kvh_n + kvh) * width;
    for (int64_t i = 0; i < width; ++i) bytes[i * kTile + t - t0] = src[i];
  }
  const int64_t r_n = a.rank, block_head = blk * kvh_n + kvh;  // K: side 0
  if (r_n > 0) {
    const Half* q = a.factor_q + (block_head * bs + f0 - first) * r_n;
    const Half* p = a.factor_p + block_head * d * r_n;
    for (int64_t j = f0 - t0; j < f1 - t0; ++j)
      for (int64_t i = 0; i < r_n; ++i) qcols[i * kTile + j] = static_cast<float>(q[(j + t0 - f0) * r_n + i]);
    for (int64_t i = 0; i < d * r_n; ++i) pf[i] = static_cast<float>(p[i]);
  }
  const Vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t part = d / (8 / B);
  for (int64_t t = f0; t < f1;) {  // one key group at a time: one scale and zero per channel
    const int64_t off = t - first, end_t = std::min(f1, t - off % a.key_group + a.key_group);
    const float g0 = static_cast<float>(t - t0), g1 = static_cast<float>(end_t - t0);
    const int64_t m = ((blk * (bs / a.key_group) + off / a.key_group) * kvh_n + kvh) * d;
    for (int64_t c = 0; c < d; ++c) {
      const float sc = static_cast<float>(a.k_scales[m + c]), z = static_cast<float>(a.k_zeros[m + c]);
      const uint8_t* b = bytes + (c % part) * kTile;
      const int shift = static_cast<int>(c / part) * B;
      float* dst = kt + c * kTile;
      for (int h = 0; h < 2; ++h) {
        Vec v = byte_codes<B>(b + h * kLanes, shift) * sc + z;
        for (int64_t i = 0; i < r_n; ++i) v += pf[c * r_n + i] * load(qcols + i * kTile + h * kLanes);
        const Vec j = lane + static_cast<float>(h * kLanes);
        store(dst + h * kLanes, (j >= g0 && j < g1) ? v : load(dst + h * kLanes));
      }
    }
    t = end_t;
  }
  for_outliers(a, 0, blk, first, kvh, f0, f1, [&](int64_t t, int64_t c, float value) { kt[c * kTile + t - t0] = value; });
}

// Values [f0, f1) of one block-head decoded into rows vt [kTile][d] (row t - t0): D + Q P^T (P transposed
// to pt [r][d]), then the outliers. Where 16 channels share their bytes and their value group (head_dim a
// multiple of 16 parts of 16), a row is built in vectors and stored once.
template <int B, int D>
void decode_values(const GearArgs& a, int64_t blk, int64_t first, int64_t kvh, int64_t t0, int64_t f0, int64_t f1,
                   float* __restrict vt, float* __restrict pt) {
  const int64_t d = D > 0 ? D : a.head_dim, kvh_n = a.num_kv_heads, width = d * B / 8, bs = a.block_size;
  const int64_t vg = d / a.value_groups, part = d / (8 / B), r_n = a.rank;
  const int64_t block_head = (a.num_blocks + blk) * kvh_n + kvh;  // V: side 1
  const Half* q = a.factor_q + block_head * bs * r_n;
  if (r_n > 0) {
    const Half* p = a.factor_p + block_head * d * r_n;
    for (int64_t c = 0; c < d; ++c)
      for (int64_t i = 0; i < r_n; ++i) pt[i * d + c] = static_cast<float>(p[c * r_n + i]);
  }
  const bool vectors = D > 0 && part % kLanes == 0 && vg % kLanes == 0 && r_n <= 16;
  for (int64_t t = f0; t < f1; ++t) {
    const int64_t index = (blk * bs + t - first) * kvh_n + kvh;
    const uint8_t* codes = a.v_codes + index * width;
    const Half* vs = a.v_scales + index * a.value_groups;
    const Half* vz = a.v_zeros + index * a.value_groups;
    float* row = vt + (t - t0) * d;
    if (vectors) {
      float qt[16];
      for (int64_t i = 0; i < r_n; ++i) qt[i] = static_cast<float>(q[(t - first) * r_n + i]);
      for (int64_t c = 0; c < d; c += kLanes) {
        Vec v = byte_codes<B>(codes + c % part, static_cast<int>(c / part) * B) * static_cast<float>(vs[c / vg]) +
                static_cast<float>(vz[c / vg]);
        for (int64_t i = 0; i < r_n; ++i) v += qt[i] * load(pt + i * d + c);
        store(row + c, v);
      }
      continue;
    }
    unpack_codes<B, D>(codes, row, d);
    for (int64_t g = 0; g < a.value_groups; ++g) {  // a scale and zero per (token, channel group)
      const float sc = static_cast<float>(vs[g]), z = static_cast<float>(vz[g]);
      for (int64_t c = g * vg; c < (g + 1) * vg; ++c) row[c] = row[c] * sc + z;
    }
    for (int64_t i = 0; i < r_n; ++i) axpy<D>(static_cast<float>(q[(t - first) * r_n + i]), pt + i * d, row, d);
  }
  for_outliers(a, 1, blk, first, kvh, f0, f1, [&](int64_t t, int64_t c, float value) { vt[(t - t0) * d + c] = value; });
}

template <int B, int D, typename T, typename W>
void gear_run(const at::Tensor& out, const at::Tensor& q, const W* exact_k, const W* exact_v, const GearArgs& a) {
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t d = a.head_dim, kvh_n = a.num_kv_heads, bs = a.block_size;
  // The row tiles: a chunk's rows kRows at a time, each decode row alone; a tile costs the keys it reads.
  const int64_t per_tile = a.shared_table ? kRows : 1, num_tiles = (a.rows + per_tile - 1) / per_tile;
  std::vector<int64_t> cost(num_tiles, 0);
  for (int64_t r = 0; r < a.rows; ++r) cost[r / per_tile] = std::max(cost[r / per_tile], a.lens[r]);
  const std::vector<int64_t> bounds = split_by_cost(cost.data(), num_tiles, kvh_n, 0, 16);
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t max_m = (per_tile * a.group + 3) / 4 * 4;

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> qf(max_m * d), acc(max_m * d), mx(max_m), sum(max_m), scores(max_m * kTile),
        form_scores(max_m * kTile), masked(max_m * kTile);
    // Per form: keys [d][kTile] and values [kTile][d]; rows: exact keys before their transpose. All start
    // finite (zero) and stay so: columns a tile does not fill are never read by any row.
    std::vector<float> keys(2 * d * kTile), values(2 * kTile * d), rows(kTile * d), pt(a.rank * d),
        qcols(a.rank * kTile);
    std::vector<uint8_t> bytes(d * B / 8 * kTile);  // a tile's key codes, byte-transposed
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t tile = item / kvh_n, kvh = item % kvh_n;
      const int64_t r0 = tile * per_tile, nrows = std::min(per_tile, a.rows - r0);
      const int64_t m = (nrows * a.group + 3) / 4 * 4;
      const int64_t* table = a.tables + (a.shared_table ? 0 : r0) * a.table_width;
      const int64_t slot = a.slots[r0], base = a.bases[r0];
      // Each row's keys by form: [lo[f][r], hi[f][r]).
      int64_t lo[2][kRows], hi[2][kRows], end = 0;
      for (int64_t r = 0; r < nrows; ++r) {
        const int64_t n = a.lens[r0 + r], nq = std::min(a.quant_lens[r0 + r], n);
        lo[kQuantized][r] = 0, hi[kQuantized][r] = nq;
        lo[kExact][r] = nq, hi[kExact][r] = n;
        end = std::max(end, n);
      }
      std::fill(qf.begin(), qf.end(), 0.f);
      for (int64_t r = 0; r < nrows; ++r)
        for (int64_t g = 0; g < a.group; ++g) {
          const T* src = q_ptr + (r0 + r) * q_row + (kvh * a.group + g) * q_head;
          float* dst = qf.data() + (r * a.group + g) * d;
          for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]) * a.scale;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), threefold::kHiddenScore);
      std::fill(sum.begin(), sum.end(), 0.f);

      // Keys [f0, f1) of the tile at t0 in form f: kt [d][kTile], vt [kTile][d].
      auto decode = [&](int f, int64_t t0, int64_t f0, int64_t f1, float* kt, float* vt) {
        if (f == kQuantized) {
          const int64_t blk = table[t0 / bs], first = t0 / bs * bs;
          decode_keys<B, D>(a, blk, first, kvh, t0, f0, f1, kt, bytes.data(), qcols.data(), pt.data());
          decode_values<B, D>(a, blk, first, kvh, t0, f0, f1, vt, pt.data());
          return;
        }
        for (int64_t t = f0; t < f1; ++t) {
          const int64_t index = ((slot * a.exact_size + (t - base) % a.exact_size) * kvh_n + kvh) * d;
          widen<D>(exact_k + index, rows.data() + (t - t0) * d, d);
          widen<D>(exact_v + index, vt + (t - t0) * d, d);
        }
        for (int64_t t = f0; t < f1; ++t) {  // exact keys: transposed
          const float* row = rows.data() + (t - t0) * d;
          for (int64_t c = 0; c < d; ++c) kt[c * kTile + (t - t0)] = row[c];
        }
      };

      for (int64_t t0 = 0; t0 < end;) {
        const int64_t t1 = std::min({t0 + kTile, (t0 / bs + 1) * bs, end});
        // The forms the rows read in this tile, and the keys each covers.
        int forms[2], num_forms = 0;
        for (int f = 0; f < 2; ++f) {
          int64_t f0 = t1, f1 = t0;
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t x0 = std::max(lo[f][r], t0), x1 = std::min(hi[f][r], t1);
            if (x0 < x1) f0 = std::min(f0, x0), f1 = std::max(f1, x1);
          }
          if (f0 < f1) {
            decode(f, t0, f0, f1, keys.data() + num_forms * d * kTile, values.data() + num_forms * kTile * d);
            forms[num_forms++] = f;
          }
        }
        // Scores: each (row, head) takes the keys it reads in each form; the rest hidden.
        std::fill(scores.begin(), scores.begin() + m * kTile, threefold::kHiddenScore);
        for (int k = 0; k < num_forms; ++k) {
          const int f = forms[k];
          score_tile<D>(qf.data(), m, keys.data() + k * d * kTile, form_scores.data(), d);
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t j0 = std::max(lo[f][r], t0) - t0, j1 = std::min(hi[f][r], t1) - t0;
            for (int64_t g = 0; g < a.group; ++g) {
              const int64_t i = (r * a.group + g) * kTile;
              for (int64_t j = j0; j < j1; ++j) scores[i + j] = form_scores[i + j];
            }
          }
        }
        // Online softmax: rescale what each (row, head) has summed when its maximum grows.
        for (int64_t i = 0; i < m; ++i) {
          float* s = scores.data() + i * kTile;
          float tile_max = threefold::kHiddenScore;
          for (int j = 0; j < kTile; ++j) tile_max = std::max(tile_max, s[j]);
          if (tile_max > mx[i]) {
            const float factor = std::exp(mx[i] - tile_max);
            sum[i] *= factor;
            for (int64_t c = 0; c < d; ++c) acc[i * d + c] *= factor;
            mx[i] = tile_max;
          }
          float total = 0.f;
          for (int j = 0; j < kTile; ++j) s[j] = std::exp(s[j] - mx[i]);
          for (int j = 0; j < kTile; ++j) total += s[j];
          sum[i] += total;
        }
        // Values: each form's, weighted by the probabilities of the keys read in that form.
        for (int k = 0; k < num_forms; ++k) {
          const float* vt = values.data() + k * kTile * d;
          if (num_forms == 1) {
            accumulate_tile<D>(scores.data(), m, vt, acc.data(), d);
            break;
          }
          const int f = forms[k];
          std::fill(masked.begin(), masked.begin() + m * kTile, 0.f);
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t j0 = std::max(lo[f][r], t0) - t0, j1 = std::min(hi[f][r], t1) - t0;
            for (int64_t g = 0; g < a.group; ++g) {
              const int64_t i = (r * a.group + g) * kTile;
              for (int64_t j = j0; j < j1; ++j) masked[i + j] = scores[i + j];
            }
          }
          accumulate_tile<D>(masked.data(), m, vt, acc.data(), d);
        }
        t0 = t1;
      }
      for (int64_t r = 0; r < nrows; ++r)
        for (int64_t g = 0; g < a.group; ++g) {
          const int64_t i = r * a.group + g;
          const float inv = 1.f / sum[i];
          T* dst = out_ptr + (r0 + r) * o_row + (kvh * a.group + g) * o_head;
          for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[i * d + c] * inv);
        }
    }
  });
}

template <int B, typename T, typename W>
void dispatch_dim(const at::Tensor& out, const at::Tensor& q, const W* k, const W* v, const GearArgs& a) {
  switch (a.head_dim) {
    case 64: return gear_run<B, 64, T, W>(out, q, k, v, a);
    case 128: return gear_run<B, 128, T, W>(out, q, k, v, a);
    default: return gear_run<B, 0, T, W>(out, q, k, v, a);
  }
}

template <typename T, typename W>
void dispatch_bits(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const GearArgs& a) {
  if (a.bits == 2) return dispatch_dim<2, T, W>(out, q, k.data_ptr<W>(), v.data_ptr<W>(), a);
  dispatch_dim<4, T, W>(out, q, k.data_ptr<W>(), v.data_ptr<W>(), a);
}

}  // namespace

// out, q: [R, H, d] (float32 or bfloat16, head_dim contiguous); codes, scales, zeros, outliers and factors
// as above (contiguous); exact_k, exact_v: [S, size, kvh, d] contiguous, q's dtype (or float16 beside
// float32 q); block_tables [R or 1, width] int64; meta int64 [4, R] contiguous: rows nq, n (>= 1), slot,
// base (a row reads exact keys [nq, n) at (t - base) mod size, base <= nq, n - nq <= size).
void gear_attention(at::Tensor out, at::Tensor q, at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_scales, at::Tensor k_zeros, at::Tensor v_scales, at::Tensor v_zeros, at::Tensor outlier_values, at::Tensor outlier_index, at::Tensor factor_q, at::Tensor factor_p, at::Tensor exact_k, at::Tensor exact_v, at::Tensor block_tables, at::Tensor meta, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [R, H, d] of one shape, head_dim contiguous");
  const bool half_exact = q.scalar_type() == at::kFloat && exact_k.scalar_type() == at::kHalf;
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && exact_k.scalar_type() == exact_v.scalar_type() &&
                  (q.scalar_type() == exact_k.scalar_type() || half_exact) &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q and out must share a dtype, float32 or bfloat16, and the exact K/V have it too (or float16 beside "
              "float32)");
  const int64_t rows = q.size(0), d = q.size(2);
  const KiviBlocks blocks = check_kivi_blocks(k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros, d);
  const int64_t n_blocks = k_codes.size(0), bs = k_codes.size(1), kvh = k_codes.size(2);
  TORCH_CHECK(q.size(1) % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(outlier_values.dim() == 4 && outlier_values.sizes() == outlier_index.sizes() &&
                  outlier_values.size(0) == 2 && outlier_values.size(1) == n_blocks && outlier_values.size(2) == kvh &&
                  outlier_values.size(3) % 2 == 0 && outlier_values.is_contiguous() && outlier_index.is_contiguous() &&
                  outlier_values.scalar_type() == at::kHalf && outlier_index.scalar_type() == at::kShort,
              "outlier values (fp16) and indices (int16) must be contiguous [2, N, kvh, 2c]");
  TORCH_CHECK(factor_q.dim() == 5 && factor_p.dim() == 5 && factor_q.is_contiguous() && factor_p.is_contiguous() &&
                  factor_q.scalar_type() == at::kHalf && factor_p.scalar_type() == at::kHalf &&
                  factor_q.size(0) == 2 && factor_q.size(1) == n_blocks && factor_q.size(2) == kvh &&
                  factor_q.size(3) == bs && factor_p.size(0) == 2 && factor_p.size(1) == n_blocks &&
                  factor_p.size(2) == kvh && factor_p.size(3) == d && factor_p.size(4) == factor_q.size(4),
              "factors must be contiguous fp16 Q [2, N, kvh, bs, r] and P [2, N, kvh, d, r]");
  TORCH_CHECK(exact_k.dim() == 4 && exact_k.sizes() == exact_v.sizes() && exact_k.size(1) > 0 &&
                  exact_k.size(2) == kvh && exact_k.size(3) == d && exact_k.is_contiguous() && exact_v.is_contiguous(),
              "exact_k and exact_v must be contiguous [S, size, kvh, d]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  (block_tables.size(0) == rows || block_tables.size(0) == 1) && meta.scalar_type() == at::kLong &&
                  meta.is_contiguous() && meta.dim() == 2 && meta.size(0) == 4 && meta.size(1) == rows,
              "block_tables [R or 1, width] and meta [4, R] must be contiguous int64");
  // Every key a row reads must exist: its block, or its exact row.
  const int64_t* m = meta.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), size = exact_k.size(1);
  const bool shared = block_tables.size(0) == 1 && rows > 1;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t nq = m[r], n = m[rows + r], slot = m[2 * rows + r], base = m[3 * rows + r];
    const int64_t first_exact = std::min(nq, n);
    TORCH_CHECK(n >= 1 && nq >= 0 && (first_exact + bs - 1) / bs <= width && slot >= 0 && slot < exact_k.size(0) &&
                    base >= 0 && base <= first_exact && n - first_exact <= size,
                "row ", r, ": its quantized keys need blocks the table lacks, or its exact keys rows the exact K/V lack");
    TORCH_CHECK(!shared || (slot == m[2 * rows] && base == m[3 * rows]), "rows sharing a table share slot and base");
  }
  const int64_t* table = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < n_blocks, "block_tables names a block out of range");
  const GearArgs a{blocks, rows, d, bs, kvh, q.size(1) / kvh, bs / k_scales.size(1), v_scales.size(3), n_blocks,
                   factor_q.size(4), outlier_values.size(3) / 2, width, exact_k.size(0), size, shared,
                   outlier_values.data_ptr<Half>(), outlier_index.data_ptr<int16_t>(), factor_q.data_ptr<Half>(),
                   factor_p.data_ptr<Half>(), table, m, m + rows, m + 2 * rows, m + 3 * rows,
                   static_cast<float>(scale)};
  if (q.scalar_type() == at::kBFloat16) return dispatch_bits<at::BFloat16, at::BFloat16>(out, q, exact_k, exact_v, a);
  if (half_exact) return dispatch_bits<float, Half>(out, q, exact_k, exact_v, a);
  dispatch_bits<float, float>(out, q, exact_k, exact_v, a);
}
