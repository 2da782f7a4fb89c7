// Decode attention on AMX tiles. Included by decode_attention.cpp only.
#pragma once

#include "decode_attention.h"

#include <atomic>

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
