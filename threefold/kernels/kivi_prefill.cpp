// threefold-exports: kivi_prefill_attention kivi_encode
//
// kivi_prefill_attention -- one prefill chunk's attention over a KIVI (or tiered) cache read in place,
// in tiles: each key tile's K and V are decoded once and shared by every query row (and GQA head) of
// a tile of rows, where kivi_attention decodes the whole context once per row.
//
// Row i of the chunk is position p = ctx + i and sees the cache as it stands after p + 1 tokens
// (worker/kivi_attention.py), per row i a key t is read
//
//   [0, ns)              exact, from the request's sinks (tiered; ns = 0 for KIVI)
//   [ns, nm)             from its block, at the block's bits (tiered: 2, the high plane)
//   [max(ns, nm), nq)    tiered's middle band: the block's code refined by its low plane,
//                        code = hi + lo / 4 - 3 / 8 (KIVI: nm = nq, no band)
//   [nq, p]              exact, from the chunk's exact K/V (rows t - exact_lo)
//   t > p                hidden (causal)
//
// with nq, nm, ns given per row (row_meta [3, L]). Blocks as in kivi_attention.cpp:
//   codes     [N, bs, kvh, d / p]   byte i holds code[i + j * d / p] << (j * b), j < p = 8 / b
//   k_scales  [N, bs / G, kvh, d]   fp16 (k_zeros alike): per (key group, channel)
//   v_scales  [N, bs, kvh, d / VG]  fp16 (v_zeros alike): per (token, channel group)
//
// Work item = (tile of kRows query rows, kv head). Keys are walked in tiles of at most kTile that never
// cross a block; for each form some row of the item reads in the tile, its keys (transposed, [d][kTile])
// and values ([kTile][d]) are decoded to fp32 once, then every (row, head) of the item is scored against
// them (a broadcast-FMA micro GEMM) and merged into the running softmax (flash style: running max,
// sum, rescaled fp32 accumulator). A tile that a row tile's rows read in different forms (the window
// boundary, the band's edge, the sinks) is decoded in each form and every row takes its own keys.
//
// kivi_encode -- kv/codecs/kivi.py's `encode` (and tiered.py's `split`) natively: whole blocks of exact
// K/V quantized (min/max per key group channel and per value token channel group), packed and stored,
// with the codes, scales and zeros the torch quantizer gives, bit for bit.

#include "kivi_blocks.h"
#include "decode_attention.h"

#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vectors in inline helpers of non-AVX-512 builds

namespace {

using Half = at::Half;

constexpr int kTile = 32;   // keys per tile
constexpr int kRows = 16;   // query rows per work item
constexpr int kLanes = 16;  // floats per Vec
constexpr int kForms = 4;
enum Form { kSink = 0, kFar = 1, kBand = 2, kExact = 3 };

// 16 floats; the compiler maps it onto one AVX-512 register, two AVX2 ones, or four SSE ones.
typedef float Vec __attribute__((vector_size(64)));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// v, held in a register: GCC otherwise re-reads a vector each use as an FMA's memory operand, and the
// micro GEMMs below then wait on loads (one 512-bit load a cycle on Zen 4) instead of FMAs.
inline Vec in_register(Vec v) {
#if defined(THREEFOLD_AVX512)
  asm("" : "+v"(v));
#endif
  return v;
}

struct PrefillArgs : KiviBlocks {
  int64_t rows, num_heads, head_dim, block_size, num_kv_heads, group, key_group, value_groups;
  int64_t ctx, exact_lo, band_lo, band_len, sink_len;
  bool tiered;
  const int64_t* table;
  const int64_t* quant_lens;
  const int64_t* mid_lens;
  const int64_t* sink_lens;
  const uint8_t* band;  // [2, band_len, kvh, d / 4] (tiered), positions band_lo + i
  const void* sinks;    // [2, sink_len, kvh, d] exact, the exact K/V's dtype (tiered)
  float scale;
};

// s[j] = exp(s[j] - shift) for j < kTile, where s[j] <= shift (a hidden score, -1e30, gives 0). AVX-512:
// 2^(x log2 e) as 2^n p(f), n the nearest integer, p a degree-6 Taylor polynomial of 2^f on |f| <= 1/2
// (relative error < 2e-7), scaled by vscalefps; libmvec's expf (the generic path) cost a fifth of the kernel.
inline void exp_shifted(float* s, float shift) {
#if defined(THREEFOLD_AVX512)
  const __m512 log2e = _mm512_set1_ps(1.44269504f), m = _mm512_set1_ps(shift);
  constexpr float ln2 = 0.693147181f;
  for (int j = 0; j < kTile; j += 16) {
    const __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), m), log2e);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(ln2));  // 2^(t - n) = e^f
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    _mm512_storeu_ps(s + j, _mm512_scalef_ps(p, n));
  }
