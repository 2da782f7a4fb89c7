// threefold-exports: tq_decode_attention tq_window_attention
//
// TurboQuant attention (kv/codecs/turboquant.py) over its packed blocks, read in place: no key or value
// is ever dequantized back to the model's space, and nothing the size of a context is built but the
// scores (as in every decode kernel here).
//
// Per (token, kv head) a block stores, with R = H diag(s) / sqrt(d) the head's rotation (H: Sylvester
// Hadamard, s: its random signs) and c_K, c_V the Lloyd-Max codebooks:
//   k_codes [N, bs, kvh, kbits, d / 8], v_codes [.., vbits, d / 8], k_signs [.., 0 or 1, d / 8]  uint8
//       bit planes: plane b, byte i, bit j = bit b of channel j * d / 8 + i's code (or its QJL sign)
//   norms   [2 or 3, N, bs, kvh] fp16: ||k||, ||v|| and (QJL) ||r||, the key's residual norm
// and the codec's dense read is  k^ = R^T (||k|| c_K[k codes] + ||r|| sqrt(pi / 2) / d S^T sign),
// v^ = R^T ||v|| c_V[v codes]  (S [d, d]: the head's QJL projection). Everything is linear in the
// rotated space, so with each query rotated once, qr = R q and u = S qr,
//   q . k^_t = ||k_t|| qr . c_K[codes_t] + ||r_t|| sqrt(pi / 2) / d u . sign_t
//   sum_t p_t v^_t = R^T sum_t p_t ||v_t|| c_V[vcodes_t]      (accumulated rotated, turned back once)
// A key is decoded once for every query row and head that reads it: its rotated row ||k|| c_K[codes]
// and its signs (+-||r|| sqrt(pi / 2) / d) as one fp32 row of 2d, scored by one 2d dot against
// [qr, u]; a value row ||v|| c_V[codes] is accumulated as is. Keys and values go in tiles of 16: the
// 16 dots of a (row, head) reduced by one transposing add tree, the 16 values accumulated into an
// output held in registers. The rotation is a fast Walsh-Hadamard transform (d log d) per query head,
// there and back. AVX-512 (head_dim 64 or 128): a row's code bits come out of its planes in channel
// order by byte tests (vptestmb), its centroids by a register permute (vpermps from the <= 16 of the
// codebook); elsewhere plain loops.
//
// tq_decode_attention (residual = 0, kv/native.py): every key from the blocks; a sliding window and a
// candidate tree's ancestor mask as in the dense kernel. tq_window_attention (residual > 0,
// worker/kivi_attention.py): row r reads its positions [0, nq[r]) from the blocks and [nq[r], len[r])
// exact from a full-precision window ring[0|1, slot[r], (t - base[r]) mod size] (scored against q and
// accumulated apart, in the model's space).
//
// Work item = (query group, kv head): rows that read the same blocks (a prefill chunk's rows, a verify's)
// share every key and value they decode (decode_attention.h's query groups, up to kMaxGroupRows).

#include "decode_attention.h"

