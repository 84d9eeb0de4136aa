// Attention over a paged KV cache on CPU (decode and prefill), reading keys and values where they lie.
//
// One call serves a step's attention for one layer (tandem/inference/paged_attention.py): for a
// decode, its passes of cascade decode attention; for a prefill, one pass whose tasks are runs of
// a sequence's new tokens, each row with its own causal key count. A pass is a set of tasks, each
// task R query rows (sequences, or tokens) over the same keys. For task u and KV head h a pass
// computes, per query row (R rows x G query heads of that KV head), the running max of the scores
// m, the normaliser den = sum exp(s - m) and o = sum exp(s - m) * v, all in float32, and folds
// them into the row's query by log-sum-exp; the call returns o / den per query. Keys are visited
// one cache block at a time (scores of the block, one rescale per block): nothing is gathered or
// copied, and nothing is rounded to the cache's dtype after it is read (bf16 values are widened in
// registers).
//
// The key cache stores each block transposed ([D][block_size]), so 16 keys' values of one head
// dim are one vector: a row's 16 scores are D vector multiply-adds (four independent chains, no
// horizontal sums; four rows per read of the keys) and their exponentials one polynomial (`exp16`
// in vec16.h, within 2 ulp of expf). The weighted sums of values run for up to four query rows at
// once (`accumulate_values`): each value vector is read, and for bf16 widened, once for all of
// them, and 64 output dims per row stay in registers across the block's keys. Each row's
// arithmetic is the same whatever rows share its task (batch-invariant). Measured against the
// previous kernel (scalar dot products and expf, blocks copied to float32 first) on the medium
// preset's decode shapes (256 sequences in 64 groups of 4, one layer, 2 threads): 2.32-2.41 ->
// 1.09-1.19 ms in float32, 1.94-1.96 -> 0.88-0.90 ms in bf16.
//
// qv      [N, H_kv, G, D] float32 query rows (sequences or tokens), already multiplied by the softmax scale
// k       [H_kv, num_blocks, D, block_size], v [H_kv, num_blocks, block_size, D]: float32 or
//         bfloat16, contiguous (any block_size; a multiple of 16 reads whole vectors)
// passes  [(rows, blocks, nkeys[, row_keys])], per pass:
//   rows      [U, R] int64: the query row (index into qv) of each task row (padding rows repeat the first)
//   blocks    [U, MB] int64: each task's key blocks in order (entries past its keys are not read)
//   nkeys     [U] int64: each task's key count (>= 1)
//   row_keys  [U, R] int64, optional: each task row's own key count (1..nkeys; causal prefill)
// -> [N, H_kv, G, D] float32: each query's attention output
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using tandem_vec::W;
using tandem_vec::f16v;
using tandem_vec::exp16_or_zero;
using tandem_vec::hmax;
using tandem_vec::hsum;
using tandem_vec::load16;

const f16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

constexpr int64_t RB = 4;  // query rows whose value sums share one read of the values

