// threefold-exports: kivi_attention tiered_attention
//
// kivi_attention -- attention over a KIVI cache read in place: each query row attends over
// its quantized positions [0, nq) straight from the packed blocks and over the exact positions
// [nq, len) from a full-precision window, with no dequantized copy of any context.
//
//   out[r, h] = softmax_t(scale * q[r, h] . K^[t, h / Gq]) @ V^[t, h / Gq],   t < seq_len[r]
//   t <  nq[r]: K^/V^ decoded from block table[r, t / bs] (2 or 4 bits, kv/codecs/kivi.py)
//   t >= nq[r]: exact rows ring[0|1, slot[r], (t - base[r]) mod size]
//
// The quantized side (G = key group, VG = value group, b = bits, p = 8 / b parts per byte):
//   codes     [N, bs, kvh, d / p]   byte i holds code[i + j * d / p] << (j * b), j < p
//   k_scales  [N, bs / G, kvh, d]   fp16 (k_zeros alike): per (key group, channel)
//   v_scales  [N, bs, kvh, d / VG]  fp16 (v_zeros alike): per (token, channel group)
// Keys: the per-channel scale is folded into q once per key group, qs = q * s, qz = q . z,
// so a key's score is qs . codes + qz. With AVX2 (head_dim 64 or 128) it is computed on the
// codes, as integers (codes_avx2.h: qs as int16, vpdpwssd / vpmaddwd), and values likewise, two
// rows at a time against their int16 weights p s; elsewhere each row is decoded to fp32 once
// and shared by the Gq query heads of its kv head.
//
// tiered_attention (kv/codecs/tiered.py) reads the blocks as kivi2 and adds, per row, the positions
// [0, ns) exact from the request's sinks and, for [nm, nq), the low bit plane from its band:
//   code = hi + lo / 4 - 3 / 8   (then the block's scale and zero, as for any code)
//
// Work item = (row, kv head), split over threads by keys read (decode_attention.h). A decode
// row reads the request's ring; the rows of a prefill chunk share one block table and read
// the chunk's exact K/V (base = its first exact position, size = its length).

#include "decode_attention.h"
#include "decode_attention_avx2.h"
#include "codes_avx2.h"
#include "kivi_blocks.h"