namespace {

using Half = at::Half;

constexpr int kBook = 16;  // codebook entries the kernel holds (bits <= 4)

struct TqArgs {
  int64_t rows, num_heads, head_dim, block_size, num_kv_heads, group, table_width;
  int64_t kbits, vbits, norm_plane;  // norm_plane: elements of one norms plane (N bs kvh)
  const uint8_t* k_codes;
  const uint8_t* v_codes;
  const uint8_t* k_signs;     // QJL only
  const Half* norms;
  const float* rot_signs;     // [kvh, d]
  const float* projection;    // [kvh, d, d] (QJL only)
  float k_book[kBook], v_book[kBook];
  const int64_t* tables;
  const int64_t* lens;
  float scale;
  int64_t window = 0;
  threefold::TreeMask mask;
  // tq_window_attention only:
  const void* ring = nullptr;  // [2, slots, size, kvh, d]
  int64_t ring_slots = 0, ring_size = 1;
  const int64_t* quant_lens = nullptr;
  const int64_t* slots = nullptr;
  const int64_t* bases = nullptr;
};

// x <- H x (Sylvester order, unnormalized), d a power of two.
inline void fwht(float* x, int64_t d) {
  for (int64_t h = 1; h < d; h *= 2)
    for (int64_t i = 0; i < d; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

#if defined(THREEFOLD_AVX512)
constexpr long long kBytes(uint64_t x) { return static_cast<long long>(x * 0x0101010101010101ull); }

// One bit plane (D / 8 bytes) -> its bits in channel order, 64 channels a mask: the bytes broadcast to
// every 64-bit (D 64) or 128-bit (D 128) lane and tested against bit (lane index), so mask bit k is bit
// k / (D / 8) of byte k % (D / 8): channel k.
template <int D>
inline void plane_masks(const uint8_t* p, __mmask64* m) {
  if constexpr (D == 64) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    const __m512i bits = _mm512_set_epi64(kBytes(128), kBytes(64), kBytes(32), kBytes(16), kBytes(8), kBytes(4),
                                          kBytes(2), kBytes(1));
    m[0] = _mm512_test_epi8_mask(_mm512_set1_epi64(static_cast<long long>(word)), bits);
  } else {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i low = _mm512_set_epi64(kBytes(8), kBytes(8), kBytes(4), kBytes(4), kBytes(2), kBytes(2),
                                         kBytes(1), kBytes(1));
    const __m512i high = _mm512_set_epi64(kBytes(128), kBytes(128), kBytes(64), kBytes(64), kBytes(32),
                                          kBytes(32), kBytes(16), kBytes(16));
    m[0] = _mm512_test_epi8_mask(bytes, low);
    m[1] = _mm512_test_epi8_mask(bytes, high);
  }
}

// Channels [16 v, 16 v + 16) of a plane's masks.
inline __mmask16 lanes(const __mmask64* m, int v) { return static_cast<__mmask16>(m[v / 4] >> (16 * (v % 4))); }
#endif

// dst[c] = scale * book[code_c] for the codes in `bits` planes of d / 8 bytes (channel c = j d / 8 + i:
// bit j of byte i); book holds kBook entries.
template <int D>
inline void decode_codes(const uint8_t* __restrict planes, int64_t bits, const float* __restrict book, float scale,
                         float* __restrict dst, int64_t d) {
  const int64_t n = D > 0 ? D : d, part = n / 8;
#if defined(THREEFOLD_AVX512)
  if constexpr (D == 64 || D == 128) {
    // The codes as bytes in channel order (plane b adds 1 << b where its bit is set), then 16 at a time
    // widened to indices into the codebook held in one register.
    __m512i codes[D / 64];
    for (int x = 0; x < D / 64; ++x) codes[x] = _mm512_setzero_si512();
    for (int64_t b = 0; b < bits; ++b) {
      __mmask64 m[D / 64];
      plane_masks<D>(planes + b * part, m);
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(1 << b));
      for (int x = 0; x < D / 64; ++x) codes[x] = _mm512_mask_add_epi8(codes[x], m[x], codes[x], bit);
    }
    alignas(64) uint8_t bytes[D];
    for (int x = 0; x < D / 64; ++x) _mm512_store_si512(bytes + 64 * x, codes[x]);
    const __m512 table = _mm512_mul_ps(_mm512_loadu_ps(book), _mm512_set1_ps(scale));
    for (int v = 0; v < D / 16; ++v) {
      const __m512i index = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes + 16 * v)));
      _mm512_storeu_ps(dst + 16 * v, _mm512_permutexvar_ps(index, table));
    }
    return;
  }
#endif
  float table[kBook];
  for (int k = 0; k < kBook; ++k) table[k] = book[k] * scale;
  for (int j = 0; j < 8; ++j)
    for (int64_t i = 0; i < part; ++i) {
      int code = 0;
      for (int64_t b = 0; b < bits; ++b) code |= ((planes[b * part + i] >> j) & 1) << b;
      dst[j * part + i] = table[code];
    }
}

