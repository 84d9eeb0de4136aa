// Decode attention over a paged KV cache on CPU, reading keys and values where they lie.
//
// One call serves one pass of cascade decode attention (tandem/inference/paged_attention.py): a
// set of tasks, each R query rows (sequences) over the same keys. For task u and KV head h it
// returns, per query row (R rows x G query heads of that KV head), the running max of the scores
// m, the normaliser den = sum exp(s - m) and o = sum exp(s - m) * v, all in float32; the caller
// combines passes by log-sum-exp and divides. Keys are visited one cache block at a time (scores
// of the block, one rescale per block): nothing is gathered into a new tensor, and nothing is
// rounded to the cache's dtype after it is read (bf16 blocks are widened as they are read).
//
// qv      [B, H_kv, G, D] float32, already multiplied by the softmax scale
// k, v    [H_kv, num_blocks, block_size, D], float32 or bfloat16, contiguous
// rows    [U, R] int64: the sequence (index into qv) of each task row (padding rows repeat one)
// blocks  [U, MB] int64: each task's key blocks in order (entries past its keys are not read)
// nkeys   [U] int64: each task's key count (>= 1)
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename T>
void attend_pass_impl(const at::Tensor& qv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& rows, const at::Tensor& blocks, const at::Tensor& nkeys,
                      at::Tensor& m_out, at::Tensor& den_out, at::Tensor& o_out) {
  const int64_t h_kv = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2), d = k_cache.size(3);
  const int64_t g = qv.size(2), num_tasks = rows.size(0), r = rows.size(1), mb = blocks.size(1);
  const int64_t rg = r * g;
  const float* q = qv.data_ptr<float>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t* row_seq = rows.data_ptr<int64_t>();
  const int64_t* blk = blocks.data_ptr<int64_t>();
  const int64_t* nk = nkeys.data_ptr<int64_t>();
  float* m_all = m_out.data_ptr<float>();
  float* den_all = den_out.data_ptr<float>();
  float* o_all = o_out.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, num_tasks * h_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(bs);
    std::vector<float> kf(bs * d), vf(bs * d);  // the block's keys and values as float32
    std::vector<const float*> qrow(rg);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t u = item / h_kv, h = item % h_kv;
      float* m = m_all + (h * num_tasks + u) * rg;
      float* den = den_all + (h * num_tasks + u) * rg;
      float* o = o_all + (h * num_tasks + u) * rg * d;
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < g; ++j) qrow[i * g + j] = q + ((row_seq[u * r + i] * h_kv + h) * g + j) * d;
      std::fill(m, m + rg, neg_inf);
      std::fill(den, den + rg, 0.0f);
      std::fill(o, o + rg * d, 0.0f);
      const int64_t keys = nk[u];
      for (int64_t start = 0; start < keys; start += bs) {
        const int64_t block = blk[u * mb + start / bs];
        TORCH_CHECK(block >= 0 && block < num_blocks, "paged attention: block id ", block, " out of range");
        const int64_t n = std::min(bs, keys - start);
        const T* kb = kc + (h * num_blocks + block) * bs * d;
        const T* vb = vc + (h * num_blocks + block) * bs * d;
        // Widened (or, for float32, copied) once per block for all the task's query rows: reading
        // float32 blocks in place measured 20% slower than this copy.
        for (int64_t e = 0; e < n * d; ++e) {
          kf[e] = static_cast<float>(kb[e]);
          vf[e] = static_cast<float>(vb[e]);
        }
        const float* kp0 = kf.data();
        const float* vp0 = vf.data();
        for (int64_t qi = 0; qi < rg; ++qi) {
          const float* qp = qrow[qi];
          float* sp = s.data();
          float block_max = neg_inf;
          for (int64_t t = 0; t < n; ++t) {
            const float* kp = kp0 + t * d;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t x = 0; x < d; ++x) acc += qp[x] * kp[x];
            sp[t] = acc;
            block_max = std::max(block_max, acc);
          }
          const float m_new = std::max(m[qi], block_max);
          const float factor = std::exp(m[qi] - m_new);  // 0 on the first block (m = -inf)
          float sum = 0.0f;
          for (int64_t t = 0; t < n; ++t) {
            sp[t] = std::exp(sp[t] - m_new);
            sum += sp[t];
          }
          den[qi] = den[qi] * factor + sum;
          m[qi] = m_new;
          float* op = o + qi * d;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) op[x] *= factor;
          for (int64_t t = 0; t < n; ++t) {
            const float p = sp[t];
            const float* vp = vp0 + t * d;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) op[x] += p * vp[x];
          }
        }
      }
    }
  });
}

std::vector<at::Tensor> attend_pass(const at::Tensor& qv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& rows, const at::Tensor& blocks, const at::Tensor& nkeys) {
  TORCH_CHECK(qv.dim() == 4 && qv.scalar_type() == at::kFloat && qv.is_contiguous(),
              "qv must be a contiguous float32 [B, H_kv, G, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k and v caches must be contiguous [H_kv, num_blocks, block_size, D] tensors of one dtype");
  TORCH_CHECK(qv.size(1) == k_cache.size(0) && qv.size(3) == k_cache.size(3), "qv and the caches disagree on H_kv or D");
  TORCH_CHECK(rows.scalar_type() == at::kLong && blocks.scalar_type() == at::kLong && nkeys.scalar_type() == at::kLong &&
                  rows.is_contiguous() && blocks.is_contiguous() && nkeys.is_contiguous(),
              "rows, blocks and nkeys must be contiguous int64 tensors");
  TORCH_CHECK(rows.size(0) == blocks.size(0) && rows.size(0) == nkeys.size(0), "rows, blocks and nkeys need one row per task");
  const int64_t h_kv = k_cache.size(0), u = rows.size(0), rg = rows.size(1) * qv.size(2), d = qv.size(3);
  auto opts = qv.options();
  at::Tensor m = at::empty({h_kv, u, rg}, opts), den = at::empty({h_kv, u, rg}, opts), o = at::empty({h_kv, u, rg, d}, opts);
  if (k_cache.scalar_type() == at::kFloat) {
    attend_pass_impl<float>(qv, k_cache, v_cache, rows, blocks, nkeys, m, den, o);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    attend_pass_impl<at::BFloat16>(qv, k_cache, v_cache, rows, blocks, nkeys, m, den, o);
  } else {
    TORCH_CHECK(false, "paged attention: cache dtype ", k_cache.scalar_type(), " is not float32 or bfloat16");
  }
  return {m, den, o};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("attend_pass", &attend_pass, "one pass of cascade decode attention over a paged KV cache (CPU)");
}