template <typename T>
inline f16v load_partial(const T* p, int64_t count) {  // lanes past count are 0
  f16v v{};
  for (int64_t l = 0; l < count; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}

// o_i = o_i * factor_i + sum_t p_i[t] v_t for NR rows (o rows of `d` floats, p_i = s[i * tiles ..]),
// over the block's n value rows: 64 dims at a time in NR x 4 registers, then 16, then single dims.
template <typename T, int NR>
inline void accumulate_values(float* o, int64_t d, const f16v* s, int64_t tiles, const float* factor, const T* vb,
                              int64_t n) {
  int64_t x = 0;
  for (; x + 4 * W <= d; x += 4 * W) {
    f16v a[NR][4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[i][c] = load16(o + i * d + x + c * W) * factor[i];
    for (int64_t t = 0; t < n; ++t) {
      const T* vp = vb + t * d + x;
      const f16v v0 = load16(vp), v1 = load16(vp + W), v2 = load16(vp + 2 * W), v3 = load16(vp + 3 * W);
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) {
        const float p = s[i * tiles + t / W][t % W];
        a[i][0] += p * v0;
        a[i][1] += p * v1;
        a[i][2] += p * v2;
        a[i][3] += p * v3;
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) std::memcpy(o + i * d + x + c * W, &a[i][c], sizeof(f16v));
  }
  for (; x + W <= d; x += W) {
    for (int i = 0; i < NR; ++i) {
      f16v acc = load16(o + i * d + x) * factor[i];
      for (int64_t t = 0; t < n; ++t) acc += s[i * tiles + t / W][t % W] * load16(vb + t * d + x);
      std::memcpy(o + i * d + x, &acc, sizeof(acc));
    }
  }
  for (; x < d; ++x) {  // head dims past a multiple of 16
    for (int i = 0; i < NR; ++i) {
      float acc = o[i * d + x] * factor[i];
      for (int64_t t = 0; t < n; ++t) acc += s[i * tiles + t / W][t % W] * static_cast<float>(vb[t * d + x]);
      o[i * d + x] = acc;
    }
  }
}

// The scores of NR query rows (qp[i], D floats each) against the block's keys: s[i * tiles + j] holds
// keys 16j.. of row i. Each key vector is read once for all NR rows; each row's sum runs in four
// chains over the head dims (x mod 4), the same order whatever NR is (batch-invariant).
template <typename T, int NR>
inline void block_scores(const float* const* qp, const T* kb, int64_t bs, int64_t d, int64_t used, int64_t tiles,
                         f16v* s) {
  for (int64_t j = 0; j < used; ++j) {
    const T* kp = kb + j * W;  // keys 16j.. of dim x at kp[x * bs]: the block is stored [D][block_size]
    if ((j + 1) * W > bs) {  // a block_size that is not a multiple of 16: its last tile is partial
      for (int i = 0; i < NR; ++i) {
        f16v acc{};
        for (int64_t x = 0; x < d; ++x) acc += qp[i][x] * load_partial(kp + x * bs, bs - j * W);
        s[i * tiles + j] = acc;
      }
      continue;
    }
    f16v acc[NR][4] = {};  // four chains a row: one multiply-add's latency is hidden
    int64_t x = 0;
    for (; x + 4 <= d; x += 4) {
      const f16v k0 = load16(kp + x * bs), k1 = load16(kp + (x + 1) * bs);
      const f16v k2 = load16(kp + (x + 2) * bs), k3 = load16(kp + (x + 3) * bs);
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) {
        acc[i][0] += qp[i][x] * k0;
        acc[i][1] += qp[i][x + 1] * k1;
        acc[i][2] += qp[i][x + 2] * k2;
        acc[i][3] += qp[i][x + 3] * k3;
      }
    }
    for (; x < d; ++x) {
      const f16v k = load16(kp + x * bs);
      for (int i = 0; i < NR; ++i) acc[i][0] += qp[i][x] * k;
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) s[i * tiles + j] = (acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]);
  }
}

