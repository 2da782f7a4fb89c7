// Attention on quantized codes with AVX2 (+ AVX-512 VNNI where the build has it): the pieces the
// KIVI kernel (kivi_attention.cpp) and the int4 kernel (kv_attention.cpp) share. Rows are packed as
// codes of B bits, W = D B / 8 bytes a row: byte i of 16-byte chunk c holds (at bits j B) the code of
// channel j W + 16 c + i (kv/codecs/kivi.py; int4's halves, kv/codecs/scaled.py, are the case B = 4).
#pragma once

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(THREEFOLD_AVX2)
// The vector path (head_dim 64 or 128 and rows of whole 16-byte chunks): computes on the codes.
//   Keys:   q . k^ = qs . code + qz with qs = q * s held as int16, qs ~ a * q16 (a = max |qs| / 32766:
//           an error of 2^-16 of the largest term, far below bf16's 2^-9), so a key's score is one
//           integer dot product, a (q16 . code) + qz: vpdpwssd (AVX-512 VNNI) or vpmaddwd (AVX2).
//   Values: the same on pairs of rows (values_block): each row's scale folded into its probability,
//           p s, held as int16; its zero point into one sum per head and channel group, sum p z.
namespace fast {

constexpr int kRows = 16;  // value rows per values_block

template <int B, int D>
constexpr bool kCodes = (D == 64 || D == 128) && (D * B / 8) % 16 == 0;

// acc + the sums of adjacent 16-bit products, a[2i] b[2i] + a[2i + 1] b[2i + 1], in 32-bit lanes.
inline __m256i dot_pairs(__m256i acc, __m256i codes, __m256i weights) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, codes, weights);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(codes, weights));
#endif
}

// A row's codes as 16-bit lanes in channel order: v[k] holds channels 16 k .. 16 k + 15. Byte i of
// 16-byte chunk c holds (at bits j B) channel j W + 16 c + i, and j (W / 16) + c = k: chunks and parts
// interleave into channel order with no shuffle.
template <int B, int D>
struct Codes {
  static constexpr int W = D * B / 8, P = 8 / B, C = W / 16;
  __m256i v[D / 16];

  explicit Codes(const uint8_t* row) { unpack(row, v); }
  // Into `out` [D / 16] directly: a copy of `v` (two 256-bit stores read back as one 512-bit load) stalls.
  static void unpack(const uint8_t* row, __m256i* out) {
    const __m256i mask = _mm256_set1_epi16((1 << B) - 1);
    for (int c = 0; c < C; ++c) {
      const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
      for (int j = 0; j < P; ++j) out[j * C + c] = _mm256_and_si256(_mm256_srli_epi16(words, j * B), mask);
    }
  }
  // tiered's band: 4 hi + lo, a 4-bit code (its row reads (4 hi + lo) / 4 - 3 / 8).
  static void refine(__m256i* v, const uint8_t* low) {
    const Codes<2, D> lo(low);
    for (int k = 0; k < D / 16; ++k) v[k] = _mm256_add_epi16(_mm256_slli_epi16(v[k], 2), lo.v[k]);
  }
  void refine(const uint8_t* low) { refine(v, low); }
  void shift2() {
    for (int k = 0; k < D / 16; ++k) v[k] = _mm256_slli_epi16(v[k], 2);
  }
  // 8 int32 lanes summing to q16 . codes over channels [16 from, 16 to).
  __m256i dot(const int16_t* q16, int from = 0, int to = D / 16) const {
    __m256i acc = _mm256_setzero_si256();
    for (int k = from; k < to; ++k)
      acc = dot_pairs(acc, v[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + 16 * k)));
    return acc;
  }
};

// int8 rows (kv/codecs/scaled.py: one signed byte a channel, in channel order) as 16-bit lanes, with
// Codes' interface: |code| <= 128 against |q16| <= 32767 keeps every int32 lane far from overflow.
template <int D>
struct Int8Codes {
  __m256i v[D / 16];

