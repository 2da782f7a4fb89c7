// threefold-exports: kv_decode_attention
//
// kv_decode_attention -- paged decode attention over a compressed KV cache (int8, fp8, int4),
// read in place: each K/V row is dequantized into a head_dim-sized fp32 buffer (L1, registers)
// right before it is used, so no dequantized copy of any context is ever built. int4 (groups of 16-64)
// with AVX2, and int8 with AVX-512 VNNI (head_dim 64 or 128), compute on their codes instead (run_codes).
//
//   out[b, h] = softmax_t(scale * q[b, h] . K^[slot(b, t), h / G]) @ V^[slot(b, t), h / G]
//   K^ = dequant(codes, scales, zeros) per row;  t in [max(0, seq_len[b] - window), seq_len[b])
//
// Layout per layer (all contiguous):
//   codes  [num_blocks, block_size, kv_heads, width]    int8 | fp8 bits | int4: byte i = q[i] | q[i + d/2] << 4
//   scales [num_blocks, block_size, kv_heads, groups]   fp32   (int8/fp8: groups = 1)
//   zeros  [num_blocks, block_size, kv_heads, groups]   fp32   (int4 only)
//
// Work item = (sequence, kv head), as in decode_attention.cpp's dense kernel: pass 1 scores, an
// fp32 softmax, pass 2 the weighted sum of V. A prefill chunk reading its context runs through
// the same kernel as q_len rows sharing one block table (row i sees context + i + 1 keys); a
// candidate tree's verify rows too, with their ancestor mask (kernel_common.h's TreeMask).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "codes_avx2.h"
#include "kernel_common.h"

namespace {

enum Kind : int64_t { kInt8 = 0, kFp8 = 1, kInt4 = 2 };

// How an fp8 code becomes a float: through the caller's 256-entry table, or from its bits. e5m2 is the
// top byte of an fp16; e4m3 (fn) is an fp16 with the byte's 7 low bits shifted in under the sign, 2^-8
// of the code's value (exponent bias 7 against fp16's 15; subnormals map to subnormals). The table is
// checked against those values once per call (its NaN entries excepted: codecs saturate, never emit NaN).
enum Fp8 : int { kFp8Lut = 0, kFp8E4m3 = 1, kFp8E5m2 = 2 };

int fp8_format(const float* lut) {
  auto matches = [&](auto&& value) {
    for (int b = 0; b < 256; ++b)
      if (!std::isnan(lut[b]) && lut[b] != value(b)) return false;
    return true;
  };
  auto half = [](int bits) { return static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits())); };
  if (matches([&](int b) { return half(((b & 0x80) << 8) | ((b & 0x7f) << 7)) * 256.f; })) return kFp8E4m3;
  if (matches([&](int b) { return half(b << 8); })) return kFp8E5m2;
  return kFp8Lut;
}

using threefold::to_float;  // kernel_common.h: bf16 widened by a shift

// One cache side (K or V): the row at (block, offset, head) decoded into `dst` [d] fp32.
struct Side {
  const uint8_t* codes;
  const float* scales;
  const float* zeros;
  int64_t width, groups;  // bytes per row, scale groups per row
  int fp8 = kFp8Lut;      // fp8 only: how a code becomes a float (fp8_format)

  template <int K, int D>
  inline void row(int64_t index, const float* lut, int64_t d, float* __restrict dst) const {
    const int64_t n = D > 0 ? D : d;
    const uint8_t* c = codes + index * width;
    const float* s = scales + index * groups;
    if constexpr (K == kInt8) {
      const float sc = s[0];
      const int8_t* ci = reinterpret_cast<const int8_t*>(c);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(ci[i]) * sc;
    } else if constexpr (K == kFp8) {
      const float sc = s[0];
#if defined(THREEFOLD_AVX2) && defined(__F16C__)
      if (fp8 != kFp8Lut && n % 16 == 0) {  // the code's bits as fp16 (F16C), 16 at a time
        const bool e4m3 = fp8 == kFp8E4m3;
        const __m256 mul = _mm256_set1_ps(e4m3 ? sc * 256.f : sc);
        const __m256i sign = _mm256_set1_epi16(static_cast<int16_t>(0x8000)), rest = _mm256_set1_epi16(0x7f << 7);
        for (int64_t i = 0; i < n; i += 16) {
          const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
          const __m256i h = e4m3 ? _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 8), sign),
                                                   _mm256_and_si256(_mm256_slli_epi16(b, 7), rest))
                                 : _mm256_slli_epi16(b, 8);
          _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), mul));
          _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), mul));
        }
        return;
      }