namespace {

using Half = at::Half;

struct KiviArgs : KiviBlocks {
  int64_t rows, num_heads, head_dim, block_size, num_kv_heads, group, table_width;
  int64_t key_group, value_groups, ring_slots, ring_size;
  const int64_t* tables;
  const int64_t* quant_lens;
  const int64_t* lens;
  const int64_t* slots;
  const int64_t* bases;
  float fscale;
  // tiered_attention only (null / 0 otherwise):
  const uint8_t* band = nullptr;       // [2, band_slots, band_size, kvh, d / 4]
  int64_t band_slots = 0, band_size = 1;
  const int64_t* mid_lens = nullptr;     // nm per row
  const int64_t* band_rows = nullptr;    // band slot per row
  const int64_t* band_bases = nullptr;   // position of band row 0 (mod band_size)
  const void* sinks = nullptr;           // [2, sink_slots, sink, kvh, d], the ring's dtype
  int64_t sink_slots = 0, sink = 0;
  const int64_t* sink_lens = nullptr;    // ns per row (<= nq)
  const int64_t* sink_rows = nullptr;    // sinks slot per row
};

constexpr int kKeys = 16;  // rows decoded, then scored (or accumulated), together
#if defined(THREEFOLD_AVX2)
static_assert(kKeys == fast::kRows, "values_block takes kKeys rows");
#endif
constexpr int kMaxGroup = 16;  // query heads per kv head the vector path holds (more: the generic loop)

// scores[g * n + j] = qs_g . rows[j] for each head g of the group and j < count: on AVX2 (head_dim 64
// or 128) eight keys' lanes reduced together (decode_attention_avx2.h), else one dot at a time.
template <int D>
inline void score_rows(float* const (&rows)[kKeys], int count, const float* qs, int64_t group, float* scores,
                       int64_t n, int64_t d) {
#if defined(THREEFOLD_AVX2)
  if constexpr (D > 0 && D % 16 == 0) {
    return avx2::score_block<D>(reinterpret_cast<const float* const (&)[kKeys]>(rows), count, qs, group, scores, n);
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int j = 0; j < count; ++j) scores[g * n + j] = dot<D>(qs + g * d, rows[j], d);
}

// acc[g] += p[g * n + j] rows[j] for each head g and j < count (AVX2: the output held in registers).
template <int D>
inline void accumulate_rows(float* const (&rows)[kKeys], int count, const float* p, int64_t group, int64_t n,
                            float* acc, int64_t d) {
#if defined(THREEFOLD_AVX2)
  if constexpr (D > 0 && D % 64 == 0) {
    return avx2::accumulate_block<D>(reinterpret_cast<const float* const (&)[kKeys]>(rows), count, p, group, n, acc);
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int j = 0; j < count; ++j) axpy<D>(p[g * n + j], rows[j], acc + g * d, d);
}

// T: q and out; W: the window's rows (T, or fp16 beside fp32 q: kv/window.py's window_dtype).
template <int B, int D, typename T, typename W, bool TIERED>
void kivi_run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& ring, const KiviArgs& a) {
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const W* ring_ptr = ring.data_ptr<W>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t d = a.head_dim, kvh_n = a.num_kv_heads, width = d * B / 8, vg = d / a.value_groups;
  const int64_t ring_side = a.ring_slots * a.ring_size * kvh_n * d;  // K half of the ring, then V
  const std::vector<int64_t> bounds = split_by_cost(a.lens, a.rows, kvh_n, 0, 16);
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;
#if defined(THREEFOLD_AVX2)
  constexpr bool kFast = fast::kCodes<B, D>;
#else
  constexpr bool kFast = false;
#endif
  const bool fast_values = kFast && vg % 16 == 0;
  constexpr bool kExact = std::is_same_v<T, float>;  // fp32 q: keys scored to fp32's precision (two int16 rows)

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    const int64_t gd = a.group * d;
    std::vector<float> qf(gd), qs(gd), qz(a.group), acc(gd), tmp(d), meta(2 * d), scores;
    std::vector<float> decoded(kKeys * d);  // the rows of one block of keys (or values), fp32
    std::vector<int16_t> q16(2 * gd);       // the fast path's int16 qs (and low rows), its scales a and sum qs
    std::vector<float> qa(a.group), qsum(a.group), vacc(gd), vscale(kKeys * a.value_groups),
        vzero(kKeys * a.value_groups), zsum(a.group * a.value_groups);
#if defined(THREEFOLD_AVX2)
    __m256i vcodes[kKeys][D > 0 ? D / 16 : 1];  // the fast path's value codes (16-bit lanes)
#endif
    float* rows[kKeys];
    for (int j = 0; j < kKeys; ++j) rows[j] = decoded.data() + j * d;
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t r = item / kvh_n, kvh = item % kvh_n;
      const int64_t len = a.lens[r], nq = std::min(a.quant_lens[r], len);
      const int64_t nm = TIERED ? std::min(a.mid_lens[r], nq) : nq, ns = TIERED ? std::min(a.sink_lens[r], nq) : 0;
      const int64_t low_width = d / 4, band_side = a.band_slots * a.band_size * kvh_n * low_width;
      const uint8_t* band = TIERED ? a.band + (a.band_rows[r] * a.band_size * kvh_n + kvh) * low_width : nullptr;
      auto band_row = [&](int64_t pos) {  // offset of position pos's low plane (K side)
        int64_t i = (pos - a.band_bases[r]) % a.band_size;
        return (i < 0 ? i + a.band_size : i) * kvh_n * low_width;
      };
      const int64_t sink_side = a.sink_slots * a.sink * kvh_n * d;
      const W* sinks = TIERED ? static_cast<const W*>(a.sinks) + (a.sink_rows[r] * a.sink * kvh_n + kvh) * d : nullptr;
      const int64_t* table = a.tables + r * a.table_width;
      const W* exact = ring_ptr + a.slots[r] * a.ring_size * kvh_n * d + kvh * d;
      auto exact_row = [&](int64_t pos) {  // offset of position pos's exact row (K side)
        int64_t i = (pos - a.bases[r]) % a.ring_size;
        return (i < 0 ? i + a.ring_size : i) * kvh_n * d;
      };
      for (int64_t g = 0; g < a.group; ++g) {
        const T* src = q_ptr + r * q_row + (kvh * a.group + g) * q_head;
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_float(src[i]) * a.fscale;
      }
      scores.resize(a.group * len);  // every position is written below
      // Exact rows (sinks, window) [from, to): widened kKeys at a time, then scored or accumulated together.
      auto score_exact = [&](int64_t from, int64_t to, auto&& src) {
        for (int64_t pos = from; pos < to; pos += kKeys) {
          const int count = static_cast<int>(std::min<int64_t>(kKeys, to - pos));
          for (int j = 0; j < count; ++j) widen<D>(src(pos + j), rows[j], d);
          score_rows<D>(rows, count, qf.data(), a.group, scores.data() + pos, len, d);
        }
      };
      auto add_exact = [&](int64_t from, int64_t to, auto&& src) {
        for (int64_t pos = from; pos < to; pos += kKeys) {
          const int count = static_cast<int>(std::min<int64_t>(kKeys, to - pos));
          for (int j = 0; j < count; ++j) widen<D>(src(pos + j), rows[j], d);
          accumulate_rows<D>(rows, count, scores.data() + pos, a.group, len, acc.data(), d);
        }
      };
      auto sink_k = [&](int64_t pos) { return sinks + pos * kvh_n * d; };
      auto sink_v = [&](int64_t pos) { return sinks + sink_side + pos * kvh_n * d; };
      auto window_k = [&](int64_t pos) { return exact + exact_row(pos); };
      auto window_v = [&](int64_t pos) { return exact + ring_side + exact_row(pos); };
      score_exact(0, ns, sink_k);  // tiered: the sinks
      // Pass 1a: quantized keys, one key group at a time (its scale folded into q).
      for (int64_t pos = ns; pos < nq;) {
        const int64_t blk = table[pos / a.block_size], off = pos % a.block_size;
        const int64_t group_end = std::min(nq, pos - off % a.key_group + a.key_group);
        const int64_t m = ((blk * (a.block_size / a.key_group) + off / a.key_group) * kvh_n + kvh) * d;
#if defined(THREEFOLD_AVX2)
        if constexpr (kFast) {
          fast::halves(a.k_scales + m, meta.data(), d);
          fast::halves(a.k_zeros + m, meta.data() + d, d);
        } else
#endif
        {
          for (int64_t i = 0; i < d; ++i) meta[i] = static_cast<float>(a.k_scales[m + i]);
          for (int64_t i = 0; i < d; ++i) meta[d + i] = static_cast<float>(a.k_zeros[m + i]);
        }
        for (int64_t g = 0; g < a.group; ++g) {
          for (int64_t i = 0; i < d; ++i) qs[g * d + i] = qf[g * d + i] * meta[i];
          qz[g] = dot<D>(qf.data() + g * d, meta.data() + d, d);
        }
        const uint8_t* codes = a.k_codes + ((blk * a.block_size + off) * kvh_n + kvh) * width;
#if defined(THREEFOLD_AVX2)
        if constexpr (kFast) {
          if (a.group <= kMaxGroup) {
            for (int64_t g = 0; g < a.group; ++g) {
              int16_t* low = kExact ? q16.data() + gd + g * d : nullptr;
              qa[g] = fast::to_int16<D>(qs.data() + g * d, q16.data() + g * d, low) * (TIERED ? 0.25f : 1.f);  // tiered: 4 x
              if constexpr (TIERED) {  // the band's - 3 / 8 per channel
                float sum = 0.f;
                for (int64_t i = 0; i < d; ++i) sum += qs[g * d + i];
                qsum[g] = 0.375f * sum;
              }
            }
            while (pos < group_end) {  // 8 keys at a time: each row's codes loaded once for the group's heads
              const int count = static_cast<int>(std::min<int64_t>(8, group_end - pos));
              __m256 part[kMaxGroup][8];
              bool in_band[8] = {};
              for (int j = 0; j < 8; ++j, codes += kvh_n * width) {
                if (j >= count) {
                  for (int64_t g = 0; g < a.group; ++g) part[g][j] = _mm256_setzero_ps();
                  continue;
                }
                fast::Codes<B, D> c(codes);
                in_band[j] = TIERED && pos + j >= nm;
                if constexpr (TIERED) {  // every code as 4 hi (+ lo in the band)
                  if (in_band[j]) {
                    c.refine(band + band_row(pos + j));
                  } else {
                    c.shift2();
                  }
                }
                for (int64_t g = 0; g < a.group; ++g) {
                  part[g][j] = _mm256_cvtepi32_ps(c.dot(q16.data() + g * d));
                  if constexpr (kExact)
                    part[g][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c.dot(q16.data() + gd + g * d)),
                                                 _mm256_set1_ps(1.f / 32768.f), part[g][j]);
                }
              }
              for (int64_t g = 0; g < a.group; ++g) {
                const __m256 sum = _mm256_fmadd_ps(threefold::reduce8(part[g]), _mm256_set1_ps(qa[g]), _mm256_set1_ps(qz[g]));
                if (!TIERED && count == 8) {
                  _mm256_storeu_ps(scores.data() + g * len + pos, sum);
                  continue;
                }
                alignas(32) float s[8];
                _mm256_store_ps(s, sum);
                for (int j = 0; j < count; ++j) scores[g * len + pos + j] = s[j] - (in_band[j] ? qsum[g] : 0.f);
              }
              pos += count;
            }
            continue;
          }
        }
#endif
        while (pos < group_end) {  // kKeys rows at a time: decoded into `rows`, scored together
          const int count = static_cast<int>(std::min<int64_t>(kKeys, group_end - pos));
          for (int j = 0; j < count; ++j, codes += kvh_n * width) {
            unpack_codes<B, D>(codes, rows[j], d);
            if (TIERED && pos + j >= nm) add_low_plane<D>(band + band_row(pos + j), rows[j], tmp.data(), d);
          }
          score_rows<D>(rows, count, qs.data(), a.group, scores.data() + pos, len, d);
          for (int64_t g = 0; g < a.group; ++g)
            for (int j = 0; j < count; ++j) scores[g * len + pos + j] += qz[g];
          pos += count;
        }
      }
      // Pass 1b: exact keys from the window.
      score_exact(nq, len, window_k);
      std::vector<float> inv_sum(a.group);  // softmax per head in fp32; 1 / sum folded into the output
      threefold::softmax_rows(scores.data(), a.group, len, inv_sum.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      add_exact(0, ns, sink_v);  // the sinks
      // Pass 2a: quantized values, each row decoded once for the Gq heads, kKeys rows at a time: as 16-bit
      // codes for values_block (the vector path), else dequantized to fp32 for accumulate_rows.
      if (fast_values) {
        std::fill(vacc.begin(), vacc.end(), 0.f);
        std::fill(zsum.begin(), zsum.end(), 0.f);
      }
      for (int64_t pos = ns; pos < nq; pos += kKeys) {
        const int count = static_cast<int>(std::min<int64_t>(kKeys, nq - pos));
        int64_t bi = pos / a.block_size, off = pos % a.block_size;  // walk the table: no division a row
        for (int j = 0; j < count; ++j) {
          const int64_t index = (table[bi] * a.block_size + off) * kvh_n + kvh;
          if (++off == a.block_size) ++bi, off = 0;
          const bool low = TIERED && pos + j >= nm;  // tiered's band: (4 hi + lo) / 4 - 3 / 8
          const Half* vs = a.v_scales + index * a.value_groups;
          const Half* vz = a.v_zeros + index * a.value_groups;
#if defined(THREEFOLD_AVX2)
          if constexpr (kFast) {
            if (fast_values) {
              fast::Codes<B, D>::unpack(a.v_codes + index * width, vcodes[j]);
              if (low) fast::Codes<B, D>::refine(vcodes[j], band + band_side + band_row(pos + j));
              for (int64_t c = 0; c < a.value_groups; ++c) {
                const float sc = _cvtsh_ss(vs[c].x);
                vscale[c * kKeys + j] = low ? 0.25f * sc : sc;
                vzero[c * kKeys + j] = _cvtsh_ss(vz[c].x) - (low ? 0.375f * sc : 0.f);
              }
              continue;
            }
          }
#endif
          float* row_j = rows[j];
          unpack_codes<B, D>(a.v_codes + index * width, row_j, d);
          if (low) add_low_plane<D>(band + band_side + band_row(pos + j), row_j, tmp.data(), d);
          for (int64_t c = 0; c < a.value_groups; ++c) {
            const float sc = static_cast<float>(vs[c]), zz = static_cast<float>(vz[c]);
            float* chunk = row_j + c * vg;
            for (int64_t i = 0; i < vg; ++i) chunk[i] = chunk[i] * sc + zz;
          }
        }
#if defined(THREEFOLD_AVX2)
        if constexpr (kFast) {
          if (fast_values) {
            fast::values_block<D, kExact>(vcodes, count, scores.data() + pos, len, vscale.data(), vzero.data(),
                                          a.group, vg, vacc.data(), zsum.data());
            continue;
          }
        }
#endif
        accumulate_rows<D>(rows, count, scores.data() + pos, a.group, len, acc.data(), d);
      }
#if defined(THREEFOLD_AVX2)
      if constexpr (kFast) {
        if (fast_values)
          for (int64_t g = 0; g < a.group; ++g)
            fast::unpermute<D>(vacc.data() + g * d, zsum.data() + g * a.value_groups, vg, acc.data() + g * d);
      }
#endif
      // Pass 2b: exact values.
      add_exact(nq, len, window_v);
      for (int64_t g = 0; g < a.group; ++g) {
        T* dst = out_ptr + r * o_row + (kvh * a.group + g) * o_head;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[g * d + i] * inv_sum[g]);
      }
    }
  });
}

