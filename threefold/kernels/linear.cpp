// threefold-exports: linear_small linear_small_int8 argmax_rows build_isa
//
// linear_small -- out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) for the few-row case (decode at
// small batch): a streaming pass over W, which is what bounds it. Dtypes (x, w, out/bias):
// (fp32, fp32, fp32), (bf16, bf16, bf16) and (fp32, bf16, fp32): weights stored in bf16 and
// widened to fp32 in registers (half the bytes to stream; the arithmetic is fp32 FMA, for CPUs
// with no bf16 dot product). Paths: AVX-512 (same-dtype pairs, as before) and AVX2+FMA.
//
// linear_small_int8 -- the same with int8 weights and one fp32 scale per output row:
// out[m, n] = scale[n] (x[m] . w[n]) (+ bias[n]), x and out fp32 or bf16 (the AVX2 path: a
// quarter of fp32's bytes to stream, half of bf16's; model/llama.py's Linear.store_int8).
//
// argmax_rows -- row-wise argmax of logits, torch.argmax's semantics (first index of the
// maximum; a NaN wins).

#include "kernel_common.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

using threefold::to_float;

#ifdef THREEFOLD_AVX512
namespace avx512 {

constexpr int kNR = 4;  // weight rows per tile: 4 streams, like the AVX2 path (16 streams read slower: 20.5 vs 23.8 GB/s)
constexpr int kMR = 2;  // rows of x per tile

// acc[m][n] += x[m] . w[n] over one 64-byte column chunk (bf16: dpbf16 on pairs where the CPU has it).
template <typename T, int MR>
inline void chunk(const T* const (&w)[kNR], int64_t k, int64_t left, const T* x, int64_t x_stride,
                  __m512 (&acc)[kMR][kNR]) {
  if constexpr (std::is_same_v<T, float>) {
    const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    __m512 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * x_stride + k);
    for (int n = 0; n < kNR; ++n) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w[n] + k);
      for (int m = 0; m < MR; ++m) acc[m][n] = _mm512_fmadd_ps(wv, xv[m], acc[m][n]);
    }
  } else {
    const __mmask32 mask = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1ull << left) - 1);
    __m512i xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
    for (int n = 0; n < kNR; ++n) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w[n] + k);
      for (int m = 0; m < MR; ++m) {
#ifdef __AVX512BF16__
        acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)wv, (__m512bh)xv[m]);
#else  // widen each half: bf16 is the top 16 bits of an fp32
        const auto widen = [](__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); };
        const __m512 wl = widen(_mm512_castsi512_si256(wv)), wh = widen(_mm512_extracti64x4_epi64(wv, 1));
        const __m512 xl = widen(_mm512_castsi512_si256(xv[m])), xh = widen(_mm512_extracti64x4_epi64(xv[m], 1));
        acc[m][n] = _mm512_fmadd_ps(wh, xh, _mm512_fmadd_ps(wl, xl, acc[m][n]));
#endif
      }
    }
  }
}

// res[m][n] = x[m] . w[n] for MR rows of x against kNR weight rows, prefetching the next tile's
// weights (contiguous: `ahead`) at the rate this one reads its own.
template <typename T, int MR>
inline void tile(const T* const (&w)[kNR], int64_t k_dim, const T* x, int64_t x_stride, float (&res)[kMR][kNR],
                 const char* ahead) {
  __m512 acc[kMR][kNR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kNR; ++n) acc[m][n] = _mm512_setzero_ps();
  constexpr int64_t kStep = 64 / sizeof(T);            // elements per 64-byte load
  constexpr int64_t kStepBytes = kNR * 64;              // weight bytes one step reads
  for (int64_t k = 0; k < k_dim; k += kStep) {
    if (ahead != nullptr)
      for (int64_t b = 0; b < kStepBytes; b += 64) _mm_prefetch(ahead + k / kStep * kStepBytes + b, _MM_HINT_T0);
    chunk<T, MR>(w, k, k_dim - k, x, x_stride, acc);
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kNR; ++n) res[m][n] = _mm512_reduce_add_ps(acc[m][n]);
}

