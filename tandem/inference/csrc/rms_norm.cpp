// RMSNorm in one pass over each row, for serving (tandem/inference/fused_norm.py).
//
// The same arithmetic as tandem.models.common.RMSNorm (HF Qwen's): the mean of squares in float32,
// h = x * rsqrt(mean + eps) in float32, rounded to the input's dtype, then times the weight (a
// product rounded to that dtype again). Only the sum of squares runs in another order (16 lanes,
// then their sum), so results may differ from the module's by a few float32 ulps (one in bf16: a product rounded after a 1-ulp change); each row's result depends
// on that row alone (batch-invariant). One call replaces the module's eight ATen calls and their
// full-size temporaries (float32 copy, squares, product, casts).
//
// x       [A, B, D] float32 or bfloat16, last dim contiguous (any strides over A and B: the q and k
//         heads of a fused projection are views), weight [D] of x's dtype -> [A, B, D] contiguous
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// float <-> bf16 on raw bits, written so the compiler vectorises them (c10::BFloat16's conversions
// are per element calls); rounding to nearest even, as c10's, and NaN stays NaN.
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {
  uint16_t h;
  std::memcpy(&h, &v, 2);
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline T narrow(float f);
template <>
inline float narrow<float>(float f) { return f; }
template <>
inline at::BFloat16 narrow<at::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint16_t h = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  at::BFloat16 out;
  std::memcpy(&out, &h, 2);
  return out;
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t a = x.size(0), b = x.size(1), d = x.size(2);
  const int64_t sa = x.stride(0), sb = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, a * b, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = xp + (row / b) * sa + (row % b) * sb;
      T* orow = op + row * d;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < d; ++i) {
        const float v = widen(xr[i]);
        ss += v * v;
      }
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + feps);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float h = widen(narrow<T>(widen(xr[i]) * r));  // rounded to x's dtype, as HF does
        orow[i] = narrow<T>(widen(wp[i]) * h);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rms_norm: x must be [A, B, D] with a contiguous last dim");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(2) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [D] tensor of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x, weight, eps, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_norm_impl<at::BFloat16>(x, weight, eps, out);
  } else {
    TORCH_CHECK(false, "rms_norm: dtype ", x.scalar_type(), " is not float32 or bfloat16");
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("rms_norm", &rms_norm, "RMSNorm of each row, one pass (CPU)");
}
