// Native CPU kernels for the hot path of a step.
//
// paged_decode_attention -- decode attention for CPU: one query token per sequence, K/V read in
// place from the block pool (no gather copy), GQA, optional sliding window.
//
//   out[b, h] = softmax_t(scale * q[b, h] . K[slot(b, t), h / G]) @ V[slot(b, t), h / G]
//   slot(b, t) = block_table[b, t / block_size] * block_size + t % block_size
//   t in [max(0, seq_len[b] - window), seq_len[b])
//
// Work item = (sequence, kv head): its G query heads share every K/V row it
// loads. Two passes per item: scores (reads K once), then the weighted sum of
// V (reads V once); the softmax runs in fp32 in between. Items are spread over
// torch's own intra-op thread pool (at::parallel_for).
//
// add_rms_norm -- residual += x; x = rms_norm(residual) * weight, in one pass per
// row (vLLM's fused_add_rms_norm): at batch 1 the eager torch version is ~10 ops
// of a few microseconds each, 61 times a step.
//
// rotary_embedding -- HF's rotate_half RoPE, in place on q and k together.
// silu_and_mul -- silu(gate) * up from the fused gate_up projection.
// All three compute in fp32 and round once to the storage dtype.

// threefold-exports: paged_decode_attention add_rms_norm rotary_embedding silu_and_mul set_amx

#include "kernel_common.h"

#include <atomic>

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

template <int D, typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  const DecodeArgs<T> a(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  const std::vector<int64_t> bounds = split_by_cost(a.lens, a.num_seqs, a.num_kv_heads, window, 16);
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> qf(a.group * a.head_dim), acc(a.group * a.head_dim), row(a.head_dim), scores;
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t b = item / a.num_kv_heads, kvh = item % a.num_kv_heads;
      const int64_t len = a.lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = a.tables + b * a.table_width;
      for (int64_t g = 0; g < a.group; ++g) {
        const T* src = a.q_ptr + b * a.q_seq + (kvh * a.group + g) * a.q_head;
        for (int64_t i = 0; i < a.head_dim; ++i) qf[g * a.head_dim + i] = to_float(src[i]) * a.fscale;
      }
      // body(t, row) for the keys t = 0..n-1 (positions first..len-1), walking the block
      // table once: no division per row.
      auto for_each_row = [&](const T* cache, auto&& body) {
        for (int64_t pos = first; pos < len;) {
          const int64_t blk = pos / a.block_size;
          const int64_t end_in_block = std::min(a.block_size, len - blk * a.block_size);
          const T* base = cache + table[blk] * a.kv_block + kvh * a.kv_head;
          for (int64_t off = pos - blk * a.block_size; off < end_in_block; ++off, ++pos) {
            body(pos - first, base + off * a.kv_token);
          }
        }
      };
      scores.assign(a.group * n, 0.f);
      // Pass 1: scores[g, t] for every key, each K row loaded (and widened) once for the G heads.
      for_each_row(a.k_ptr, [&](int64_t t, const T* krow) {
        widen<D>(krow, row.data(), a.head_dim);
        for (int64_t g = 0; g < a.group; ++g) scores[g * n + t] = dot<D>(qf.data() + g * a.head_dim, row.data(), a.head_dim);
      });
      // Softmax per head in fp32; the 1 / sum is folded into the output.
      std::vector<float> inv_sum(a.group);
      for (int64_t g = 0; g < a.group; ++g) {
        float* s = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - mx);  // vectorized (libmvec)
        for (int64_t t = 0; t < n; ++t) sum += s[t];
        inv_sum[g] = 1.f / sum;
      }
      // Pass 2: acc[g] = sum_t p[g, t] * V[t], each V row loaded once.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(a.v_ptr, [&](int64_t t, const T* vrow) {
        widen<D>(vrow, row.data(), a.head_dim);
        for (int64_t g = 0; g < a.group; ++g) axpy<D>(scores[g * n + t], row.data(), acc.data() + g * a.head_dim, a.head_dim);
      });
      for (int64_t g = 0; g < a.group; ++g) {
        T* dst = a.out_ptr + b * a.o_seq + (kvh * a.group + g) * a.o_head;
        for (int64_t i = 0; i < a.head_dim; ++i) dst[i] = static_cast<T>(acc[g * a.head_dim + i] * inv_sum[g]);
      }
    }
  });
}

}  // namespace