// dst[c] = +-w as channel c's bit (one plane, as decode_codes) is set or not.
template <int D>
inline void decode_signs(const uint8_t* __restrict plane, float w, float* __restrict dst, int64_t d) {
  const int64_t n = D > 0 ? D : d, part = n / 8;
#if defined(THREEFOLD_AVX512)
  if constexpr (D == 64 || D == 128) {
    __mmask64 m[D / 64];
    plane_masks<D>(plane, m);
    const __m512 plus = _mm512_set1_ps(w), minus = _mm512_set1_ps(-w);
    for (int v = 0; v < D / 16; ++v) _mm512_storeu_ps(dst + 16 * v, _mm512_mask_blend_ps(lanes(m, v), minus, plus));
    return;
  }
#endif
  for (int j = 0; j < 8; ++j)
    for (int64_t i = 0; i < part; ++i) dst[j * part + i] = (plane[i] >> j) & 1 ? w : -w;
}

// The rows' query groups: runs of consecutive rows that read the same blocks (decode_attention.h's
// query_groups) and, windowed, the same ring rows.
std::vector<int64_t> tq_groups(const TqArgs& a, bool windowed) {
  std::vector<int64_t> starts{0};
  for (int64_t b = 1; b < a.rows; ++b) {
    const int64_t first = starts.back();
    const int64_t reads = windowed ? std::min(a.quant_lens[b], a.lens[b]) : a.lens[b];
    const int64_t blocks = std::min(a.table_width, (reads + a.block_size - 1) / a.block_size);
    const int64_t* tb = a.tables + b * a.table_width;
    const bool joins = b - first < kMaxGroupRows && std::equal(tb, tb + blocks, a.tables + first * a.table_width) &&
                       (!windowed || (a.slots[b] == a.slots[first] && a.bases[b] == a.bases[first]));
    if (!joins) starts.push_back(b);
  }
  starts.push_back(a.rows);
  return starts;
}

inline float half(Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

constexpr int kTile = 16;  // keys scored together


#if defined(THREEFOLD_AVX512)
// v[j] -> the sum of v[j]'s lanes, for j < 16, as one vector (a transposing add tree).
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// s[j] = q . keys[j] (rows of kd floats) for j < count <= kTile; the tile's other rows are finite.
template <int KD>
inline void score_tile(const float* __restrict q, const float* __restrict keys, int count, float* __restrict s,
                       int64_t kd) {
#if defined(THREEFOLD_AVX512)
  if constexpr (KD >= 64 && KD % 32 == 0) {
    constexpr int V = KD / 16;
    __m512 dots[kTile];
    for (int j = 0; j < kTile; ++j) {
      const float* k = keys + j * KD;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
      __m512 b = _mm512_mul_ps(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(k + 16));
      for (int v = 2; v < V; v += 2) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * v), _mm512_loadu_ps(k + 16 * v), a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * v + 16), _mm512_loadu_ps(k + 16 * v + 16), b);
      }
      dots[j] = _mm512_add_ps(a, b);
    }
    _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << count) - 1), reduce16(dots));
    return;
  }
#endif
  for (int j = 0; j < count; ++j) s[j] = dot<KD>(q, keys + j * kd, kd);
}

// acc[0, d) += sum_j p[j] rows[j] for j < count (rows of d floats): the output held in registers over the tile.
template <int D>
inline void accumulate_tile(const float* __restrict p, const float* __restrict rows, int count, float* __restrict acc,
                            int64_t d) {
#if defined(THREEFOLD_AVX512)
  if constexpr (D == 64 || D == 128) {
    constexpr int V = D / 16;
    __m512 sum[V];
    for (int v = 0; v < V; ++v) sum[v] = _mm512_loadu_ps(acc + 16 * v);
    for (int j = 0; j < count; ++j) {
      const __m512 w = _mm512_set1_ps(p[j]);
      for (int v = 0; v < V; ++v) sum[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(rows + j * D + 16 * v), sum[v]);
    }
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + 16 * v, sum[v]);
    return;
  }