// One pass: every task's rows over its keys, each row's (m, den, o) then folded into its sequence's
// running state (m_s, den_s, o_s: [B, H_kv, G(, D)]) by log-sum-exp. A sequence has one task row
// per pass (rows past a group's members repeat its first and are skipped), so items never write
// the same state.
template <typename T>
void attend_pass_impl(const at::Tensor& qv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& rows, const at::Tensor& blocks, const at::Tensor& nkeys,
                      const int64_t* row_keys, at::Tensor& m_state, at::Tensor& den_state, at::Tensor& o_state) {
  const int64_t h_kv = v_cache.size(0), num_blocks = v_cache.size(1), bs = v_cache.size(2), d = v_cache.size(3);
  const int64_t g = qv.size(2), num_tasks = rows.size(0), r = rows.size(1), mb = blocks.size(1);
  const int64_t rg = r * g;
  const int64_t tiles = (bs + W - 1) / W;
  const float* q = qv.data_ptr<float>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t* row_seq = rows.data_ptr<int64_t>();
  const int64_t* blk = blocks.data_ptr<int64_t>();
  const int64_t* nk = nkeys.data_ptr<int64_t>();
  float* m_s = m_state.data_ptr<float>();
  float* den_s = den_state.data_ptr<float>();
  float* o_s = o_state.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, num_tasks * h_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<f16v> s(RB * tiles);  // per row of a group: the block's scores, then probabilities
    std::vector<const float*> qrow(rg);
    std::vector<float> m_buf(rg), den_buf(rg), o_buf(rg * d);  // this item's rows
    float* m = m_buf.data();
    float* den = den_buf.data();
    float* o = o_buf.data();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t u = item / h_kv, h = item % h_kv;
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
        const int64_t used = (n + W - 1) / W;
        // Scores of up to four rows at once (each key vector read, and for bf16 widened, once for
        // all of them), their softmax statistics, then their weighted value sums (each value
        // vector read once for all of them).
        for (int64_t q0 = 0; q0 < rg; q0 += RB) {
          const int64_t nr = std::min(RB, rg - q0);
          int64_t row_n[RB];  // each row's keys in this block: n, or fewer (even none) under a causal limit
          int64_t most = 0;
          for (int64_t i = 0; i < nr; ++i) {
            row_n[i] = row_keys == nullptr ? n : std::min(n, row_keys[u * r + (q0 + i) / g] - start);
            most = std::max(most, row_n[i]);
          }
          if (most <= 0) continue;  // past every row's limit: nothing changes for these rows
          switch (nr) {
            case 4: block_scores<T, 4>(qrow.data() + q0, kb, bs, d, used, tiles, s.data()); break;
            case 3: block_scores<T, 3>(qrow.data() + q0, kb, bs, d, used, tiles, s.data()); break;
            case 2: block_scores<T, 2>(qrow.data() + q0, kb, bs, d, used, tiles, s.data()); break;
            default: block_scores<T, 1>(qrow.data() + q0, kb, bs, d, used, tiles, s.data()); break;
          }
          float factor[RB];
          for (int64_t i = 0; i < nr; ++i) {
            const int64_t qi = q0 + i;
            f16v* sr = s.data() + i * tiles;
            if (row_n[i] < used * W) {  // keys past the row's count score -inf (weight 0)
              for (int64_t j = 0; j < used; ++j)
                sr[j] = lane < f16v{} + static_cast<float>(row_n[i] - j * W) ? sr[j] : f16v{} + neg_inf;
            }
            f16v top = sr[0];
            for (int64_t j = 1; j < used; ++j) top = sr[j] > top ? sr[j] : top;
            const float m_new = std::max(m[qi], hmax(top));
            factor[i] = std::exp(m[qi] - m_new);  // 0 on the first block (m = -inf)
            const f16v mv = f16v{} + m_new;
            f16v sum{};
            for (int64_t j = 0; j < used; ++j) sum += (sr[j] = exp16_or_zero(sr[j] - mv));
            den[qi] = den[qi] * factor[i] + hsum(sum);
            m[qi] = m_new;
          }
          switch (nr) {
            case 4: accumulate_values<T, 4>(o + q0 * d, d, s.data(), tiles, factor, vb, n); break;
            case 3: accumulate_values<T, 3>(o + q0 * d, d, s.data(), tiles, factor, vb, n); break;
            case 2: accumulate_values<T, 2>(o + q0 * d, d, s.data(), tiles, factor, vb, n); break;
            default: accumulate_values<T, 1>(o + q0 * d, d, s.data(), tiles, factor, vb, n); break;
          }
        }
      }
      for (int64_t i = 0; i < r; ++i) {
        const int64_t seq = row_seq[u * r + i];
        if (i > 0 && seq == row_seq[u * r]) continue;  // a padding row
        for (int64_t j = 0; j < g; ++j) {
          const int64_t qi = i * g + j, at = (seq * h_kv + h) * g + j;
          const float m_new = std::max(m_s[at], m[qi]);  // finite: every row saw a key
          const float w = std::exp(m_s[at] - m_new), w2 = std::exp(m[qi] - m_new);  // w = 0 on a first pass
          den_s[at] = den_s[at] * w + den[qi] * w2;
          float* os = o_s + at * d;
          const float* oi = o + qi * d;
          for (int64_t x = 0; x < d; ++x) os[x] = os[x] * w + oi[x] * w2;
          m_s[at] = m_new;
        }
      }
    }
  });
}