#ifdef THREEFOLD_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifdef THREEFOLD_AMX
// bf16 decode attention on AMX tiles (Intel Sapphire Rapids and later): both matmuls of a
// work item run as tile products, so the item costs little beyond reading its K/V rows.
//
//   pass 1   S^T[16 keys, G] += K[16 keys, 32 dims] . Q^T[32 dims, G]   (K rows load straight
//            from the block pool: a tile row may have any stride, so no relayout of K)
//   softmax  fp32, per head; P is rounded to bf16 for pass 2, as FlashAttention does
//   pass 2   O[G, 16 dims] += P[G, 32 keys] . V[32 keys, 16 dims]   (V re-laid in pairs of
//            keys, the "VNNI" layout the B operand needs, 32 keys at a time)
// Products are exact in fp32 and accumulate in fp32, so pass 1 equals the fp32 dot product
// up to summation order; only P's rounding (relative 2^-9, averaging out over keys) is new.
namespace amx {

// Tile registers. GCC's tile intrinsics paste their register argument into the asm text
// unexpanded, so the names go through one more macro level (TILE_*) and stay literals.
#define kC1 0  // pass 1 scores
#define kA1 1  // pass 1 K rows; pass 2 V pairs (kB2)
#define kB2 1
#define kB1 2  // pass 1 Q^T
#define kP 3   // pass 2 P
#define kC2 4  // pass 2 O: tiles 4..7
#define kC2b 5
#define kC2c 6
#define kC2d 7
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool permitted() {
  // Linux hands out the (8 KB) tile state only to processes that ask for it.
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

std::atomic<bool> enabled{true};

// e^x for x <= 0 (softmax after the max is taken): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// p a degree-6 Taylor polynomial (relative error ~1e-7); x below -87 gives 0.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 y = _mm512_set1_ps(1.f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

template <int D>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  using T = at::BFloat16;
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  const DecodeArgs<T> a(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  const int group = static_cast<int>(a.group);
  const std::vector<int64_t> bounds = split_by_cost(a.lens, a.num_seqs, a.num_kv_heads, window, 64);
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;

  TileConfig cfg;
  auto shape = [&](int tile, int rows, int colsb) {
    cfg.rows[tile] = static_cast<uint8_t>(rows);
    cfg.colsb[tile] = static_cast<uint16_t>(colsb);
  };
  shape(kC1, 16, group * 4);  // scores: 16 keys x G fp32
  shape(kA1, 16, 64);         // K: 16 keys x 32 dims bf16; reused as pass 2's B (16 key pairs x 16 dims x 2)
  shape(kB1, 16, group * 4);  // Q^T: 16 dim pairs x G x 2 bf16
  shape(kP, group, 64);       // P: G x 32 keys bf16
  for (int c = 0; c < 4; ++c) shape(kC2 + c, group, 64);  // O: G x 16 dims fp32, four 16-dim slices
  constexpr int kSlices = D / 64;  // 64-dim slices of O; beyond the first, O round-trips memory

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    _tile_loadconfig(&cfg);
    alignas(64) uint32_t qt[D / 32][16][16];  // Q^T in key... dim-pair layout, per 32-dim chunk
    alignas(64) float s16[16][16];            // one pass-1 tile of scores
    alignas(64) uint16_t kst[16][D];          // staged K rows when a tile's rows are not evenly spaced
    alignas(64) uint16_t vt[4][16][32];       // V pairs for one 64-dim slice of 32 keys
    alignas(64) float o[16][D];               // O, permuted within 16-dim slices (see below)
    std::vector<const T*> krows, vrows;
    std::vector<float> scores;
    std::vector<uint16_t> p16;
    const __m512i zero = _mm512_setzero_si512();

    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t b = item / a.num_kv_heads, kvh = item % a.num_kv_heads;
      const int64_t len = a.lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t n32 = (n + 31) / 32 * 32;
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
      // Q^T as dword pairs: qt[c][r][g] = (q[g][32c + 2r], q[g][32c + 2r + 1]).
      for (int g = 0; g < group; ++g) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(a.q_ptr + b * a.q_seq + (kvh * group + g) * a.q_head);
        for (int c = 0; c < D / 32; ++c)
          for (int r = 0; r < 16; ++r) qt[c][r][g] = src[c * 16 + r];
      }

      // Pass 1: scores[g][t]. Rows are prefetched two 16-key tiles ahead.
      for (int64_t j = 0; j < std::min<int64_t>(32, n); ++j)
        for (int l = 0; l < D * 2; l += 64) _mm_prefetch(reinterpret_cast<const char*>(krows[j]) + l, _MM_HINT_T0);
      scores.resize(group * n32);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t rows = std::min<int64_t>(16, n - t0);
        const T* src = krows[t0];
        int64_t stride = a.kv_token * 2;
        if (rows < 16 || krows[t0 + 15] != src + 15 * a.kv_token) {  // rows not evenly spaced: stage
          for (int64_t j = 0; j < 16; ++j) {
            if (j < rows) std::memcpy(kst[j], krows[t0 + j], D * 2);
            else std::memset(kst[j], 0, D * 2);
          }
          src = reinterpret_cast<const T*>(kst);
          stride = D * 2;
        }
        for (int64_t j = t0 + 32; j < std::min<int64_t>(t0 + 48, n); ++j)
          for (int l = 0; l < D * 2; l += 64) _mm_prefetch(reinterpret_cast<const char*>(krows[j]) + l, _MM_HINT_T0);
        for (int64_t j = t0; j < std::min<int64_t>(t0 + 16, n); ++j)
          for (int l = 0; l < D * 2; l += 64) _mm_prefetch(reinterpret_cast<const char*>(vrows[j]) + l, _MM_HINT_T2);
        TILE_ZERO(kC1);
        for (int c = 0; c < D / 32; ++c) {
          TILE_LOAD(kA1, src + c * 32, stride);
          TILE_LOAD(kB1, qt[c], 64);
          TILE_DP(kC1, kA1, kB1);
        }
        TILE_STORE(kC1, s16, 64);
        for (int g = 0; g < group; ++g)
          for (int64_t j = 0; j < rows; ++j) scores[g * n32 + t0 + j] = s16[j][g] * a.fscale;
      }
      for (int64_t j = 0; j < std::min<int64_t>(64, n); ++j)
        for (int l = 0; l < D * 2; l += 64) _mm_prefetch(reinterpret_cast<const char*>(vrows[j]) + l, _MM_HINT_T2);