#else
  for (int j = 0; j < kTile; ++j) s[j] = std::exp(s[j] - shift);
#endif
}

// s[i][0, kTile) = q[i] . kt[:, 0, kTile) for i < m (m a multiple of 4; q's pad rows are zero).
template <int D>
void score_tile(const float* __restrict q, int64_t m, const float* __restrict kt, float* __restrict s, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  for (int64_t i = 0; i < m; i += 4) {
    Vec a[4][2] = {};
    for (int64_t c = 0; c < n; ++c) {
      const Vec k0 = in_register(load(kt + c * kTile)), k1 = in_register(load(kt + c * kTile + kLanes));
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
        for (int x = 0; x < V; ++x) row[x] = in_register(load(v + j * D + x * kLanes));
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

template <int B, int D, typename T, typename W, bool TIERED>
void prefill_run(const at::Tensor& out, const at::Tensor& q, const W* exact_k, const W* exact_v,
                 const PrefillArgs& a) {
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t d = a.head_dim, kvh_n = a.num_kv_heads, width = d * B / 8, vg = d / a.value_groups;
  const int64_t low_width = d / 4, num_tiles = (a.rows + kRows - 1) / kRows;
  std::vector<int64_t> cost(num_tiles);  // keys the last row of each row tile reads
  for (int64_t i = 0; i < num_tiles; ++i) cost[i] = a.ctx + std::min(a.rows, (i + 1) * kRows);
  const std::vector<int64_t> bounds = split_by_cost(cost.data(), num_tiles, kvh_n, 0, 16);
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t max_m = (kRows * a.group + 3) / 4 * 4;
  const W* sinks = static_cast<const W*>(a.sinks);

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> qf(max_m * d), acc(max_m * d), mx(max_m), sum(max_m), scores(max_m * kTile),
        form_scores(max_m * kTile), masked(max_m * kTile), row(d), tmp(d);
    std::vector<uint8_t> bytes(width * kTile), low_bytes(low_width * kTile);  // a tile's codes, byte-transposed
    std::vector<float> keys(kForms * d * kTile), values(kForms * kTile * d);  // per form: [d][kTile], [kTile][d]
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t tile = item / kvh_n, kvh = item % kvh_n;
      const int64_t r0 = tile * kRows, nrows = std::min<int64_t>(kRows, a.rows - r0);
      const int64_t m = (nrows * a.group + 3) / 4 * 4;
      // Each row's keys by form: [lo[f][r], hi[f][r]).
      int64_t lo[kForms][kRows], hi[kForms][kRows];
      for (int64_t r = 0; r < nrows; ++r) {
        const int64_t n = a.ctx + r0 + r + 1, nq = std::min(a.quant_lens[r0 + r], n);
        const int64_t nm = TIERED ? std::min(a.mid_lens[r0 + r], nq) : nq;
        const int64_t ns = TIERED ? std::min(a.sink_lens[r0 + r], nq) : 0;
        lo[kSink][r] = 0, hi[kSink][r] = ns;
        lo[kFar][r] = ns, hi[kFar][r] = std::max(ns, nm);
        lo[kBand][r] = std::max(ns, nm), hi[kBand][r] = nq;
        lo[kExact][r] = nq, hi[kExact][r] = n;
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

      // The keys [f0, f1) of the tile at t0, in form f: keys transposed into kt [d][kTile], values into vt
      // [kTile][d]. The other columns and rows keep earlier (finite) values: no row reads them (their
      // scores are hidden, their weights 0).
      auto decode = [&](int f, int64_t t0, int64_t f0, int64_t f1, float* kt, float* vt) {
        if (f == kSink || f == kExact) {
          for (int64_t t = f0; t < f1; ++t) {
            const int64_t j = t - t0, index = (f == kSink ? t : t - a.exact_lo) * kvh_n + kvh;
            const W* ks = f == kSink ? sinks : exact_k;
            const W* vs = f == kSink ? sinks + a.sink_len * kvh_n * d : exact_v;
            widen<D>(ks + index * d, row.data(), d);
            widen<D>(vs + index * d, vt + j * d, d);
            for (int64_t c = 0; c < d; ++c) kt[c * kTile + j] = row[c];
          }
          return;
        }
        // Quantized: the tile lies in one block. Key codes gathered byte-transposed (bytes[i][j]: byte i of
        // key j), then decoded a channel at a time across the keys of each key group.
        const int64_t blk = a.table[t0 / a.block_size], base = blk * a.block_size - t0 / a.block_size * a.block_size;
        for (int64_t t = f0; t < f1; ++t) {
          const int64_t j = t - t0, index = (base + t) * kvh_n + kvh;
          const uint8_t* src = a.k_codes + index * width;
          for (int64_t i = 0; i < width; ++i) bytes[i * kTile + j] = src[i];
          float* vrow = vt + j * d;
          unpack_codes<B, D>(a.v_codes + index * width, vrow, d);
          if (TIERED && f == kBand) {
            const int64_t low = ((t - a.band_lo) * kvh_n + kvh) * low_width;
            for (int64_t i = 0; i < low_width; ++i) low_bytes[i * kTile + j] = a.band[low + i];
            add_low_plane<D>(a.band + a.band_len * kvh_n * low_width + low, vrow, tmp.data(), d);
          }
          const Half* vsc = a.v_scales + index * a.value_groups;
          const Half* vz = a.v_zeros + index * a.value_groups;
          for (int64_t cg = 0; cg < a.value_groups; ++cg) {
            const float sc = static_cast<float>(vsc[cg]), z = static_cast<float>(vz[cg]);
            for (int64_t c = cg * vg; c < (cg + 1) * vg; ++c) vrow[c] = vrow[c] * sc + z;
          }
        }
        constexpr int P = 8 / B, mask = (1 << B) - 1;
        const int64_t part = d / P;
        for (int64_t t = f0; t < f1;) {  // one key group's keys at a time: one scale and zero per channel
          const int64_t off = (base + t) - blk * a.block_size, end_t = std::min(f1, t - off % a.key_group + a.key_group);
          const int64_t j0 = t - t0, j1 = end_t - t0;
          const int64_t km = ((blk * (a.block_size / a.key_group) + off / a.key_group) * kvh_n + kvh) * d;
          for (int64_t c = 0; c < d; ++c) {
            const float sc = static_cast<float>(a.k_scales[km + c]), z = static_cast<float>(a.k_zeros[km + c]);
            const uint8_t* b = bytes.data() + (c % part) * kTile;
            const int shift = static_cast<int>(c / part) * B;
            float* dst = kt + c * kTile;
            if (TIERED && f == kBand) {
              const uint8_t* lb = low_bytes.data() + (c % low_width) * kTile;
              const int low_shift = static_cast<int>(c / low_width) * 2;
              for (int64_t j = j0; j < j1; ++j)
                dst[j] = (static_cast<float>((b[j] >> shift) & mask) + 0.25f * static_cast<float>((lb[j] >> low_shift) & 3) -
                          0.375f) * sc + z;
            } else {
              for (int64_t j = j0; j < j1; ++j) dst[j] = static_cast<float>((b[j] >> shift) & mask) * sc + z;
            }
          }
          t = end_t;
        }
      };

      const int64_t end = a.ctx + r0 + nrows;  // keys of the item: [0, end)
      for (int64_t t0 = 0; t0 < end;) {
        const int64_t t1 = std::min({t0 + kTile, (t0 / a.block_size + 1) * a.block_size, end});
        // The forms the rows read in this tile, and the keys each covers.
        int forms[kForms], num_forms = 0;
        int64_t span_lo[kForms], span_hi[kForms];
        for (int f = 0; f < kForms; ++f) {
          int64_t f0 = t1, f1 = t0;
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t x0 = std::max(lo[f][r], t0), x1 = std::min(hi[f][r], t1);
            if (x0 < x1) f0 = std::min(f0, x0), f1 = std::max(f1, x1);
          }
          if (f0 < f1) forms[num_forms] = f, span_lo[num_forms] = f0, span_hi[num_forms++] = f1;
        }
        // Scores: each form's, each (row, head) taking the keys it reads in that form; the rest hidden.
        std::fill(scores.begin(), scores.begin() + m * kTile, threefold::kHiddenScore);
        for (int k = 0; k < num_forms; ++k) {
          const int f = forms[k];
          float* kt = keys.data() + k * d * kTile;
          decode(f, t0, span_lo[k], span_hi[k], kt, values.data() + k * kTile * d);
          score_tile<D>(qf.data(), m, kt, form_scores.data(), d);
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
          exp_shifted(s, mx[i]);
          for (int j = 0; j < kTile; ++j) total += s[j];
          sum[i] += total;
        }
        // Values: each form's weighted by the probabilities of the keys read in that form.
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

template <int B, typename T, typename W, bool TIERED>
void dispatch_dim(const at::Tensor& out, const at::Tensor& q, const W* k, const W* v, const PrefillArgs& a) {
  switch (a.head_dim) {
    case 64: return prefill_run<B, 64, T, W, TIERED>(out, q, k, v, a);
    case 128: return prefill_run<B, 128, T, W, TIERED>(out, q, k, v, a);
    default: return prefill_run<B, 0, T, W, TIERED>(out, q, k, v, a);
  }
}

template <typename T, typename W>
void dispatch_bits(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const PrefillArgs& a) {
  const W* kp = k.data_ptr<W>();
  const W* vp = v.data_ptr<W>();
  if (a.tiered) return dispatch_dim<2, T, W, true>(out, q, kp, vp, a);
  if (a.bits == 2) return dispatch_dim<2, T, W, false>(out, q, kp, vp, a);
  dispatch_dim<4, T, W, false>(out, q, kp, vp, a);
}

}  // namespace

// out, q: [L, H, d] (float32 or bfloat16, head_dim contiguous); codes, scales, zeros as above
// (contiguous); exact_k, exact_v: [E, kvh, d] contiguous, the exact K/V of positions [exact_lo,
// exact_lo + E), q's dtype (or float16 beside float32 q); block_table [width] int64 (the request's);
// row_meta: int64 [3, L] contiguous, rows nq, nm, ns (KIVI: nm = nq, ns = 0); ctx: row 0's position.
// tiered: band uint8 [2, NB, kvh, d / 4], the low planes of positions [band_lo, band_lo + NB); sinks
// [2, S, kvh, d] in the exact K/V's dtype (read where ns > 0). Not tiered (KIVI): both ignored.
void kivi_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_scales, at::Tensor k_zeros, at::Tensor v_scales, at::Tensor v_zeros, at::Tensor exact_k, at::Tensor exact_v, int64_t exact_lo, at::Tensor block_table, at::Tensor row_meta, int64_t ctx, at::Tensor band, int64_t band_lo, at::Tensor sinks, bool tiered, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [L, H, d] of one shape, head_dim contiguous");
  const bool half_exact = q.scalar_type() == at::kFloat && exact_k.scalar_type() == at::kHalf;
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && exact_k.scalar_type() == exact_v.scalar_type() &&
                  (q.scalar_type() == exact_k.scalar_type() || half_exact) &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q and out must share a dtype, float32 or bfloat16, and the exact K/V have it too (or float16 beside "
              "float32)");
  const int64_t rows = q.size(0), d = q.size(2);
  const KiviBlocks checked = check_kivi_blocks(k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros, d);
  const int64_t kvh = k_codes.size(2), bs = k_codes.size(1);
  TORCH_CHECK(q.size(1) % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(exact_k.dim() == 3 && exact_k.sizes() == exact_v.sizes() && exact_k.size(1) == kvh &&
                  exact_k.size(2) == d && exact_k.is_contiguous() && exact_v.is_contiguous(),
              "exact_k and exact_v must be contiguous [E, kvh, d]");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 1 &&
                  row_meta.scalar_type() == at::kLong && row_meta.is_contiguous() && row_meta.dim() == 2 &&
                  row_meta.size(0) == 3 && row_meta.size(1) == rows,
              "block_table [width] and row_meta [3, L] must be contiguous int64");
  TORCH_CHECK(!tiered || (checked.bits == 2 && band.scalar_type() == at::kByte && band.is_contiguous() &&
                          band.dim() == 4 && band.size(0) == 2 && band.size(2) == kvh && band.size(3) * 4 == d &&
                          sinks.scalar_type() == exact_k.scalar_type() && sinks.is_contiguous() &&
                          sinks.dim() == 4 && sinks.size(0) == 2 && sinks.size(2) == kvh && sinks.size(3) == d),
              "tiered: 2-bit codes, band contiguous uint8 [2, NB, kvh, d / 4], sinks contiguous [2, S, kvh, d] in "
              "the exact K/V's dtype");
  // Every key a row reads must exist: its block, exact row, low plane or sink.
  const int64_t* meta = row_meta.data_ptr<int64_t>();
  const int64_t blocks = block_table.size(0), exact_len = exact_k.size(0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = ctx + r + 1, nq = std::min(meta[r], n);
    const int64_t nm = tiered ? std::min(meta[rows + r], nq) : nq, ns = tiered ? std::min(meta[2 * rows + r], nq) : 0;
    TORCH_CHECK(nq >= 0 && (nq + bs - 1) / bs <= blocks && exact_lo <= nq && n <= exact_lo + exact_len,
                "row ", r, ": its quantized keys need blocks the table lacks, or its exact keys rows exact_k lacks");
    TORCH_CHECK(!tiered || (ns >= 0 && ns <= sinks.size(1) &&
                            (std::max(ns, nm) >= nq || (band_lo <= std::max(ns, nm) && nq <= band_lo + band.size(1)))),
                "row ", r, ": its sinks or middle band lie outside sinks / band");
  }
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < blocks; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < k_codes.size(0), "block_table names a block out of range");
  const PrefillArgs a{checked, rows, q.size(1), d, bs, kvh, q.size(1) / kvh, bs / k_scales.size(1), v_scales.size(3),
                      ctx, exact_lo, band_lo, tiered ? band.size(1) : 0, tiered ? sinks.size(1) : 0, tiered, table, meta,
                      meta + rows, meta + 2 * rows, tiered ? band.data_ptr<uint8_t>() : nullptr,
                      tiered ? sinks.data_ptr() : nullptr, static_cast<float>(scale)};
  if (q.scalar_type() == at::kBFloat16) return dispatch_bits<at::BFloat16, at::BFloat16>(out, q, exact_k, exact_v, a);
  if (half_exact) return dispatch_bits<float, Half>(out, q, exact_k, exact_v, a);
  dispatch_bits<float, float>(out, q, exact_k, exact_v, a);
}

namespace {

// ---- kivi_encode ---------------------------------------------------------------------------------
// Each group's minimum and maximum (exact in any order: -ffast-math may vectorize them).
inline void column_range(const float* x, int64_t rows, int64_t cols, float* low, float* high) {
  for (int64_t c = 0; c < cols; ++c) low[c] = high[c] = x[c];
  for (int64_t r = 1; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) low[c] = std::min(low[c], x[r * cols + c]), high[c] = std::max(high[c], x[r * cols + c]);
}

inline void row_range(const float* x, int64_t n, float& low, float& high) {
  low = high = x[0];
  for (int64_t i = 1; i < n; ++i) low = std::min(low, x[i]), high = std::max(high, x[i]);
}

// The quantizer's arithmetic in IEEE fp32 as torch does it, one operation at a time: no reciprocal for
// the division, no fused multiply-add, so the codes, scales and zeros equal kv/codecs/kivi.py's.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

// n groups' ranges -> their scale and zero (fp16, quantize_minmax's) and, as fp32, the divisor s (1 where
// the scale is 0: a constant group) and zero z the codes are computed with.
__attribute__((noinline)) void grids(const float* low, const float* high, int64_t n, int bits, Half* scale, Half* zero,
                                     float* s, float* z) {
  const float levels = static_cast<float>((1 << bits) - 1);
  for (int64_t i = 0; i < n; ++i) {
    scale[i] = Half((high[i] - low[i]) / levels);
    zero[i] = Half(low[i]);
    s[i] = static_cast<float>(scale[i]) > 0.f ? static_cast<float>(scale[i]) : 1.f;
    z[i] = static_cast<float>(zero[i]);
  }
}

// codes[r][c] = clamp(round_half_even((x[r][c] - z[c]) / s[c]), 0, 2^bits - 1) for r < rows, c < cols.
__attribute__((noinline)) void code_rows(const float* __restrict x, int64_t rows, int64_t cols, const float* s,
                                         const float* z, int bits, uint8_t* __restrict codes) {
  const float levels = static_cast<float>((1 << bits) - 1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float q = std::nearbyint((x[r * cols + c] - z[c]) / s[c]);
      codes[r * cols + c] = static_cast<uint8_t>(std::min(std::max(q, 0.f), levels));
    }
}

// The 4-bit grid's (scale, zero) -> its high plane's (tiered.py's _coarse): 4 s, z + 1.5 s.
__attribute__((noinline)) void coarsen(Half* scale, Half* zero, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = static_cast<float>(scale[i]), z = static_cast<float>(zero[i]);
    const float shift = 1.5f * s;
    scale[i] = Half(s * 4.f);
    zero[i] = Half(z + shift);
  }
}

#pragma GCC pop_options

// codes [d] (channel order) -> packed [d * bits / 8] (byte i: code[i + j * d / p] << (j * bits)) of the
// codes' top `bits` of `fine` bits (drop = fine - bits low bits dropped).
inline void pack_row(const uint8_t* codes, int64_t d, int bits, int drop, uint8_t* dst) {
  const int p = 8 / bits;
  const int64_t part = d / p;
  for (int64_t i = 0; i < part; ++i) {
    uint8_t byte = 0;
    for (int j = 0; j < p; ++j) byte |= static_cast<uint8_t>((codes[i + j * part] >> drop) << (j * bits));
    dst[i] = byte;
  }
}

// The low 2 bits of each code, packed as 2-bit codes (tiered's low plane).
inline void pack_low(const uint8_t* codes, int64_t d, uint8_t* dst) {
  const int64_t part = d / 4;
  for (int64_t i = 0; i < part; ++i) {
    uint8_t byte = 0;
    for (int j = 0; j < 4; ++j) byte |= static_cast<uint8_t>((codes[i + j * part] & 3) << (2 * j));
    dst[i] = byte;
  }
}

template <typename W>
void encode_run(const W* k, const W* v, const int64_t* ids, int64_t n, int64_t bs, int64_t kvh_n, int64_t d,
                int64_t group, int fine, int bits, uint8_t* k_codes, uint8_t* v_codes, Half* k_scales, Half* k_zeros,
                Half* v_scales, Half* v_zeros, uint8_t* low) {
  const int64_t width = d * bits / 8, low_width = d / 4, key_groups = bs / group, value_groups = d / group;
  const int drop = fine - bits;
  at::parallel_for(0, n * kvh_n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(bs * d), mins(d), maxs(d), s(d), z(d);
    std::vector<uint8_t> codes(bs * d);  // [token][channel]
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kvh_n, h = item % kvh_n, blk = ids[i];
      for (int side = 0; side < 2; ++side) {
        const W* src = (side == 0 ? k : v) + (i * bs * kvh_n + h) * d;
        for (int64_t t = 0; t < bs; ++t)
          for (int64_t c = 0; c < d; ++c) x[t * d + c] = to_float(src[t * kvh_n * d + c]);
        if (side == 0) {  // keys: per channel over each group of tokens
          for (int64_t g = 0; g < key_groups; ++g) {
            const int64_t m = ((blk * key_groups + g) * kvh_n + h) * d;
            const float* rows = x.data() + g * group * d;
            column_range(rows, group, d, mins.data(), maxs.data());
            grids(mins.data(), maxs.data(), d, fine, k_scales + m, k_zeros + m, s.data(), z.data());
            code_rows(rows, group, d, s.data(), z.data(), fine, codes.data() + g * group * d);
            if (drop) coarsen(k_scales + m, k_zeros + m, d);
          }
        } else {  // values: per token over each group of channels
          for (int64_t t = 0; t < bs; ++t) {
            const int64_t m = ((blk * bs + t) * kvh_n + h) * value_groups;
            for (int64_t g = 0; g < value_groups; ++g) row_range(x.data() + t * d + g * group, group, mins[g], maxs[g]);
            grids(mins.data(), maxs.data(), value_groups, fine, v_scales + m, v_zeros + m, s.data(), z.data());
            for (int64_t c = d - 1; c >= 0; --c) s[c] = s[c / group], z[c] = z[c / group];  // per channel
            code_rows(x.data() + t * d, 1, d, s.data(), z.data(), fine, codes.data() + t * d);
            if (drop) coarsen(v_scales + m, v_zeros + m, value_groups);
          }
        }
        uint8_t* dst = side == 0 ? k_codes : v_codes;
        for (int64_t t = 0; t < bs; ++t) {
          pack_row(codes.data() + t * d, d, bits, drop, dst + ((blk * bs + t) * kvh_n + h) * width);
          if (drop) pack_low(codes.data() + t * d, d, low + (((side * n + i) * bs + t) * kvh_n + h) * low_width);
        }
      }
    }
  });
}

}  // namespace