  explicit Int8Codes(const uint8_t* row) { unpack(row, v); }
  static void unpack(const uint8_t* row, __m256i* out) {
    for (int k = 0; k < D / 16; ++k)
      out[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * k)));
  }
  __m256i dot(const int16_t* q16, int from = 0, int to = D / 16) const {
    __m256i acc = _mm256_setzero_si256();
    for (int k = from; k < to; ++k)
      acc = dot_pairs(acc, v[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + 16 * k)));
    return acc;
  }
};

// qs = q * s (fp32, one head) -> q16 and a, with qs ~ a * q16; with `low` (fp32 models), also the
// rounding error in a second int16 row, qs ~ a * (q16 + low / 32768): an error of 2^-31, fp32's.
template <int D>
inline float to_int16(const float* qs, int16_t* q16, int16_t* low) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < D; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(qs + i)));
  const float top = threefold::hmax8(mx);
  const float a = top > 0.f ? top / 32766.f : 1.f;  // headroom: |q16| <= 32767 after rounding
  const __m256 inv = _mm256_set1_ps(1.f / a), unit = _mm256_set1_ps(32768.f);
  for (int i = 0; i < D; i += 16) {  // round to nearest, pack to int16 (packs interleaves lanes: permute back)
    __m256 x[2], rest[2];
    __m256i n[2];
    for (int h = 0; h < 2; ++h) {
      x[h] = _mm256_mul_ps(_mm256_loadu_ps(qs + i + 8 * h), inv);
      n[h] = _mm256_cvtps_epi32(x[h]);
      rest[h] = _mm256_mul_ps(_mm256_sub_ps(x[h], _mm256_cvtepi32_ps(n[h])), unit);
    }
    auto pack = [](__m256i lo, __m256i hi) {
      return _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);
    };
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + i), pack(n[0], n[1]));
    if (low != nullptr)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + i),
                          pack(_mm256_cvtps_epi32(rest[0]), _mm256_cvtps_epi32(rest[1])));
  }
  return a;
}

// n fp16 values (a multiple of 8) -> fp32 (F16C).
inline void halves(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
}

// Values on their codes, a block of up to kRows rows: out_g += sum_j p_gj (s_j code_j + z_j) for the
// group's heads g. Per head and channel group, the weights w_j = p_gj s_j go to int16 (w ~ b w16,
// b = max |w| / 32766; fp32 models add a second int16 row for the rounding error, as keys do); two
// rows' codes, interleaved 16 bits by 16 bits, meet their two weights in one vpdpwssd / vpmaddwd.
// The sums land in `vacc` in the interleave's channel order (per 16 channels: 0..3 and 8..11, then
// 4..7 and 12..15); `unpermute` puts them back. Zero points: zsum_g[c] += sum_j p_gj z_j.
//   codes [kRows][D / 16] (rows from `count` on are not read); scale, zero [groups][kRows];
//   p: head g's probabilities at p + g * p_stride.
template <int D, bool EXACT, int PER>  // PER: 16-channel vectors a channel group (vg = 16 PER)
inline void values_block_per(const __m256i (*codes)[D / 16], int count, const float* p, int64_t p_stride,
                             const float* scale, const float* zero, int64_t group, float* vacc, float* zsum) {
  constexpr int K = D / 16, groups = K / PER;
  // A 16-channel slice of every row pair is built once and kept in registers for all the heads (the
  // weights of every head first), not rebuilt head by head: 1.15x the whole kernel on AVX2, more with
  // AVX-512VL's 32 registers.
  constexpr int kHeads = 16;
  const int pairs = (count + 1) / 2;
  alignas(32) int32_t weights[kHeads][groups][EXACT ? 2 : 1][kRows / 2];  // rows 2 jp (low 16 bits), 2 jp + 1
  float bs[kHeads][groups];
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const int heads = static_cast<int>(std::min<int64_t>(kHeads, group - g0));
    for (int h = 0; h < heads; ++h) {
      const float* pg = p + (g0 + h) * p_stride;
      for (int c = 0; c < groups; ++c) {
        alignas(32) float w[kRows] = {};
        float z = 0.f;
        for (int j = 0; j < count; ++j) {
          w[j] = pg[j] * scale[c * kRows + j];
          z += pg[j] * zero[c * kRows + j];
        }
        zsum[(g0 + h) * groups + c] += z;
        alignas(32) int16_t w16[2][kRows];
        bs[h][c] = to_int16<kRows>(w, w16[0], EXACT ? w16[1] : nullptr);
        std::memcpy(weights[h][c], w16, sizeof(weights[h][c]));
      }
    }
    for (int k = 0; k < K; ++k) {
      __m256i lo[kRows / 2], hi[kRows / 2];
      for (int jp = 0; jp < pairs; ++jp) {
        const __m256i odd = 2 * jp + 1 < count ? codes[2 * jp + 1][k] : _mm256_setzero_si256();  // past count: 0
        lo[jp] = _mm256_unpacklo_epi16(codes[2 * jp][k], odd);
        hi[jp] = _mm256_unpackhi_epi16(codes[2 * jp][k], odd);
      }
      const int c = k / PER;
      for (int h = 0; h < heads; ++h) {
        __m256i s[2][EXACT ? 4 : 2];  // [even / odd pair][lo, hi (, their low rows)]: two chains each
        for (auto& half : s)
          for (auto& v : half) v = _mm256_setzero_si256();
        for (int jp = 0; jp < pairs; ++jp) {
          auto& acc = s[jp & 1];
          const __m256i wv = _mm256_set1_epi32(weights[h][c][0][jp]);
          acc[0] = dot_pairs(acc[0], lo[jp], wv);
          acc[1] = dot_pairs(acc[1], hi[jp], wv);
          if constexpr (EXACT) {
            const __m256i wl = _mm256_set1_epi32(weights[h][c][EXACT ? 1 : 0][jp]);
            acc[2] = dot_pairs(acc[2], lo[jp], wl);
            acc[3] = dot_pairs(acc[3], hi[jp], wl);
          }
        }
        const __m256 bv = _mm256_set1_ps(bs[h][c]);
        for (int half = 0; half < 2; ++half) {
          __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(s[0][half], s[1][half]));
          if constexpr (EXACT)
            f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s[0][2 + half], s[1][2 + half])),
                                _mm256_set1_ps(1.f / 32768.f), f);
          float* dst = vacc + (g0 + h) * D + 16 * k + 8 * half;
          _mm256_storeu_ps(dst, _mm256_fmadd_ps(f, bv, _mm256_loadu_ps(dst)));
        }
      }
    }
  }
}