#endif
  for (int j = 0; j < count; ++j) axpy<D>(p[j], rows + j * d, acc, d);
}

enum Form { kHidden = 0, kBlocks = 1, kExact = 2 };

// T: q and out; W: the window's rows (T, or fp16 beside fp32 q); QJL: keys carry the sign plane.
template <int D, typename T, typename W, bool QJL, bool WINDOWED>
void tq_run(const at::Tensor& out, const at::Tensor& q, const TqArgs& a) {
  constexpr int KD = QJL ? 2 * D : D;  // a decoded key row: rotated centroids, then (QJL) signed weights
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t d = a.head_dim, kd = QJL ? 2 * d : d, kvh_n = a.num_kv_heads, part = d / 8;
  const float inv_root = 1.f / std::sqrt(static_cast<float>(d));
  const float qjl_weight = std::sqrt(static_cast<float>(M_PI) / 2.f) / static_cast<float>(d);
  const W* ring = static_cast<const W*>(a.ring);
  const int64_t ring_side = a.ring_slots * a.ring_size * kvh_n * d;
  const std::vector<int64_t> groups = tq_groups(a, WINDOWED);
  const int64_t num_groups = static_cast<int64_t>(groups.size()) - 1;
  std::vector<int64_t> group_cost(num_groups);
  for (int64_t gi = 0; gi < num_groups; ++gi) {
    int64_t cost = 0;
    for (int64_t b = groups[gi]; b < groups[gi + 1]; ++b) cost += a.window > 0 ? std::min(a.lens[b], a.window) : a.lens[b];
    group_cost[gi] = cost;
  }
  const std::vector<int64_t> bounds = split_by_cost(group_cost.data(), num_groups, kvh_n, 0, 16);
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t gd = a.group * d;

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> qf, qq, acc, exact_acc, scores, inv_sum, row(d);
    std::vector<float> keys(kTile * kd, 0.f), exact_keys(WINDOWED ? kTile * d : 0, 0.f);  // a tile's decoded keys
    bool tile_blocks = false, tile_other = false;  // some key of the tile read from the blocks / otherwise
    float weights[kTile];
    std::vector<uint8_t> forms;
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t gi = item / kvh_n, kvh = item % kvh_n;
      const int64_t b0 = groups[gi], rows = groups[gi + 1] - b0;
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t len = a.lens[b0 + r];
        lo = std::min(lo, !WINDOWED && a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0);
        hi = std::max(hi, len);
      }
      const int64_t n = hi - lo;
      const int64_t* table = a.tables + b0 * a.table_width;
      // forms[t * rows + r]: how row r reads key lo + t.
      forms.resize(n * rows);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = b0 + r, len = a.lens[b];
        const int64_t nq = WINDOWED ? std::min(a.quant_lens[b], len) : len;
        const int64_t first = !WINDOWED && a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
        const int64_t tree_start = WINDOWED ? len : a.mask.start(b, len);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t pos = lo + t;
          Form f = pos >= len || pos < first ? kHidden : pos < nq ? kBlocks : kExact;
          if (f == kBlocks && pos >= tree_start && !a.mask.visible(b, tree_start, pos)) f = kHidden;
          forms[t * rows + r] = f;
        }
      }
      // Each (row, head)'s query: qf = scale q (exact keys), qq = [R qf, S R qf] (the blocks' keys).
      const int64_t num_scores = rows * a.group;
      qf.resize(num_scores * d);
      qq.resize(num_scores * kd);
      const float* signs = a.rot_signs + kvh * d;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < a.group; ++g) {
          const int64_t rg = r * a.group + g;
          const T* src = q_ptr + (b0 + r) * q_row + (kvh * a.group + g) * q_head;
          float* x = qf.data() + rg * d;
          float* y = qq.data() + rg * kd;
          for (int64_t i = 0; i < d; ++i) x[i] = to_float(src[i]) * a.scale;
          for (int64_t i = 0; i < d; ++i) y[i] = x[i] * signs[i];
          fwht(y, d);
          for (int64_t i = 0; i < d; ++i) y[i] *= inv_root;
          if constexpr (QJL) {
            const float* s = a.projection + kvh * d * d;
            for (int64_t m = 0; m < d; ++m) y[d + m] = dot<D>(s + m * d, y, d);
          }
        }
      // body(t, index) for every key t < n, index its (block, offset, kv head) row: one table walk.
      auto for_each_key = [&](auto&& body) {
        int64_t bi = lo / a.block_size, off = lo % a.block_size;
        for (int64_t t = 0; t < n; ++t) {
          body(t, (table[std::min(bi, a.table_width - 1)] * a.block_size + off) * kvh_n + kvh);
          if (++off == a.block_size) ++bi, off = 0;
        }
      };
      auto exact_row = [&](int64_t pos) {  // position pos's K row in the ring (V: + ring_side)
        const int64_t b = b0;
        int64_t i = (pos - a.bases[b]) % a.ring_size;
        i = i < 0 ? i + a.ring_size : i;
        return ring + ((a.slots[b] * a.ring_size + i) * kvh_n + kvh) * d;
      };
      // Pass 1: scores[rg, t], kTile keys at a time: each key decoded once for the group's rows and heads,
      // then scored by every (row, head) together; a key a row reads exact (or not at all) is rescored.
      scores.resize(num_scores * n);
      for_each_key([&](int64_t t, int64_t index) {
        const int j = static_cast<int>(t % kTile);
        const uint8_t* f = forms.data() + t * rows;
        bool blocks = false, exact = false, all_blocks = true;
        for (int64_t r = 0; r < rows; ++r)
          blocks |= f[r] == kBlocks, exact |= f[r] == kExact, all_blocks &= f[r] == kBlocks;
        tile_blocks |= blocks, tile_other |= !all_blocks;
        if (blocks) {
          float* key = keys.data() + j * kd;
          decode_codes<D>(a.k_codes + index * a.kbits * part, a.kbits, a.k_book, half(a.norms[index]), key, d);
          if constexpr (QJL)
            decode_signs<D>(a.k_signs + index * part, qjl_weight * half(a.norms[2 * a.norm_plane + index]), key + d, d);
        }
        if constexpr (WINDOWED) {
          if (exact) widen<D>(exact_row(lo + t), exact_keys.data() + j * d, d);
        }
        if (j + 1 < kTile && t + 1 < n) return;
        const int64_t t0 = t - j;
        const int count = j + 1;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = 0; g < a.group; ++g) {
            const int64_t rg = r * a.group + g;
            float* s = scores.data() + rg * n + t0;
            if (tile_blocks) score_tile<KD>(qq.data() + rg * kd, keys.data(), count, s, kd);
            if (!tile_other) continue;
            for (int i = 0; i < count; ++i) {
              const uint8_t form = forms[(t0 + i) * rows + r];
              if (WINDOWED && form == kExact) {
                s[i] = dot<D>(qf.data() + rg * d, exact_keys.data() + i * d, d);
              } else if (form != kBlocks) {
                s[i] = threefold::kHiddenScore;
              }
            }
          }
        tile_blocks = tile_other = false;
      });
      inv_sum.resize(num_scores);
      threefold::softmax_rows(scores.data(), num_scores, n, inv_sum.data());
      // Pass 2: values, from the blocks accumulated rotated (acc), exact ones as they are (exact_acc).
      acc.assign(num_scores * d, 0.f);
      if constexpr (WINDOWED) exact_acc.assign(num_scores * d, 0.f);
      for_each_key([&](int64_t t, int64_t index) {
        const uint8_t* f = forms.data() + t * rows;
        bool blocks = false, exact = false;
        for (int64_t r = 0; r < rows; ++r) blocks |= f[r] == kBlocks, exact |= f[r] == kExact;
        const int j = static_cast<int>(t % kTile);
        tile_blocks |= blocks;
        if (blocks)
          decode_codes<D>(a.v_codes + index * a.vbits * part, a.vbits, a.v_book, half(a.norms[a.norm_plane + index]),
                          keys.data() + j * d, d);
        if ((j + 1 == kTile || t + 1 == n) && tile_blocks) {  // the tile's rows, weighted per (row, head)
          const int64_t t0 = t - j;
          const int count = j + 1;
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < a.group; ++g) {
              const int64_t rg = r * a.group + g;
              float* p = weights;
              for (int i = 0; i < count; ++i)
                p[i] = forms[(t0 + i) * rows + r] == kBlocks ? scores[rg * n + t0 + i] : 0.f;
              accumulate_tile<D>(p, keys.data(), count, acc.data() + rg * d, d);
            }
          tile_blocks = false;
        }
        if constexpr (WINDOWED) {
          if (!exact) return;
          widen<D>(exact_row(lo + t) + ring_side, row.data(), d);
          for (int64_t r = 0; r < rows; ++r) {
            if (f[r] != kExact) continue;
            for (int64_t g = 0; g < a.group; ++g) {
              const int64_t rg = r * a.group + g;
              axpy<D>(scores[rg * n + t], row.data(), exact_acc.data() + rg * d, d);
            }
          }
        }
      });
      // out = (R^T acc + exact_acc) / sum, R^T y = s * (H y) / sqrt(d).
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < a.group; ++g) {
          const int64_t rg = r * a.group + g;
          float* y = acc.data() + rg * d;
          fwht(y, d);
          const float w = inv_root * inv_sum[rg];
          T* dst = out_ptr + (b0 + r) * o_row + (kvh * a.group + g) * o_head;
          for (int64_t i = 0; i < d; ++i) {
            float x = y[i] * signs[i] * w;
            if constexpr (WINDOWED) x += exact_acc[rg * d + i] * inv_sum[rg];
            dst[i] = static_cast<T>(x);
          }
        }
    }
  });
}

