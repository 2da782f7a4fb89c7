// The blocks of a KIVI cache layer (kv/codecs/kivi.py), checked alike by every kernel that reads or
// writes them (kivi_attention.cpp, kivi_prefill.cpp): codes [N, bs, kvh, d * bits / 8] uint8 with bits 2
// or 4, key scales / zeros fp16 [N, bs / G, kvh, d], value scales / zeros fp16 [N, bs, kvh, d / VG], all
// contiguous.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Returns the codes' bits.
inline int64_t check_kivi_blocks(const at::Tensor& k_codes, const at::Tensor& v_codes, const at::Tensor& k_scales,
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
  return width * 8 / d;
}