at::Tensor attend(const at::Tensor& qv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const std::vector<std::vector<at::Tensor>>& passes) {
  TORCH_CHECK(qv.dim() == 4 && qv.scalar_type() == at::kFloat && qv.is_contiguous(),
              "qv must be a contiguous float32 [N, H_kv, G, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2) && k_cache.scalar_type() == v_cache.scalar_type(),
              "k and v caches must be contiguous [H_kv, num_blocks, D, block_size] and [H_kv, num_blocks, block_size, D] "
              "tensors of one dtype");
  TORCH_CHECK(qv.size(1) == v_cache.size(0) && qv.size(3) == v_cache.size(3), "qv and the caches disagree on H_kv or D");
  TORCH_CHECK(!passes.empty(), "paged attention needs at least one pass");
  const int64_t num_rows = qv.size(0);
  for (const auto& p : passes) {
    TORCH_CHECK(p.size() == 3 || p.size() == 4, "a pass is (rows, blocks, nkeys) or (rows, blocks, nkeys, row_keys)");
    const at::Tensor &rows = p[0], &blocks = p[1], &nkeys = p[2];
    TORCH_CHECK(rows.scalar_type() == at::kLong && blocks.scalar_type() == at::kLong && nkeys.scalar_type() == at::kLong &&
                    rows.is_contiguous() && blocks.is_contiguous() && nkeys.is_contiguous(),
                "rows, blocks and nkeys must be contiguous int64 tensors");
    TORCH_CHECK(rows.dim() == 2 && blocks.dim() == 2 && rows.size(0) == blocks.size(0) && rows.size(0) == nkeys.size(0),
                "rows, blocks and nkeys need one row per task");
    const int64_t* seq = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i)
      TORCH_CHECK(seq[i] >= 0 && seq[i] < num_rows, "a task row names sequence ", seq[i], ", outside qv's ", num_rows);
    const int64_t* nk = nkeys.data_ptr<int64_t>();
    for (int64_t i = 0; i < nkeys.numel(); ++i) TORCH_CHECK(nk[i] >= 1, "task ", i, " has no key");
    TORCH_CHECK(nkeys.numel() == 0 || blocks.size(1) * v_cache.size(2) >= *std::max_element(nk, nk + nkeys.numel()),
                "a task has more keys than its blocks hold");
    if (p.size() == 4) {
      const at::Tensor& row_keys = p[3];
      TORCH_CHECK(row_keys.scalar_type() == at::kLong && row_keys.is_contiguous() && row_keys.sizes() == rows.sizes(),
                  "row_keys must be a contiguous int64 tensor shaped like rows");
      const int64_t* rk = row_keys.data_ptr<int64_t>();
      for (int64_t i = 0; i < row_keys.numel(); ++i)
        TORCH_CHECK(rk[i] >= 1 && rk[i] <= nk[i / rows.size(1)], "row_keys[", i, "] = ", rk[i],
                    " is outside 1..its task's nkeys");
    }
  }
  auto opts = qv.options();
  at::Tensor m = at::full({qv.size(0), qv.size(1), qv.size(2)}, -std::numeric_limits<float>::infinity(), opts);
  at::Tensor den = at::zeros_like(m), o = at::zeros_like(qv);
  for (const auto& p : passes) {
    const int64_t* rk = p.size() == 4 ? p[3].data_ptr<int64_t>() : nullptr;
    if (k_cache.scalar_type() == at::kFloat) {
      attend_pass_impl<float>(qv, k_cache, v_cache, p[0], p[1], p[2], rk, m, den, o);
    } else if (k_cache.scalar_type() == at::kBFloat16) {
      attend_pass_impl<at::BFloat16>(qv, k_cache, v_cache, p[0], p[1], p[2], rk, m, den, o);
    } else {
      TORCH_CHECK(false, "paged attention: cache dtype ", k_cache.scalar_type(), " is not float32 or bfloat16");
    }
  }
  return o.div_(den.unsqueeze(-1));
}

template <typename T>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slots) {
  const int64_t n = k.size(0), h_kv = k.size(1), d = k.size(2);
  const int64_t num_blocks = v_cache.size(1), bs = v_cache.size(2);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_blocks * bs, "write_kv: slot ", slot[t], " out of range");
  at::parallel_for(0, n * h_kv, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / h_kv, h = item % h_kv;
      const int64_t block = slot[t] / bs, off = slot[t] % bs;
      const T* ks = kp + (t * h_kv + h) * d;
      T* kd = kc + (h * num_blocks + block) * d * bs + off;  // key column `off` of the block
      for (int64_t x = 0; x < d; ++x) kd[x * bs] = ks[x];
      std::memcpy(vc + ((h * num_blocks + block) * bs + off) * d, vp + (t * h_kv + h) * d, d * sizeof(T));
    }
  });
}

// k, v [T, H_kv, D] into their slots (block * block_size + offset) of the caches (layouts as above).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous(),
              "write_kv: k and v must be contiguous [T, H_kv, D] tensors of one shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  v_cache.size(0) == k.size(1) && v_cache.size(3) == k.size(2) && k_cache.size(2) == k.size(2) &&
                  k_cache.size(3) == v_cache.size(2),
              "write_kv: the caches must be contiguous, of k's dtype, [H_kv, blocks, D, block_size] and "
              "[H_kv, blocks, block_size, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == k.size(0),
              "write_kv: slots must be a contiguous int64 tensor, one per token");
  if (k.scalar_type() == at::kFloat) {
    write_kv_impl<float>(k, v, k_cache, v_cache, slots);
  } else if (k.scalar_type() == at::kBFloat16) {
    write_kv_impl<at::BFloat16>(k, v, k_cache, v_cache, slots);
  } else {
    TORCH_CHECK(false, "write_kv: dtype ", k.scalar_type(), " is not float32 or bfloat16");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("attend", &attend, "attention of query rows over a paged KV cache, passes merged by log-sum-exp (CPU)");
  mod.def("write_kv", &write_kv, "the step's keys and values into their cache slots (CPU)");
}
