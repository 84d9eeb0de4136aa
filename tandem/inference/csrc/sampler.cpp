// The sampler's inverse-CDF draw in one pass per row (tandem/inference/sampler.py, `draw`).
//
// The same two-level search as sampler._draw, the PyTorch form: e = exp(x - max) per token,
// sums of `width`-token blocks in float64 and their running sum locate the block holding the
// target mass u * total, then a float64 running sum inside that block locates the token (the first
// running sum strictly above the target; targets stay strictly below the total, so a token of zero
// mass, -inf in x, is never returned). Each row is read twice while it sits in cache (its max, then
// the exponentials and block sums) and nothing is written but its token and normaliser; the
// PyTorch form makes ~6 passes over the whole [B, V] batch with full-size temporaries. The
// exponentials are exp16 (within 2 ulp of expf, where torch's exp is within 1), and the block sums
// add in another order, so a draw may differ from the PyTorch form's where the target lies within
// float rounding of a block or token boundary. Each row's result depends on that row and its
// uniform alone (batch-invariant).
//
// scaled    [B, V] float32, contiguous: logits / T, -inf where filtered (every row has a finite max)
// uniforms  [B] float64 in [0, 1)
// width     tokens per block, a multiple of 16
// -> tokens [B] int64, norm [B] float32: max + log(sum exp(x - max)), the row's log normaliser
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using tandem_vec::W;
using tandem_vec::f16v;
using tandem_vec::exp16_or_zero;
using tandem_vec::load16;

typedef double d8v __attribute__((vector_size(8 * sizeof(double))));
typedef float f8v __attribute__((vector_size(8 * sizeof(float))));

inline double lanes_sum(d8v v) {
  double s = 0.0;
  for (int l = 0; l < 8; ++l) s += v[l];
  return s;
}

// e = exp(x - top) for the n (<= width) tokens at x: their float64 sum, and with `running` their
// float64 running sums into running[0..n).
inline double block_exp(const float* x, int64_t n, float top, double* running) {
  const f16v t = f16v{} + top;
  d8v acc{};
  int64_t j = 0;
  double run = 0.0;
  for (; j + W <= n; j += W) {
    const f16v e = exp16_or_zero(load16(x + j) - t);
    if (running != nullptr) {
      for (int l = 0; l < W; ++l) running[j + l] = (run += static_cast<double>(e[l]));
    } else {
      const f8v lo = __builtin_shufflevector(e, e, 0, 1, 2, 3, 4, 5, 6, 7);
      const f8v hi = __builtin_shufflevector(e, e, 8, 9, 10, 11, 12, 13, 14, 15);
      acc += __builtin_convertvector(lo, d8v) + __builtin_convertvector(hi, d8v);
    }
  }
  double sum = running != nullptr ? run : lanes_sum(acc);
  for (; j < n; ++j) {  // a vocabulary past a multiple of 16: its last tokens one by one
    const float e = std::exp(x[j] - top);
    sum += static_cast<double>(e);
    if (running != nullptr) running[j] = sum;
  }
  return sum;
}

void draw_row(const float* x, int64_t vocab, double u, int64_t width, int64_t* token, float* norm,
              std::vector<double>& cdf, std::vector<double>& inner) {
  f16v mv = f16v{} - std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + W <= vocab; j += W) {
    const f16v v = load16(x + j);
    mv = v > mv ? v : mv;
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < W; ++l) top = std::max(top, mv[l]);
  for (; j < vocab; ++j) top = std::max(top, x[j]);

  const int64_t nb = (vocab + width - 1) / width;
  double run = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    run += block_exp(x + b * width, std::min(width, vocab - b * width), top, nullptr);
    cdf[b] = run;
  }
  const double total = cdf[nb - 1];
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  const int64_t blk = std::min<int64_t>(std::upper_bound(cdf.begin(), cdf.begin() + nb, target) - cdf.begin(), nb - 1);
  const double before = blk > 0 ? cdf[blk - 1] : 0.0;
  const int64_t n = std::min(width, vocab - blk * width);
  block_exp(x + blk * width, n, top, inner.data());
  const double rest = std::min(target - before, std::nextafter(inner[n - 1], 0.0));
  const int64_t k = std::min<int64_t>(std::upper_bound(inner.begin(), inner.begin() + n, rest) - inner.begin(), n - 1);
  *token = blk * width + k;
  *norm = top + static_cast<float>(std::log(total));
}

std::vector<at::Tensor> draw(const at::Tensor& scaled, const at::Tensor& uniforms, int64_t width) {
  TORCH_CHECK(scaled.dim() == 2 && scaled.scalar_type() == at::kFloat && scaled.is_contiguous(),
              "draw: scaled must be a contiguous [B, V] float32 tensor");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.scalar_type() == at::kDouble && uniforms.size(0) == scaled.size(0),
              "draw: uniforms must be [B] float64, one per row of scaled");
  TORCH_CHECK(width > 0 && width % W == 0, "draw: width must be a positive multiple of 16, got ", width);
  const int64_t rows = scaled.size(0), vocab = scaled.size(1);
  TORCH_CHECK(vocab > 0, "draw: an empty vocabulary");
  at::Tensor tokens = at::empty({rows}, scaled.options().dtype(at::kLong));
  at::Tensor norm = at::empty({rows}, scaled.options());
  const float* x = scaled.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* nrm = norm.data_ptr<float>();
  const int64_t nb = (vocab + width - 1) / width;
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<double> cdf(nb), inner(width);
    for (int64_t r = begin; r < end; ++r) draw_row(x + r * vocab, vocab, u[r], width, tok + r, nrm + r, cdf, inner);
  });
  return {tokens, norm};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("draw", &draw, "one inverse-CDF draw per row of scaled logits, and each row's log normaliser (CPU)");
}