template <typename T, typename W, bool WINDOWED>
void dispatch(const at::Tensor& out, const at::Tensor& q, const TqArgs& a) {
  const bool qjl = a.k_signs != nullptr;
  switch (a.head_dim) {
    case 64: return qjl ? tq_run<64, T, W, true, WINDOWED>(out, q, a) : tq_run<64, T, W, false, WINDOWED>(out, q, a);
    case 128:
      return qjl ? tq_run<128, T, W, true, WINDOWED>(out, q, a) : tq_run<128, T, W, false, WINDOWED>(out, q, a);
    default: return qjl ? tq_run<0, T, W, true, WINDOWED>(out, q, a) : tq_run<0, T, W, false, WINDOWED>(out, q, a);
  }
}

bool long_rows(const at::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 && t.size(0) == n;
}

// The operands both entry points share, checked.
TqArgs checked_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& v_codes,
                    const at::Tensor& k_signs, const at::Tensor& norms, const at::Tensor& rot_signs,
                    const at::Tensor& projection, const at::Tensor& k_book, const at::Tensor& v_book,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [R, H, d] of one shape, head_dim contiguous");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q and out must share a dtype, float32 or bfloat16");
  const int64_t rows = q.size(0), d = q.size(2);
  TORCH_CHECK(d >= 8 && (d & (d - 1)) == 0, "head_dim must be a power of two >= 8");
  TORCH_CHECK(k_codes.dim() == 5 && k_codes.scalar_type() == at::kByte && k_codes.is_contiguous() &&
                  v_codes.dim() == 5 && v_codes.scalar_type() == at::kByte && v_codes.is_contiguous() &&
                  k_signs.dim() == 5 && k_signs.scalar_type() == at::kByte && k_signs.is_contiguous() &&
                  k_codes.size(4) * 8 == d && v_codes.size(4) * 8 == d && k_signs.size(4) * 8 == d &&
                  v_codes.sizes().slice(0, 3) == k_codes.sizes().slice(0, 3) &&
                  k_signs.sizes().slice(0, 3) == k_codes.sizes().slice(0, 3),
              "k_codes, v_codes, k_signs must be contiguous uint8 [N, bs, kvh, planes, d / 8]");
  const int64_t kbits = k_codes.size(3), vbits = v_codes.size(3), sign_planes = k_signs.size(3);
  TORCH_CHECK(kbits >= 1 && kbits <= 4 && vbits >= 1 && vbits <= 4 && sign_planes <= 1,
              "1 to 4 key and value code planes, 0 or 1 sign plane");
  const int64_t num_blocks = k_codes.size(0), bs = k_codes.size(1), kvh = k_codes.size(2);
  TORCH_CHECK(norms.dim() == 4 && norms.scalar_type() == at::kHalf && norms.is_contiguous() &&
                  norms.size(0) == 2 + sign_planes && norms.size(1) == num_blocks && norms.size(2) == bs &&
                  norms.size(3) == kvh,
              "norms must be contiguous float16 [2 (+1 with QJL), N, bs, kvh]");
  TORCH_CHECK(q.size(1) % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(rot_signs.scalar_type() == at::kFloat && rot_signs.is_contiguous() && rot_signs.dim() == 2 &&
                  rot_signs.size(0) == kvh && rot_signs.size(1) == d,
              "rot_signs must be contiguous float32 [kvh, d]");
  TORCH_CHECK(sign_planes == 0 || (projection.scalar_type() == at::kFloat && projection.is_contiguous() &&
                                   projection.dim() == 3 && projection.size(0) == kvh && projection.size(1) == d &&
                                   projection.size(2) == d),
              "projection must be contiguous float32 [kvh, d, d] with QJL");
  TORCH_CHECK(k_book.scalar_type() == at::kFloat && k_book.is_contiguous() && k_book.numel() == (1 << kbits) &&
                  v_book.scalar_type() == at::kFloat && v_book.is_contiguous() && v_book.numel() == (1 << vbits),
              "k_book, v_book must be the 2^bits float32 centroids");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == rows && block_tables.size(1) > 0 && long_rows(seq_lens, rows),
              "block_tables [R, width] and seq_lens [R] must be contiguous int64");
  TqArgs a{rows, q.size(1), d, bs, kvh, q.size(1) / kvh, block_tables.size(1), kbits, vbits, num_blocks * bs * kvh,
           k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(),
           sign_planes ? k_signs.data_ptr<uint8_t>() : nullptr, norms.data_ptr<Half>(), rot_signs.data_ptr<float>(),
           sign_planes ? projection.data_ptr<float>() : nullptr, {}, {}, block_tables.data_ptr<int64_t>(),
           seq_lens.data_ptr<int64_t>(), static_cast<float>(scale)};
  std::copy(k_book.data_ptr<float>(), k_book.data_ptr<float>() + k_book.numel(), a.k_book);
  std::copy(v_book.data_ptr<float>(), v_book.data_ptr<float>() + v_book.numel(), a.v_book);
  return a;
}