#endif
      for (int64_t i = 0; i < n; ++i) dst[i] = lut[c[i]] * sc;
    } else {
      // Packed by halves: two contiguous passes (vectorized), then scale and zero per group.
      const float* z = zeros + index * groups;
      const int64_t half = n / 2, group = n / groups;
      for (int64_t i = 0; i < half; ++i) dst[i] = static_cast<float>(c[i] & 15);
      for (int64_t i = 0; i < half; ++i) dst[half + i] = static_cast<float>(c[i] >> 4);
      for (int64_t g = 0; g < groups; ++g) {
        const float sc = s[g], zz = z[g];
        float* dg = dst + g * group;
        for (int64_t j = 0; j < group; ++j) dg[j] = dg[j] * sc + zz;
      }
    }
  }
};

Side side(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros) {
  return Side{reinterpret_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
              zeros.numel() ? zeros.data_ptr<float>() : nullptr, codes.size(3), scales.size(3)};
}

template <int D>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

template <int D>
inline void axpy(float a, const float* __restrict x, float* __restrict acc, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  for (int64_t i = 0; i < n; ++i) acc[i] += a * x[i];
}

// One call's queries, outputs, block tables and lengths as raw pointers.
template <typename T>
struct Io {
  const T* q;
  T* out;
  int64_t q_seq, q_head, o_seq, o_head;
  const int64_t* tables;
  const int64_t* lens;
  float fscale;

  Io(const at::Tensor& out_t, const at::Tensor& q_t, const at::Tensor& block_tables, const at::Tensor& seq_lens,
     double scale)
      : q(q_t.data_ptr<T>()), out(out_t.data_ptr<T>()), q_seq(q_t.stride(0)), q_head(q_t.stride(1)),
        o_seq(out_t.stride(0)), o_head(out_t.stride(1)), tables(block_tables.data_ptr<int64_t>()),
        lens(seq_lens.data_ptr<int64_t>()), fscale(static_cast<float>(scale)) {}
  const T* query(int64_t b, int64_t h) const { return q + b * q_seq + h * q_head; }
  T* output(int64_t b, int64_t h) const { return out + b * o_seq + h * o_head; }
};

struct Shape {
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, group, table_width;
};

#if defined(THREEFOLD_AVX2)
// int4 and int8 on their codes (codes_avx2.h). int4 rows are KIVI's 4-bit layout, with a scale and zero
// point per token and group of `vg` channels; int8 rows one signed byte a channel and one scale per token
// (vg = D, no zero point). A key's score: a sum_c s_c (q16_c . code_c) + sum_c z_c sum(q_c), q16 = q as
// int16 once per row and head (two rows for fp32 models, as the KIVI kernel does); values:
// fast::values_block.
constexpr int kMaxHeads = 16;  // query heads per kv head this path holds