template <typename T>
void linear_small_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const T* bias) {
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), o_stride = out.stride(0);
  const int64_t num_blocks = (n_dim + kNR - 1) / kNR;
  constexpr int64_t kAhead = 1;
  at::parallel_for(0, num_blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kNR, rows = std::min<int64_t>(kNR, n_dim - n0);
      const T* wr[kNR];
      for (int n = 0; n < kNR; ++n) wr[n] = wp + std::min(n0 + n, n_dim - 1) * k_dim;  // a short block repeats its last row
      const char* ahead = nb + kAhead < end ? reinterpret_cast<const char*>(wp + (n0 + kAhead * kNR) * k_dim) : nullptr;
      for (int64_t m0 = 0; m0 < m_dim; m0 += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, m_dim - m0));
        float res[kMR][kNR];
        const char* pre = m0 == 0 ? ahead : nullptr;
        if (mr == kMR)
          tile<T, kMR>(wr, k_dim, xp + m0 * x_stride, x_stride, res, pre);
        else
          tile<T, 1>(wr, k_dim, xp + m0 * x_stride, x_stride, res, pre);
        for (int m = 0; m < mr; ++m)
          for (int64_t n = 0; n < rows; ++n)
            op[(m0 + m) * o_stride + n0 + n] =
                static_cast<T>(res[m][n] + (bias != nullptr ? to_float(bias[n0 + n]) : 0.f));
      }
    }
  });
}

}  // namespace avx512
#endif  // THREEFOLD_AVX512

#ifdef THREEFOLD_AVX2
namespace avx2 {

constexpr int kNR = 4;  // weight rows per tile
constexpr int kMR = 3;  // rows of x per tile: kNR * kMR accumulators + kMR x vectors + 1 w in 16 registers
constexpr int64_t kAhead = 1;  // the weight block prefetched while one is read (1 beat 2 and 4, measured)

// res[m][n] = x[m] . w[n] for kMR >= MR rows of x (x_stride apart) against kNR weight rows:
// each 8-wide chunk of a weight row is loaded (and widened) once for all MR rows.
template <int MR, typename W>
inline void tile(const W* const (&w)[kNR], int64_t k_dim, const float* __restrict x, int64_t x_stride,
                 float (&res)[kMR][kNR], const char* ahead) {
  __m256 acc[MR][kNR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kNR; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t k8 = k_dim & ~int64_t{7};
  constexpr int64_t kStepBytes = kNR * 8 * sizeof(W);  // weight bytes one k step reads: as many of the next block's are fetched
  for (int64_t k = 0; k < k8; k += 8) {
    if (ahead != nullptr)
      for (int64_t b = 0; b < kStepBytes; b += 64) _mm_prefetch(ahead + k / 8 * kStepBytes + b, _MM_HINT_T0);
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * x_stride + k);
    for (int n = 0; n < kNR; ++n) {
      const __m256 wv = threefold::load8(w[n] + k);
      for (int m = 0; m < MR; ++m) acc[m][n] = _mm256_fmadd_ps(wv, xv[m], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kNR; ++n) {
      float sum = threefold::hsum8(acc[m][n]);
      for (int64_t k = k8; k < k_dim; ++k) sum += to_float(w[n][k]) * x[m * x_stride + k];
      res[m][n] = sum;
    }
}

// tile<rows> for rows in [1, MR].
template <int MR, typename W>
inline void tile_rows(int rows, const W* const (&w)[kNR], int64_t k_dim, const float* x, int64_t x_stride,
                      float (&res)[kMR][kNR], const char* ahead) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile_rows<MR - 1>(rows, w, k_dim, x, x_stride, res, ahead);
  }
  tile<MR>(w, k_dim, x, x_stride, res, ahead);
}

// x: fp32 rows x_stride apart; w: [N, K] contiguous; out rows o_stride apart; bias [N] or null;
// scale [N] (int8 weights) or null. Threads split N into blocks of kNR weight rows; a block stays
// in L1 while all of x passes it.
template <typename W, typename O>
void linear(const float* x, int64_t x_stride, int64_t m_dim, const W* w, int64_t n_dim, int64_t k_dim,
            const O* bias, O* out, int64_t o_stride, const float* scale = nullptr) {
  const int64_t num_blocks = (n_dim + kNR - 1) / kNR;
  at::parallel_for(0, num_blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kNR, rows = std::min<int64_t>(kNR, n_dim - n0);
      const W* wr[kNR];
      for (int n = 0; n < kNR; ++n) wr[n] = w + std::min(n0 + n, n_dim - 1) * k_dim;  // a short block repeats its last row
      // The first pass over a block prefetches the block kAhead on (contiguous rows): the few rows of
      // a block are too short a stream for the hardware prefetcher: SmolLM2's layers at one row streamed
      // bf16 at 8.5 GB/s without, 17 GB/s with (1 thread, CPU time, AMD EPYC run as avx2).
      const char* ahead = nb + kAhead < end ? reinterpret_cast<const char*>(w + (n0 + kAhead * kNR) * k_dim) : nullptr;
      for (int64_t m0 = 0; m0 < m_dim; m0 += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, m_dim - m0));
        float res[kMR][kNR];
        tile_rows<kMR>(mr, wr, k_dim, x + m0 * x_stride, x_stride, res, m0 == 0 ? ahead : nullptr);
        for (int m = 0; m < mr; ++m)
          for (int64_t n = 0; n < rows; ++n)
            out[(m0 + m) * o_stride + n0 + n] = static_cast<O>(res[m][n] * (scale ? scale[n0 + n] : 1.f) +
                                                               (bias ? to_float(bias[n0 + n]) : 0.f));
      }
    }
  });
}

