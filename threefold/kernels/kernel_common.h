// Helpers shared by the kernel sources (each .cpp is its own translation unit).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// Which vector paths this build holds, from the -march it was compiled for.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define THREEFOLD_AMX 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define THREEFOLD_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define THREEFOLD_AVX2 1
#endif

namespace threefold {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// bf16 is the top half of an fp32: widen by a shift (vectorizes, unlike a call).
template <>
inline float to_float<at::BFloat16>(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// -ffast-math lets std::isnan fold to false: test the bits.
inline bool is_nan(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// Candidate-tree verify rows (speculative decoding): row b sees every key before tree_starts[b]
// and, from there on, key tree_starts[b] + j only where bit j of its words says so (the tree rows
// that are b itself or its ancestors). Empty tensors: no row is masked.
//   tree_starts [B] int64;  tree_bits [B, words] int64 (bit j: word j / 64, bit j % 64)
struct TreeMask {
  const int64_t* starts = nullptr;
  const int64_t* bits = nullptr;
  int64_t words = 0;

  TreeMask() = default;
  TreeMask(const at::Tensor& tree_starts, const at::Tensor& tree_bits, const at::Tensor& seq_lens) {
    if (tree_starts.numel() == 0) return;
    TORCH_CHECK(tree_starts.scalar_type() == at::kLong && tree_bits.scalar_type() == at::kLong &&
                    tree_starts.is_contiguous() && tree_bits.is_contiguous() && tree_bits.dim() == 2 &&
                    tree_starts.size(0) == seq_lens.size(0) && tree_bits.size(0) == seq_lens.size(0),
                "tree_starts [B] and tree_bits [B, words] must be contiguous int64, one row per query");
    starts = tree_starts.data_ptr<int64_t>();
    bits = tree_bits.data_ptr<int64_t>();
    words = tree_bits.size(1);
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < seq_lens.size(0); ++b) {
      TORCH_CHECK(starts[b] >= 0 && lens[b] - starts[b] <= 64 * words,
                  "a tree row's keys past tree_starts must fit its tree_bits");
    }
  }

  bool active() const { return starts != nullptr; }
  // The first key of row b that the bits decide (past its keys where no mask is given).
  int64_t start(int64_t b, int64_t len) const { return starts != nullptr ? starts[b] : len; }
  bool visible(int64_t b, int64_t start, int64_t pos) const {
    const int64_t j = pos - start;
    return (static_cast<uint64_t>(bits[b * words + (j >> 6)]) >> (j & 63)) & 1u;
  }
};

// Each of `rows` rows of n scores (row r at scores + r n) -> exp(s - the row's max), in place, and
// inv_sum[r] = 1 / the row's sum: an fp32 softmax whose normalization the caller folds into its output.
inline void softmax_rows(float* scores, int64_t rows, int64_t n, float* inv_sum) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - mx);  // vectorized (libmvec)
    for (int64_t t = 0; t < n; ++t) sum += s[t];
    inv_sum[r] = 1.f / sum;
  }
}

// The score a hidden key gets before the softmax: exp() of it underflows to 0 (finite, as
// -ffast-math assumes; the row itself is always visible, so the maximum is a real score).
constexpr float kHiddenScore = -1e30f;

#ifdef THREEFOLD_AVX2
// 8 floats from 8 fp32, bf16 or int8 values (bf16: zero-extend, shift into the top half; int8:
// sign-extend, convert).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// v[j] -> sum of v[j]'s lanes, for j < 8, as one vector.
inline __m256 reduce8(const __m256 (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace threefold
