// Helpers shared by the kernel sources (each .cpp is its own translation unit).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

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

#ifdef THREEFOLD_AVX2
// 8 floats from 8 fp32 or 8 bf16 values (bf16: zero-extend, shift into the top half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace threefold
