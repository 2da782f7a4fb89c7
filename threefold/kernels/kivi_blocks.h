// The blocks of a KIVI cache layer (kv/codecs/kivi.py), for every kernel that reads or writes them
// (kivi_attention.cpp, kivi_prefill.cpp): codes [N, bs, kvh, d * bits / 8] uint8 with bits 2 or 4 (byte i
// holds code[i + j d / p] << (j bits), p = 8 / bits parts a byte), key scales / zeros fp16
// [N, bs / G, kvh, d], value scales / zeros fp16 [N, bs, kvh, d / VG], all contiguous.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// The checked blocks as raw pointers, and the codes' bits.
struct KiviBlocks {
  const uint8_t* k_codes;
  const uint8_t* v_codes;
  const at::Half* k_scales;
  const at::Half* k_zeros;
  const at::Half* v_scales;
  const at::Half* v_zeros;
  int64_t bits;
};

inline KiviBlocks check_kivi_blocks(const at::Tensor& k_codes, const at::Tensor& v_codes, const at::Tensor& k_scales,
                                    const at::Tensor& k_zeros, const at::Tensor& v_scales, const at::Tensor& v_zeros,
                                    int64_t d) {
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.sizes() == v_codes.sizes() && k_codes.is_contiguous() &&
                  v_codes.is_contiguous() && k_codes.scalar_type() == at::kByte,
              "codes must be contiguous uint8 [N, bs, kvh, width]");
  const int64_t width = k_codes.size(3), kvh = k_codes.size(2), bs = k_codes.size(1);
  TORCH_CHECK(width * 8 == 2 * d || width * 8 == 4 * d, "codes must hold 2 or 4 bits per channel");
  TORCH_CHECK(k_scales.dim() == 4 && k_scales.sizes() == k_zeros.sizes() && k_scales.is_contiguous() &&
                  k_zeros.is_contiguous() && k_scales.scalar_type() == at::kHalf &&
                  k_zeros.scalar_type() == at::kHalf && k_scales.size(0) == k_codes.size(0) &&
                  k_scales.size(1) > 0 && bs % k_scales.size(1) == 0 && k_scales.size(2) == kvh &&
                  k_scales.size(3) == d,
              "key scales/zeros must be contiguous fp16 [N, bs / G, kvh, d]");
  TORCH_CHECK(v_scales.dim() == 4 && v_scales.sizes() == v_zeros.sizes() && v_scales.is_contiguous() &&
                  v_zeros.is_contiguous() && v_scales.scalar_type() == at::kHalf &&
                  v_zeros.scalar_type() == at::kHalf && v_scales.size(0) == k_codes.size(0) &&
                  v_scales.size(1) == bs && v_scales.size(2) == kvh && v_scales.size(3) > 0 &&
                  d % v_scales.size(3) == 0,
              "value scales/zeros must be contiguous fp16 [N, bs, kvh, d / G]");
  return {k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(), k_scales.data_ptr<at::Half>(),
          k_zeros.data_ptr<at::Half>(), v_scales.data_ptr<at::Half>(), v_zeros.data_ptr<at::Half>(), width * 8 / d};
}

// A packed code row -> fp32 codes in channel order (contiguous parts: vector shifts). D > 0: head_dim
// known at compile time; D == 0: the runtime d.
template <int B, int D>
inline void unpack_codes(const uint8_t* __restrict c, float* __restrict dst, int64_t d) {
  constexpr int P = 8 / B, mask = (1 << B) - 1;
  const int64_t part = (D > 0 ? D : d) / P;
  for (int j = 0; j < P; ++j)
    for (int64_t i = 0; i < part; ++i) dst[j * part + i] = static_cast<float>((c[i] >> (j * B)) & mask);
}

// codes += lo / 4 - 3 / 8 for a 2-bit low plane `low` (tiered's middle band).
template <int D>
inline void add_low_plane(const uint8_t* __restrict low, float* __restrict codes, float* __restrict tmp, int64_t d) {
  unpack_codes<2, D>(low, tmp, d);
  for (int64_t i = 0; i < (D > 0 ? D : d); ++i) codes[i] += 0.25f * tmp[i] - 0.375f;
}