// values_block_per for a channel group of vg channels (16, 32, 64 or 128; at most D).
template <int D, bool EXACT>
inline void values_block(const __m256i (*codes)[D / 16], int count, const float* p, int64_t p_stride,
                         const float* scale, const float* zero, int64_t group, int64_t vg, float* vacc, float* zsum) {
  switch (vg) {
    case 16: return values_block_per<D, EXACT, 1>(codes, count, p, p_stride, scale, zero, group, vacc, zsum);
    case 32: return values_block_per<D, EXACT, 2>(codes, count, p, p_stride, scale, zero, group, vacc, zsum);
    case 64: return values_block_per<D, EXACT, 4>(codes, count, p, p_stride, scale, zero, group, vacc, zsum);
    default:
      if constexpr (D == 128) return values_block_per<D, EXACT, 8>(codes, count, p, p_stride, scale, zero, group, vacc, zsum);
  }
}

// acc += one head's values_block sums (vacc, back in channel order) and its zero-point sums zsum [D / vg].
template <int D>
inline void unpermute(const float* vacc, const float* zsum, int64_t vg, float* acc) {
  for (int k = 0; k < D / 16; ++k) {
    const __m256 p0 = _mm256_loadu_ps(vacc + 16 * k), p1 = _mm256_loadu_ps(vacc + 16 * k + 8);
    const __m256 z = _mm256_set1_ps(zsum[16 * k / vg]);  // vg: a multiple of 16
    _mm256_storeu_ps(acc + 16 * k, _mm256_add_ps(_mm256_loadu_ps(acc + 16 * k),
                                                 _mm256_add_ps(_mm256_permute2f128_ps(p0, p1, 0x20), z)));
    _mm256_storeu_ps(acc + 16 * k + 8, _mm256_add_ps(_mm256_loadu_ps(acc + 16 * k + 8),
                                                     _mm256_add_ps(_mm256_permute2f128_ps(p0, p1, 0x31), z)));
  }
}
}  // namespace fast
#endif