// Every block a row reads from (its first `reads` keys) must exist.
void check_blocks(const TqArgs& a, const int64_t* reads, int64_t num_blocks) {
  for (int64_t r = 0; r < a.rows; ++r) {
    TORCH_CHECK(a.lens[r] >= 1 && (reads[r] + a.block_size - 1) / a.block_size <= a.table_width,
                "row ", r, " reads keys past its block table");
    for (int64_t i = 0; i < (reads[r] + a.block_size - 1) / a.block_size; ++i) {
      const int64_t blk = a.tables[r * a.table_width + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables names a block out of range");
    }
  }
}

}  // namespace

// out, q: [R, H, d] (float32 or bfloat16, head_dim contiguous); k_codes [N, bs, kvh, kbits, d / 8],
// v_codes [.., vbits, d / 8], k_signs [.., 0 or 1, d / 8] uint8, norms [2 or 3, N, bs, kvh] fp16
// (kv/codecs/turboquant.py's storage); rot_signs [kvh, d], projection [kvh, d, d] (QJL; else ignored),
// k_book, v_book [2^bits] float32; block_tables [R, width], seq_lens [R] int64 (>= 1); window <= 0: no
// sliding window; tree_starts [R], tree_bits [R, words] int64: a candidate tree's mask (empty: none).
void tq_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_signs, at::Tensor norms, at::Tensor rot_signs, at::Tensor projection, at::Tensor k_book, at::Tensor v_book, at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window, at::Tensor tree_starts, at::Tensor tree_bits) {
  TqArgs a = checked_args(out, q, k_codes, v_codes, k_signs, norms, rot_signs, projection, k_book, v_book,
                          block_tables, seq_lens, scale);
  a.window = window;
  a.mask = threefold::TreeMask(tree_starts, tree_bits, seq_lens);
  check_blocks(a, a.lens, k_codes.size(0));
  if (q.scalar_type() == at::kBFloat16) return dispatch<at::BFloat16, at::BFloat16, false>(out, q, a);
  dispatch<float, float, false>(out, q, a);
}