      // Softmax per head, fp32; P rounded to bf16 (zero past n), 1 / sum applied at the end.
      float inv_sum[16];
      p16.assign(group * n32, 0);
      for (int g = 0; g < group; ++g) {
        float* s = scores.data() + g * n32;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        // 16 lanes at a time; the tail reads a few of the next head's scores (or padding)
        // and masks them out.
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        uint16_t* p = p16.data() + g * n32;
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 live = t + 16 <= n ? __mmask16(0xffff) : __mmask16((1u << (n - t)) - 1);
          const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), vmx));
          const __m512 em = _mm512_maskz_mov_ps(live, e);
          vsum = _mm512_add_ps(vsum, em);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(em));
        }
        inv_sum[g] = 1.f / _mm512_reduce_add_ps(vsum);
      }

      // Pass 2. vt[u][r] holds keys 2r, 2r+1 interleaved per dim, for the dims unpack{lo,hi}
      // picks: slice u = 2h + hi covers dims 32h + 8(i / 4) + i % 4 + 4 hi, i = 0..15.
      for (int sl = 0; sl < kSlices; ++sl) {
        for (int64_t t0 = 0; t0 < n; t0 += 32) {
          if (t0 == 0) {
            TILE_ZERO(kC2); TILE_ZERO(kC2b); TILE_ZERO(kC2c); TILE_ZERO(kC2d);
          } else if (kSlices > 1) {  // one slice's O stays in the tiles; more take turns through o
            TILE_LOAD(kC2, &o[0][sl * 64], D * 4);
            TILE_LOAD(kC2b, &o[0][sl * 64 + 16], D * 4);
            TILE_LOAD(kC2c, &o[0][sl * 64 + 32], D * 4);
            TILE_LOAD(kC2d, &o[0][sl * 64 + 48], D * 4);
          }
          for (int64_t j = t0 + 64; j < std::min<int64_t>(t0 + 96, n); ++j) {
            _mm_prefetch(reinterpret_cast<const char*>(vrows[j]) + sl * 128, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vrows[j]) + sl * 128 + 64, _MM_HINT_T0);
          }
          for (int r = 0; r < 16; ++r) {
            const int64_t ta = t0 + 2 * r, tb = ta + 1;
            __m512i a0 = zero, a1 = zero, b0 = zero, b1 = zero;
            if (ta < n) {
              a0 = _mm512_loadu_si512(vrows[ta] + sl * 64);
              a1 = _mm512_loadu_si512(vrows[ta] + sl * 64 + 32);
            }
            if (tb < n) {
              b0 = _mm512_loadu_si512(vrows[tb] + sl * 64);
              b1 = _mm512_loadu_si512(vrows[tb] + sl * 64 + 32);
            }
            _mm512_store_si512(vt[0][r], _mm512_unpacklo_epi16(a0, b0));
            _mm512_store_si512(vt[1][r], _mm512_unpackhi_epi16(a0, b0));
            _mm512_store_si512(vt[2][r], _mm512_unpacklo_epi16(a1, b1));
            _mm512_store_si512(vt[3][r], _mm512_unpackhi_epi16(a1, b1));
          }
          TILE_LOAD(kP, p16.data() + t0, n32 * 2);
          TILE_LOAD(kB2, vt[0], 64);
          TILE_DP(kC2, kP, kB2);
          TILE_LOAD(kB2, vt[1], 64);
          TILE_DP(kC2b, kP, kB2);
          TILE_LOAD(kB2, vt[2], 64);
          TILE_DP(kC2c, kP, kB2);
          TILE_LOAD(kB2, vt[3], 64);
          TILE_DP(kC2d, kP, kB2);
          if (kSlices > 1 || t0 + 32 >= n) {
            TILE_STORE(kC2, &o[0][sl * 64], D * 4);
            TILE_STORE(kC2b, &o[0][sl * 64 + 16], D * 4);
            TILE_STORE(kC2c, &o[0][sl * 64 + 32], D * 4);
            TILE_STORE(kC2d, &o[0][sl * 64 + 48], D * 4);
          }
        }
      }
      for (int g = 0; g < group; ++g) {
        T* dst = a.out_ptr + b * a.o_seq + (kvh * group + g) * a.o_head;
        for (int sl = 0; sl < kSlices; ++sl)
          for (int u = 0; u < 4; ++u)
            for (int i = 0; i < 16; ++i) {
              const int dim = sl * 64 + (u / 2) * 32 + (i / 4) * 8 + i % 4 + (u % 2) * 4;
              dst[dim] = static_cast<T>(o[g][sl * 64 + u * 16 + i] * inv_sum[g]);
            }
      }
    }
    _tile_release();
  });
}

}  // namespace amx
#endif  // THREEFOLD_AMX