template <int B, typename T, typename W, bool TIERED>
void dispatch_dim(const at::Tensor& out, const at::Tensor& q, const at::Tensor& ring, const KiviArgs& a) {
  switch (a.head_dim) {
    case 64: return kivi_run<B, 64, T, W, TIERED>(out, q, ring, a);
    case 128: return kivi_run<B, 128, T, W, TIERED>(out, q, ring, a);
    default: return kivi_run<B, 0, T, W, TIERED>(out, q, ring, a);
  }
}

template <typename T, typename W>
void dispatch_bits(const at::Tensor& out, const at::Tensor& q, const at::Tensor& ring, const KiviArgs& a) {
  if (a.band != nullptr) return dispatch_dim<2, T, W, true>(out, q, ring, a);
  if (a.bits == 2) return dispatch_dim<2, T, W, false>(out, q, ring, a);
  dispatch_dim<4, T, W, false>(out, q, ring, a);
}

bool same_long(const at::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 && t.size(0) == n;
}

}  // namespace

// out, q: [R, H, d] (float32 or bfloat16, head_dim contiguous); k/v codes, scales, zeros as
// above (contiguous); ring: [2, S, size, kvh, d] contiguous, q's dtype (or fp16 beside fp32 q);
// block_tables [R, width], quant_lens, seq_lens (>= 1), slots, bases: [R] int64.
namespace {

KiviArgs checked_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& v_codes,
                      const at::Tensor& k_scales, const at::Tensor& k_zeros, const at::Tensor& v_scales,
                      const at::Tensor& v_zeros, const at::Tensor& ring, const at::Tensor& block_tables,
                      const at::Tensor& quant_lens, const at::Tensor& seq_lens, const at::Tensor& slots,
                      const at::Tensor& bases, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [R, H, d] of one shape, head_dim contiguous");
  const bool half_ring = q.scalar_type() == at::kFloat && ring.scalar_type() == at::kHalf;
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && (q.scalar_type() == ring.scalar_type() || half_ring) &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q and out must share a dtype, float32 or bfloat16, and ring have it too (or float16 beside float32)");
  const int64_t rows = q.size(0), d = q.size(2);
  const KiviBlocks blocks = check_kivi_blocks(k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros, d);
  const int64_t kvh = k_codes.size(2), bs = k_codes.size(1);
  TORCH_CHECK(ring.dim() == 5 && ring.size(0) == 2 && ring.size(3) == kvh && ring.size(4) == d && ring.is_contiguous(),
              "ring must be contiguous [2, slots, size, kvh, d]");
  TORCH_CHECK(q.size(1) % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == rows && same_long(quant_lens, rows) && same_long(seq_lens, rows) &&
                  same_long(slots, rows) && same_long(bases, rows),
              "block_tables [R, width] and quant_lens, seq_lens, slots, bases [R] must be contiguous int64");
  const KiviArgs a{blocks, rows, q.size(1), d, bs, kvh, q.size(1) / kvh, block_tables.size(1),
                   bs / k_scales.size(1), v_scales.size(3), ring.size(1), ring.size(2),
                   block_tables.data_ptr<int64_t>(), quant_lens.data_ptr<int64_t>(),
                   seq_lens.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), bases.data_ptr<int64_t>(),
                   static_cast<float>(scale)};
  return a;
}