template <int K, int D, typename T, int PER>  // PER: 16-channel vectors a scale group
void run_codes(const at::Tensor& out, const at::Tensor& q, const Side& ks, const Side& vs,
               const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
               const Shape& a) {
  using Codes = std::conditional_t<K == kInt4, fast::Codes<4, D>, fast::Int8Codes<D>>;
  constexpr bool kZeros = K == kInt4;
  constexpr bool kExact = std::is_same_v<T, float>;
  constexpr int K16 = D / 16;
  const Io<T> io(out, q, block_tables, seq_lens, scale);
  constexpr int groups = K16 / PER, vg = 16 * PER;
  const int64_t gd = a.group * D;

  at::parallel_for(0, a.num_seqs * a.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(gd), acc(gd), vacc(gd), qa(a.group), qsum(a.group * groups), zsum(a.group * groups),
        vscale(groups * fast::kRows), vzero(groups * fast::kRows), scores;
    std::vector<int16_t> q16(2 * gd);
    std::vector<int64_t> rows;
    __m256i vcodes[fast::kRows][K16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / a.num_kv_heads, kvh = item % a.num_kv_heads, len = io.lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - first;
      const int64_t* table = io.tables + b * a.table_width;
      rows.resize(n);
      for (int64_t t = 0, bi = first / a.block_size, off = first % a.block_size; t < n; ++t) {  // no division a row
        rows[t] = (table[bi] * a.block_size + off) * a.num_kv_heads + kvh;
        if (++off == a.block_size) ++bi, off = 0;
      }
      for (int64_t g = 0; g < a.group; ++g) {
        const T* src = io.query(b, kvh * a.group + g);
        float* qg = qf.data() + g * D;
        for (int64_t i = 0; i < D; ++i) qg[i] = to_float(src[i]) * io.fscale;
        qa[g] = fast::to_int16<D>(qg, q16.data() + g * D, kExact ? q16.data() + gd + g * D : nullptr);
        for (int64_t c = 0; c < groups; ++c) {
          float sum = 0.f;
          for (int64_t i = c * vg; i < (c + 1) * vg; ++i) sum += qg[i];
          qsum[g * groups + c] = sum;
        }
      }
      scores.resize(a.group * n);
      for (int64_t t0 = 0; t0 < n; t0 += 8) {  // keys, 8 at a time: per head, 8 dots (groups scaled in lanes) reduced together
        const int count = static_cast<int>(std::min<int64_t>(8, n - t0));
        __m256 part[kMaxHeads][8];  // per head and key: sum_c s_c (q16_c . code_c) in 8 lanes
        alignas(32) float zz[groups][8] = {};  // the 8 keys' zero points
        for (int j = 0; j < count; ++j) {
          const int64_t index = rows[t0 + j];
          const Codes c(ks.codes + index * ks.width);
          __m256 sc[groups];
          for (int cg = 0; cg < groups; ++cg) {
            sc[cg] = _mm256_set1_ps(ks.scales[index * groups + cg]);
            if constexpr (kZeros) zz[cg][j] = ks.zeros[index * groups + cg];
          }
          for (int64_t g = 0; g < a.group; ++g) {
            __m256 sum = _mm256_setzero_ps();
            for (int cg = 0; cg < groups; ++cg) {
              __m256 dot = _mm256_cvtepi32_ps(c.dot(q16.data() + g * D, cg * PER, (cg + 1) * PER));
              if constexpr (kExact)
                dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c.dot(q16.data() + gd + g * D, cg * PER, (cg + 1) * PER)),
                                      _mm256_set1_ps(1.f / 32768.f), dot);
              sum = _mm256_fmadd_ps(dot, sc[cg], sum);
            }
            part[g][j] = sum;
          }
        }
        for (int64_t g = 0; g < a.group; ++g) {
          for (int j = count; j < 8; ++j) part[g][j] = _mm256_setzero_ps();
          const __m256 dots = threefold::reduce8(part[g]);
          __m256 zeros = _mm256_setzero_ps();
          for (int cg = 0; cg < groups; ++cg)
            zeros = _mm256_fmadd_ps(_mm256_load_ps(zz[cg]), _mm256_set1_ps(qsum[g * groups + cg]), zeros);
          alignas(32) float s[8];
          _mm256_store_ps(s, _mm256_fmadd_ps(dots, _mm256_set1_ps(qa[g]), zeros));
          std::copy(s, s + count, scores.data() + g * n + t0);
        }
      }
      std::vector<float> inv_sum(a.group);  // softmax per head in fp32; 1 / sum folded into the output
      threefold::softmax_rows(scores.data(), a.group, n, inv_sum.data());
      std::fill(vacc.begin(), vacc.end(), 0.f);
      std::fill(zsum.begin(), zsum.end(), 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += fast::kRows) {  // values, kRows at a time
        const int count = static_cast<int>(std::min<int64_t>(fast::kRows, n - t0));
        for (int j = 0; j < count; ++j) {
          const int64_t index = rows[t0 + j];
          Codes::unpack(vs.codes + index * vs.width, vcodes[j]);
          for (int cg = 0; cg < groups; ++cg) {
            vscale[cg * fast::kRows + j] = vs.scales[index * groups + cg];
            vzero[cg * fast::kRows + j] = kZeros ? vs.zeros[index * groups + cg] : 0.f;
          }
        }
        fast::values_block<D, kExact>(vcodes, count, scores.data() + t0, n, vscale.data(), vzero.data(), a.group,
                                      vg, vacc.data(), zsum.data());
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < a.group; ++g) {
        fast::unpermute<D>(vacc.data() + g * D, zsum.data() + g * groups, vg, acc.data() + g * D);
        T* dst = io.output(b, kvh * a.group + g);
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[g * D + i] * inv_sum[g]);
      }
    }
  });
}
#endif