// x as fp32 rows: x itself, or widened from bf16 into `widened` (rows k_dim apart, *x_stride set).
const float* fp32_rows(const at::Tensor& x, std::vector<float>& widened, int64_t* x_stride) {
  *x_stride = x.stride(0);
  if (x.scalar_type() != at::kBFloat16) return x.data_ptr<float>();
  const int64_t m_dim = x.size(0), k_dim = x.size(1);
  widened.resize(m_dim * k_dim);
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < m_dim; ++m)
    for (int64_t k = 0; k < k_dim; ++k) widened[m * k_dim + k] = to_float(src[m * *x_stride + k]);
  *x_stride = k_dim;
  return widened.data();
}

// The AVX2 path for every supported dtype combination; x is widened to fp32 first if bf16.
void linear_any(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = w.size(0);
  std::vector<float> widened;
  int64_t x_stride = 0;
  const float* xf = fp32_rows(x, widened, &x_stride);
  const int64_t o_stride = out.stride(0);
  if (out.scalar_type() == at::kBFloat16) {  // (bf16, bf16, bf16)
    linear(xf, x_stride, m_dim, w.data_ptr<at::BFloat16>(), n_dim, k_dim,
           bias ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(), o_stride);
  } else if (w.scalar_type() == at::kBFloat16) {  // (fp32, bf16, fp32)
    linear(xf, x_stride, m_dim, w.data_ptr<at::BFloat16>(), n_dim, k_dim, bias ? bias->data_ptr<float>() : nullptr,
           out.data_ptr<float>(), o_stride);
  } else {  // (fp32, fp32, fp32)
    linear(xf, x_stride, m_dim, w.data_ptr<float>(), n_dim, k_dim, bias ? bias->data_ptr<float>() : nullptr,
           out.data_ptr<float>(), o_stride);
  }
}

// int8 weights with per-row scales: x and out (and bias) both fp32 or both bf16.
void linear_int8(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                 const c10::optional<at::Tensor>& bias) {
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = w.size(0), o_stride = out.stride(0);
  std::vector<float> widened;
  int64_t x_stride = 0;
  const float* xf = fp32_rows(x, widened, &x_stride);
  const int8_t* wq = w.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  if (out.scalar_type() == at::kBFloat16)
    linear(xf, x_stride, m_dim, wq, n_dim, k_dim, bias ? bias->data_ptr<at::BFloat16>() : nullptr,
           out.data_ptr<at::BFloat16>(), o_stride, s);
  else
    linear(xf, x_stride, m_dim, wq, n_dim, k_dim, bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(),
           o_stride, s);
}

}  // namespace avx2
#endif  // THREEFOLD_AVX2

namespace {

// What both few-row kernels need: x [M, K] @ w [N, K]^T into out [M, N], rows with unit stride, w
// contiguous, everything on the CPU, and a bias [N] (if any) contiguous in out's dtype.
bool shapes_fit(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  if (x.dim() != 2 || w.dim() != 2 || out.dim() != 2 || x.size(1) != w.size(1) || out.size(0) != x.size(0) ||
      out.size(1) != w.size(0) || x.stride(1) != 1 || out.stride(1) != 1 || !w.is_contiguous() || x.size(1) == 0)
    return false;
  if (out.device().type() != at::kCPU || x.device().type() != at::kCPU || w.device().type() != at::kCPU)
    return false;
  return !bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == out.scalar_type() &&
                               bias->numel() == w.size(0) && bias->device().type() == at::kCPU);
}

// The dtype combinations linear_small takes.
bool linear_fits(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const auto xt = x.scalar_type(), wt = w.scalar_type(), ot = out.scalar_type();
  const bool ok = (xt == at::kFloat && ot == at::kFloat && (wt == at::kFloat || wt == at::kBFloat16)) ||
                  (xt == at::kBFloat16 && wt == at::kBFloat16 && ot == at::kBFloat16);
  return ok && shapes_fit(out, x, w, bias);
}

// linear_small_int8's inputs: int8 weights, fp32 scales [N] on the CPU, x and out of one dtype.
bool int8_fits(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
               const c10::optional<at::Tensor>& bias) {
  const auto xt = x.scalar_type();
  return w.scalar_type() == at::kChar && (xt == at::kFloat || xt == at::kBFloat16) && out.scalar_type() == xt &&
         scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 &&
         scale.device().type() == at::kCPU && shapes_fit(out, x, w, bias) && scale.numel() == w.size(0);
}

}  // namespace