void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& ring, const KiviArgs& a) {
  if (q.scalar_type() == at::kBFloat16) return dispatch_bits<at::BFloat16, at::BFloat16>(out, q, ring, a);
  if (ring.scalar_type() == at::kHalf) return dispatch_bits<float, Half>(out, q, ring, a);
  dispatch_bits<float, float>(out, q, ring, a);
}

}  // namespace

void kivi_attention(at::Tensor out, at::Tensor q, at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_scales, at::Tensor k_zeros, at::Tensor v_scales, at::Tensor v_zeros, at::Tensor ring, at::Tensor block_tables, at::Tensor quant_lens, at::Tensor seq_lens, at::Tensor slots, at::Tensor bases, double scale) {
  run(out, q, ring, checked_args(out, q, k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros, ring, block_tables,
                                 quant_lens, seq_lens, slots, bases, scale));
}

// tiered_attention: kivi_attention's operands (2-bit codes) plus band: uint8 [2, BS, band_size, kvh, d / 4]
// contiguous, sinks: [2, SS, sink, kvh, d] contiguous in the ring's dtype, tier_meta: int64 [5, R]
// contiguous, rows nm, band slot, band base, ns, sinks slot (ns <= sink).
void tiered_attention(at::Tensor out, at::Tensor q, at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_scales, at::Tensor k_zeros, at::Tensor v_scales, at::Tensor v_zeros, at::Tensor ring, at::Tensor block_tables, at::Tensor quant_lens, at::Tensor seq_lens, at::Tensor slots, at::Tensor bases, at::Tensor band, at::Tensor sinks, at::Tensor tier_meta, double scale) {
  KiviArgs a = checked_args(out, q, k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros, ring, block_tables,
                            quant_lens, seq_lens, slots, bases, scale);
  const int64_t rows = q.size(0), kvh = a.num_kv_heads, d = a.head_dim;
  TORCH_CHECK(a.bits == 2, "tiered blocks hold 2-bit codes");
  TORCH_CHECK(band.scalar_type() == at::kByte && band.is_contiguous() && band.dim() == 5 && band.size(0) == 2 &&
                  band.size(2) > 0 && band.size(3) == kvh && band.size(4) * 4 == d,
              "band must be contiguous uint8 [2, slots, size, kvh, d / 4]");
  TORCH_CHECK(sinks.scalar_type() == ring.scalar_type() && sinks.is_contiguous() && sinks.dim() == 5 &&
                  sinks.size(0) == 2 && sinks.size(3) == kvh && sinks.size(4) == d,
              "sinks must be contiguous [2, slots, sink, kvh, d] in the ring's dtype");
  TORCH_CHECK(tier_meta.scalar_type() == at::kLong && tier_meta.is_contiguous() && tier_meta.dim() == 2 &&
                  tier_meta.size(0) == 5 && tier_meta.size(1) == rows,
              "tier_meta must be contiguous int64 [5, R]");
  const int64_t* meta = tier_meta.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(meta[r + rows] >= 0 && meta[r + rows] < band.size(1) && meta[r + 3 * rows] <= sinks.size(2) &&
                    (meta[r + 3 * rows] == 0 || (meta[r + 4 * rows] >= 0 && meta[r + 4 * rows] < sinks.size(1))),
                "tier_meta row ", r, " names a band or sinks slot out of range");
  }
  a.band = band.data_ptr<uint8_t>();
  a.band_slots = band.size(1);
  a.band_size = band.size(2);
  a.mid_lens = meta;
  a.band_rows = meta + rows;
  a.band_bases = meta + 2 * rows;
  a.sink_lens = meta + 3 * rows;
  a.sink_rows = meta + 4 * rows;
  a.sinks = sinks.data_ptr();
  a.sink_slots = sinks.size(1);
  a.sink = sinks.size(2);
  run(out, q, ring, a);
}