template <int K, int D, typename T>
void run(const at::Tensor& out, const at::Tensor& q, const Side& ks, const Side& vs, const float* lut,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
         const Shape& a, const threefold::TreeMask& mask) {
#if defined(THREEFOLD_AVX2)
  if constexpr (K == kInt4 && fast::kCodes<4, D>) {
    if (!mask.active() && a.group <= kMaxHeads) {
      switch (D / ks.groups) {  // the group in channels
        case 16: return run_codes<K, D, T, 1>(out, q, ks, vs, block_tables, seq_lens, scale, window, a);
        case 32: return run_codes<K, D, T, 2>(out, q, ks, vs, block_tables, seq_lens, scale, window, a);
        case 64: return run_codes<K, D, T, 4>(out, q, ks, vs, block_tables, seq_lens, scale, window, a);
        default: break;  // other groups: the loop below
      }
    }
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // int8 on its codes where vpdpwssd exists (2-2.5x its fp32 rows at 4k, 1-4x at 16k); with AVX2's
  // vpmaddwd + add it gained at 4k but lost 1.3x at 16k (run as avx2), so AVX2 keeps the rows below.
  if constexpr (K == kInt8 && (D == 64 || D == 128)) {
    if (!mask.active() && a.group <= kMaxHeads)
      return run_codes<K, D, T, D / 16>(out, q, ks, vs, block_tables, seq_lens, scale, window, a);
  }
#endif
#endif
  const Io<T> io(out, q, block_tables, seq_lens, scale);
  const int64_t num_items = a.num_seqs * a.num_kv_heads;

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(a.group * a.head_dim), acc(a.group * a.head_dim), row(a.head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / a.num_kv_heads, kvh = item % a.num_kv_heads;
      const int64_t len = io.lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = io.tables + b * a.table_width;
      const int64_t tree_start = mask.start(b, len);  // keys from here on: the tree mask decides
      auto hidden = [&](int64_t t) { return t + first >= tree_start && !mask.visible(b, tree_start, t + first); };
      for (int64_t g = 0; g < a.group; ++g) {
        const T* src = io.query(b, kvh * a.group + g);
        for (int64_t i = 0; i < a.head_dim; ++i) qf[g * a.head_dim + i] = to_float(src[i]) * io.fscale;
      }
      // body(t, row index) for keys t = 0..n-1 (positions first..len-1), one table walk.
      auto for_each_row = [&](auto&& body) {
        for (int64_t pos = first; pos < len;) {
          const int64_t blk = pos / a.block_size;
          const int64_t end_in_block = std::min(a.block_size, len - blk * a.block_size);
          const int64_t base = (table[blk] * a.block_size) * a.num_kv_heads + kvh;
          for (int64_t off = pos - blk * a.block_size; off < end_in_block; ++off, ++pos) {
            body(pos - first, base + off * a.num_kv_heads);
          }
        }
      };
      scores.assign(a.group * n, 0.f);
      for_each_row([&](int64_t t, int64_t index) {
        if (hidden(t)) {
          for (int64_t g = 0; g < a.group; ++g) scores[g * n + t] = threefold::kHiddenScore;
          return;
        }
        ks.row<K, D>(index, lut, a.head_dim, row.data());
        for (int64_t g = 0; g < a.group; ++g) scores[g * n + t] = dot<D>(qf.data() + g * a.head_dim, row.data(), a.head_dim);
      });
      std::vector<float> inv_sum(a.group);  // softmax per head in fp32; 1 / sum folded into the output
      threefold::softmax_rows(scores.data(), a.group, n, inv_sum.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row([&](int64_t t, int64_t index) {
        if (hidden(t)) return;
        vs.row<K, D>(index, lut, a.head_dim, row.data());
        for (int64_t g = 0; g < a.group; ++g) axpy<D>(scores[g * n + t], row.data(), acc.data() + g * a.head_dim, a.head_dim);
      });
      for (int64_t g = 0; g < a.group; ++g) {
        T* dst = io.output(b, kvh * a.group + g);
        for (int64_t i = 0; i < a.head_dim; ++i) dst[i] = static_cast<T>(acc[g * a.head_dim + i] * inv_sum[g]);
      }
    }
  });
}