#if defined(THREEFOLD_AVX2) && !defined(THREEFOLD_AVX512)
// Decode attention on AVX2 (head_dim 64 or 128), the same two passes as the generic `run`, in
// blocks of 16 keys: their rows are widened to fp32 once (bf16) into an L1 buffer; pass 1
// sums each (head, key) dot product in 8 lanes and reduces eight keys' lanes together
// (one hadd tree, not eight horizontal sums); pass 2 keeps 64 dims of a head's output in
// registers across the block. The compiler's version of the generic loop spent ~3x longer.
namespace avx2 {

constexpr int kKeys = 16;

// v[j] -> sum of v[j]'s lanes, for j < 8, as one vector.
inline __m256 reduce8(const __m256 (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

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
      _mm256_store_ps(s, reduce8(part));
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
      for (int64_t g = 0; g < a.group; ++g) {
        float* s = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - mx);  // vectorized (libmvec)
        for (int64_t t = 0; t < n; ++t) sum += s[t];
        inv_sum[g] = 1.f / sum;
      }
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

// out, q: [B, H, d]; k_cache, v_cache: [num_blocks, block_size, kv_heads, d] (last dim contiguous);
// block_tables: [B, width] int64; seq_lens: [B] int64 (>= 1); window <= 0 means no sliding window.
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, H, d] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v cache must be [N, bs, kvh, d]");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim of q and cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  k_cache.strides() == v_cache.strides(),
              "head_dim must be contiguous and k/v cache strides equal");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, cache and out must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  const bool bf16 = q.scalar_type() == at::kBFloat16;
#ifdef THREEFOLD_AMX
  if (bf16 && q.size(1) / k_cache.size(2) <= 16 && amx::enabled && amx::permitted()) {
    if (q.size(2) == 64) return amx::run<64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
    if (q.size(2) == 128) return amx::run<128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
  }
#endif
#if defined(THREEFOLD_AVX2) && !defined(THREEFOLD_AVX512)
  if (q.size(2) == 64)
    return bf16 ? avx2::run<64, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window)
                : avx2::run<64, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
  if (q.size(2) == 128)
    return bf16 ? avx2::run<128, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window)
                : avx2::run<128, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
#endif
  switch (q.size(2)) {
    case 64:
      return bf16 ? run<64, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window)
                  : run<64, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
    case 128:
      return bf16 ? run<128, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window)
                  : run<128, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
    default:
      return bf16 ? run<0, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window)
                  : run<0, float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window);
  }
}