// tq_decode_attention's operands (no window, no tree) plus ring: [2, S, size, kvh, d] contiguous, q's
// dtype (or float16 beside float32 q); quant_lens, slots, bases [R] int64: row r reads keys [0, nq[r])
// from its blocks and [nq[r], len[r]) from ring[0|1, slots[r], (t - bases[r]) mod size].
void tq_window_attention(at::Tensor out, at::Tensor q, at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_signs, at::Tensor norms, at::Tensor rot_signs, at::Tensor projection, at::Tensor k_book, at::Tensor v_book, at::Tensor ring, at::Tensor block_tables, at::Tensor quant_lens, at::Tensor seq_lens, at::Tensor slots, at::Tensor bases, double scale) {
  TqArgs a = checked_args(out, q, k_codes, v_codes, k_signs, norms, rot_signs, projection, k_book, v_book,
                          block_tables, seq_lens, scale);
  const int64_t rows = a.rows;
  const bool half_ring = q.scalar_type() == at::kFloat && ring.scalar_type() == at::kHalf;
  TORCH_CHECK(ring.scalar_type() == q.scalar_type() || half_ring,
              "ring must have q's dtype (or float16 beside float32 q)");
  TORCH_CHECK(ring.dim() == 5 && ring.size(0) == 2 && ring.size(2) > 0 && ring.size(3) == a.num_kv_heads &&
                  ring.size(4) == a.head_dim && ring.is_contiguous(),
              "ring must be contiguous [2, slots, size, kvh, d]");
  TORCH_CHECK(long_rows(quant_lens, rows) && long_rows(slots, rows) && long_rows(bases, rows),
              "quant_lens, slots, bases must be contiguous int64 [R]");
  a.ring = ring.data_ptr();
  a.ring_slots = ring.size(1);
  a.ring_size = ring.size(2);
  a.quant_lens = quant_lens.data_ptr<int64_t>();
  a.slots = slots.data_ptr<int64_t>();
  a.bases = bases.data_ptr<int64_t>();
  std::vector<int64_t> reads(rows);
  for (int64_t r = 0; r < rows; ++r) {
    reads[r] = std::min(std::max<int64_t>(a.quant_lens[r], 0), a.lens[r]);
    TORCH_CHECK(a.slots[r] >= 0 && a.slots[r] < a.ring_slots && a.lens[r] - reads[r] <= a.ring_size,
                "row ", r, ": its ring slot is out of range, or its exact keys outnumber the ring's rows");
  }
  check_blocks(a, reads.data(), k_codes.size(0));
  if (q.scalar_type() == at::kBFloat16) return dispatch<at::BFloat16, at::BFloat16, true>(out, q, a);
  if (half_ring) return dispatch<float, Half, true>(out, q, a);
  dispatch<float, float, true>(out, q, a);
}