template <int K, typename T>
void dispatch_dim(const at::Tensor& out, const at::Tensor& q, const Side& ks, const Side& vs, const float* lut,
                  const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window, const Shape& a,
                  const threefold::TreeMask& mask) {
  switch (a.head_dim) {
    case 64: return run<K, 64, T>(out, q, ks, vs, lut, tables, lens, scale, window, a, mask);
    case 128: return run<K, 128, T>(out, q, ks, vs, lut, tables, lens, scale, window, a, mask);
    default: return run<K, 0, T>(out, q, ks, vs, lut, tables, lens, scale, window, a, mask);
  }
}

template <typename T>
void dispatch_kind(int64_t kind, const at::Tensor& out, const at::Tensor& q, const Side& ks, const Side& vs,
                   const float* lut, const at::Tensor& tables, const at::Tensor& lens, double scale,
                   int64_t window, const Shape& a, const threefold::TreeMask& mask) {
  if (kind == kInt8) return dispatch_dim<kInt8, T>(out, q, ks, vs, lut, tables, lens, scale, window, a, mask);
  if (kind == kFp8) return dispatch_dim<kFp8, T>(out, q, ks, vs, lut, tables, lens, scale, window, a, mask);
  return dispatch_dim<kInt4, T>(out, q, ks, vs, lut, tables, lens, scale, window, a, mask);
}

}  // namespace

// out, q: [B, H, d] (float32 or bfloat16, head_dim contiguous); codes/scales/zeros as above
// (zeros: empty unless int4; lut: 256 fp32 for fp8, else empty); block_tables [B, width] int64;
// seq_lens [B] int64 >= 1; window <= 0: no sliding window; kind: 0 int8, 1 fp8, 2 int4;
// tree_starts [B], tree_bits [B, words] int64: a candidate tree's ancestor mask (empty: none).
void kv_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_scales, at::Tensor v_scales, at::Tensor k_zeros, at::Tensor v_zeros, at::Tensor lut, at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window, int64_t kind, at::Tensor tree_starts, at::Tensor tree_bits) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [B, H, d] of one shape, head_dim contiguous");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q and out must share a dtype, float32 or bfloat16");
  TORCH_CHECK(kind == kInt8 || kind == kFp8 || kind == kInt4, "kind must be 0 (int8), 1 (fp8) or 2 (int4)");
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.sizes() == v_codes.sizes() && k_codes.is_contiguous() &&
                  v_codes.is_contiguous() && k_codes.element_size() == 1,
              "codes must be contiguous one-byte [N, bs, kvh, width]");
  TORCH_CHECK(k_scales.dim() == 4 && k_scales.sizes() == v_scales.sizes() && k_scales.is_contiguous() &&
                  v_scales.is_contiguous() && k_scales.scalar_type() == at::kFloat,
              "scales must be contiguous float32 [N, bs, kvh, groups]");
  TORCH_CHECK(kind != kInt4 || (k_zeros.sizes() == k_scales.sizes() && v_zeros.sizes() == k_scales.sizes() &&
                                k_zeros.is_contiguous() && v_zeros.is_contiguous()),
              "int4 needs zeros shaped like scales");
  TORCH_CHECK(kind != kFp8 || (lut.numel() == 256 && lut.scalar_type() == at::kFloat), "fp8 needs a 256-entry lut");
  const int64_t d = q.size(2);
  const int64_t width = kind == kInt4 ? d / 2 : d;
  TORCH_CHECK(k_codes.size(3) == width && d % k_scales.size(3) == 0, "codes/scales do not match head_dim");
  TORCH_CHECK(q.size(1) % k_codes.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() && block_tables.size(0) == q.size(0),
              "block_tables [B, width] and seq_lens [B] must be contiguous int64");
  const Shape a{q.size(0), q.size(1), d, k_codes.size(1), k_codes.size(2), q.size(1) / k_codes.size(2),
                block_tables.size(1)};
  Side ks = side(k_codes, k_scales, k_zeros), vs = side(v_codes, v_scales, v_zeros);
  const float* table = kind == kFp8 ? lut.data_ptr<float>() : nullptr;
  if (kind == kFp8) ks.fp8 = vs.fp8 = fp8_format(table);
  const threefold::TreeMask mask(tree_starts, tree_bits, seq_lens);
  if (q.scalar_type() == at::kBFloat16)
    return dispatch_kind<at::BFloat16>(kind, out, q, ks, vs, table, block_tables, seq_lens, scale, window, a, mask);
  dispatch_kind<float>(kind, out, q, ks, vs, table, block_tables, seq_lens, scale, window, a, mask);
}