// Returns false (nothing written) where this build has no vector path (x86-64-v2) or the
// inputs don't fit; the caller then falls back to torch's linear.
bool linear_small(at::Tensor out, at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  if (!linear_fits(out, x, w, bias)) return false;
#ifdef THREEFOLD_AVX512
  if (x.scalar_type() == w.scalar_type()) {  // tiles of 4 weight rows x 64 bytes a step; dpbf16 where the CPU has it
    if (w.scalar_type() == at::kBFloat16)
      avx512::linear_small_impl<at::BFloat16>(out, x, w, bias ? bias->data_ptr<at::BFloat16>() : nullptr);
    else
      avx512::linear_small_impl<float>(out, x, w, bias ? bias->data_ptr<float>() : nullptr);
    return true;
  }
#endif
#ifdef THREEFOLD_AVX2
  avx2::linear_any(out, x, w, bias);
  return true;
#else
  return false;
#endif
}

// Returns false (nothing written) where this build has no AVX2 path or the inputs don't fit.
bool linear_small_int8(at::Tensor out, at::Tensor x, at::Tensor w, at::Tensor scale, c10::optional<at::Tensor> bias) {
  if (!int8_fits(out, x, w, scale, bias)) return false;
#ifdef THREEFOLD_AVX2
  avx2::linear_int8(out, x, w, scale, bias);
  return true;
#else
  return false;
#endif
}

// The vector paths this build holds: "amx", "avx512", "avx2" or "generic" (plain C++).
std::string build_isa() {
#if defined(THREEFOLD_AMX)
  return "amx";
#elif defined(THREEFOLD_AVX512)
  return "avx512";
#elif defined(THREEFOLD_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

namespace {

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  // The first index of the maximum; a NaN wins (as torch.max reports one), the first NaN.
#if defined(THREEFOLD_AVX512)
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan_seen = 0;
  auto load = [&](int64_t i, __mmask16 m) {
    if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(m, row + i);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + i)), 16));
  };
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = load(i, m);
    nan_seen |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    best = _mm512_mask_max_ps(best, m, best, v);
  }
  const float mx = _mm512_reduce_max_ps(best);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = load(i, m);
    const __mmask16 hit = nan_seen ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q)
                                   : _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(mx), _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;
#elif defined(THREEFOLD_AVX2)
  // Pass 1: the maximum over 8-lane chunks (four chains for the latency), NaNs noted apart
  // (max_ps drops them); the scalar tail. Pass 2: the first index holding it.
  const int64_t n8 = n & ~int64_t{7}, n32 = n & ~int64_t{31};
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 best[4] = {lowest, lowest, lowest, lowest};
  __m256 nan_seen = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i < n32; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = threefold::load8(row + i + 8 * j);
      nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      best[j] = _mm256_max_ps(best[j], v);
    }
  for (; i < n8; i += 8) {
    const __m256 v = threefold::load8(row + i);
    nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best[0] = _mm256_max_ps(best[0], v);
  }
  float mx = threefold::hmax8(_mm256_max_ps(_mm256_max_ps(best[0], best[1]), _mm256_max_ps(best[2], best[3])));
  bool any_nan = _mm256_movemask_ps(nan_seen) != 0;
  for (int64_t k = n8; k < n; ++k) {
    const float v = to_float(row[k]);
    any_nan |= threefold::is_nan(v);
    mx = std::max(mx, v);
  }
  for (i = 0; i < n8; i += 8) {
    const __m256 v = threefold::load8(row + i);
    const int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                : _mm256_cmp_ps(v, _mm256_set1_ps(mx), _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i) {
    const float v = to_float(row[i]);
    if (any_nan ? threefold::is_nan(v) : v == mx) return i;
  }
  return 0;
#else
  int64_t arg = 0;
  float best = to_float(row[0]);
  for (int64_t i = 1; i < n && !threefold::is_nan(best); ++i) {
    const float v = to_float(row[i]);
    if (threefold::is_nan(v) || v > best) best = v, arg = i;
  }
  return arg;
#endif
}

}  // namespace

// Row-wise argmax of logits [N, V] (rows contiguous; float32 or bfloat16) -> [N] int64, the
// first index on ties, as torch.argmax. A greedy step's sampling is only this, and torch's
// reduction reads bf16 at a few GB/s.
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0, "argmax_rows: logits [N, V > 0]");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  const int64_t n = logits.size(1), stride = logits.stride(0);
  if (logits.scalar_type() == at::kBFloat16) {
    const at::BFloat16* src = logits.data_ptr<at::BFloat16>();
    at::parallel_for(0, logits.size(0), 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) dst[r] = row_argmax(src + r * stride, n);
    });
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kFloat, "argmax_rows supports float32 and bfloat16");
    const float* src = logits.data_ptr<float>();
    at::parallel_for(0, logits.size(0), 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) dst[r] = row_argmax(src + r * stride, n);
    });
  }
  return out;
}