// k, v: [n, bs, kvh, d] contiguous (float32, float16 or bfloat16), whole blocks of exact K/V, into blocks
// block_ids [n] int64 of k_codes/v_codes/scales/zeros (the kivi_prefill_attention operands). fine: the
// quantizer's bits. fine = the codes' bits: KIVI's encode. fine = 4 beside 2-bit codes: tiered's split,
// the high planes stored (scales and zeros coarsened) and the low planes written to low [2, n, bs, kvh, d / 4].
void kivi_encode(at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_scales, at::Tensor k_zeros, at::Tensor v_scales, at::Tensor v_zeros, at::Tensor block_ids, at::Tensor k, at::Tensor v, int64_t fine, at::Tensor low) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous() &&
                  k.scalar_type() == v.scalar_type(),
              "k and v must be contiguous [n, bs, kvh, d] of one dtype");
  const int64_t n = k.size(0), bs = k.size(1), kvh = k.size(2), d = k.size(3);
  const int bits = static_cast<int>(check_kivi_blocks(k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros, d).bits);
  const int64_t group = bs / k_scales.size(1);
  TORCH_CHECK(k_codes.size(1) == bs && k_codes.size(2) == kvh && v_scales.size(3) * group == d,
              "codes must hold k's bs and kvh, and the value scales the keys' G");
  TORCH_CHECK(fine == bits || (fine == 4 && bits == 2), "fine must be the codes' bits, or 4 beside 2-bit codes");
  TORCH_CHECK(fine == bits || (low.scalar_type() == at::kByte && low.is_contiguous() && low.dim() == 5 &&
                               low.size(0) == 2 && low.size(1) == n && low.size(2) == bs && low.size(3) == kvh &&
                               low.size(4) * 4 == d),
              "low must be contiguous uint8 [2, n, bs, kvh, d / 4]");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() && block_ids.dim() == 1 &&
                  block_ids.size(0) == n,
              "block_ids must be contiguous int64 [n]");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < k_codes.size(0), "block_ids names a block out of range");
  uint8_t* low_ptr = fine == bits ? nullptr : low.data_ptr<uint8_t>();
  auto go = [&](auto tag) {
    using W = decltype(tag);
    encode_run<W>(k.data_ptr<W>(), v.data_ptr<W>(), ids, n, bs, kvh, d, group, static_cast<int>(fine), bits,
                  k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(), k_scales.data_ptr<Half>(),
                  k_zeros.data_ptr<Half>(), v_scales.data_ptr<Half>(), v_zeros.data_ptr<Half>(), low_ptr);
  };
  switch (k.scalar_type()) {
    case at::kFloat: return go(float{});
    case at::kHalf: return go(Half{});
    case at::kBFloat16: return go(at::BFloat16{});
    default: TORCH_CHECK(false, "k and v must be float32, float16 or bfloat16");
  }
}

