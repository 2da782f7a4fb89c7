// add_rms_norm -- residual += x; x = rms_norm(residual) * weight, in one pass per
// row (vLLM's fused_add_rms_norm): at batch 1 the eager torch version is ~10 ops
// of a few microseconds each, 61 times a step.
//
// rotary_embedding -- HF's rotate_half RoPE, in place on q and k together.
// silu_and_mul -- silu(gate) * up from the fused gate_up projection.
// All three compute in fp32 and round once to the storage dtype.

// threefold-exports: add_rms_norm rotary_embedding silu_and_mul

#include "kernel_common.h"

#include <cmath>
#include <cstdint>
#include <vector>

using threefold::to_float;

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