namespace {

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       bool add) {
  const int64_t rows = x.size(0), width = x.size(1);
  T* x_ptr = x.data_ptr<T>();
  T* r_ptr = residual.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(width);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x_ptr + r * x_stride;
      T* rr = r_ptr + r * r_stride;
      float sum = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        // The sum is rounded to the storage dtype first, as `x + residual` would be.
        const T rounded = add ? static_cast<T>(to_float(xr[i]) + to_float(rr[i])) : xr[i];
        if (add) rr[i] = rounded;
        h[i] = to_float(rounded);
        sum += h[i] * h[i];
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + feps);
      for (int64_t i = 0; i < width; ++i) xr[i] = static_cast<T>(h[i] * inv * to_float(w_ptr[i]));
    }
  });
}

}  // namespace

// x, residual: [T, H] (rows contiguous); weight: [H]. add: residual += x first, then
// x = rms_norm(residual) * weight; otherwise x = rms_norm(x) * weight. In place.
void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps, bool add) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "add_rms_norm: x and residual [T, H], weight [H]");
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1 && weight.is_contiguous(), "rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, residual and weight must share a dtype");
  if (x.scalar_type() == at::kBFloat16) return add_rms_norm_impl<at::BFloat16>(x, residual, weight, eps, add);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "add_rms_norm supports float32 and bfloat16");
  add_rms_norm_impl<float>(x, residual, weight, eps, add);
}

namespace {

template <typename T>
void rotary_impl(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* x_ptr = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* cos_ptr = cos.data_ptr<T>();
  const T* sin_ptr = sin.data_ptr<T>();
  const int64_t t_stride = x.stride(0), h_stride = x.stride(1), table_stride = cos.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        c[i] = to_float(cos_ptr[pos[t] * table_stride + i]);
        s[i] = to_float(sin_ptr[pos[t] * table_stride + i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x_ptr + t * t_stride + h * h_stride;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x1[i]), b = to_float(x2[i]);
          x1[i] = static_cast<T>(a * c[i] - b * s[i]);
          x2[i] = static_cast<T>(b * c[i] + a * s[i]);
        }
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t tokens = out.size(0), width = out.size(1);
  const T* in = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t in_stride = gate_up.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = in + t * in_stride;
      const T* up = gate + width;
      T* o = dst + t * out_stride;
      for (int64_t i = 0; i < width; ++i) {
        const float g = to_float(gate[i]);
        o[i] = static_cast<T>(g / (1.f + std::exp(-g)) * to_float(up[i]));
      }
    }
  });
}

}  // namespace

// x: [T, heads, head_dim] (head_dim contiguous, any token/head strides), rotated in place at
// positions [T] int64 with cos/sin tables [max_len, head_dim / 2] of x's dtype.
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary_embedding: x [T, heads, even d]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == x.size(0),
              "positions must be contiguous int64 [T]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == x.size(2) / 2 && cos.stride(1) == 1 &&
                  cos.strides() == sin.strides(),
              "cos/sin must be [max_len, head_dim / 2]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(), "dtypes differ");
  if (x.scalar_type() == at::kBFloat16) return rotary_impl<at::BFloat16>(x, positions, cos, sin);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rotary_embedding supports float32 and bfloat16");
  rotary_impl<float>(x, positions, cos, sin);
}

// out: [T, I]; gate_up: [T, 2 I] (rows contiguous) -> out = silu(gate_up[:, :I]) * gate_up[:, I:].
void silu_and_mul(at::Tensor out, at::Tensor gate_up) {
  TORCH_CHECK(out.dim() == 2 && gate_up.dim() == 2 && gate_up.size(0) == out.size(0) &&
                  gate_up.size(1) == 2 * out.size(1) && out.stride(1) == 1 && gate_up.stride(1) == 1,
              "silu_and_mul: out [T, I], gate_up [T, 2I]");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "dtypes differ");
  if (out.scalar_type() == at::kBFloat16) return silu_and_mul_impl<at::BFloat16>(out, gate_up);
  TORCH_CHECK(out.scalar_type() == at::kFloat, "silu_and_mul supports float32 and bfloat16");
  silu_and_mul_impl<float>(out, gate_up);
}

// Turns the AMX decode-attention path on or off (tests compare both); returns whether bf16
// decode attention now runs on AMX tiles (false where the CPU or the OS has none).
bool set_amx(bool enable) {
#ifdef THREEFOLD_AMX
  amx::enabled = enable;
  return enable && amx::permitted();
#else
  (void)enable;
  return false;
#endif
}
