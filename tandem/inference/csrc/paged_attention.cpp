// Decode attention over a paged KV cache on CPU, reading keys and values where they lie.
//
// One call serves one pass of cascade decode attention (tandem/inference/paged_attention.py): a
// set of tasks, each R query rows (sequences) over the same keys. For task u and KV head h it
// returns, per query row (R rows x G query heads of that KV head), the running max of the scores
// m, the normaliser den = sum exp(s - m) and o = sum exp(s - m) * v, all in float32; the caller
// combines passes by log-sum-exp and divides. Keys are visited one cache block at a time (scores
// of the block, one rescale per block): nothing is gathered or copied, and nothing is rounded to
// the cache's dtype after it is read (bf16 values are widened in registers).
//
// The key cache stores each block transposed ([D][block_size]), so 16 keys' values of one head
// dim are one vector: a row's 16 scores are D vector multiply-adds (four independent chains, no
// horizontal sums) and their exponentials one polynomial (`exp16`, within 2 ulp of expf). The
// weighted sums of values run for up to four query rows at once (`accumulate_values`): each value
// vector is read, and for bf16 widened, once for all of them, and 64 output dims per row stay in
// registers across the block's keys. Each row's arithmetic is the same whatever rows share its
// task (batch-invariant). Measured against the previous kernel (scalar dot products and expf,
// blocks copied to float32 first) on the medium preset's decode shapes (256 sequences in 64 groups
// of 4, one layer, 2 threads): 2.32-2.41 -> 1.09-1.19 ms in float32, 1.94-1.96 -> 0.88-0.90 ms in bf16.
//
// qv      [B, H_kv, G, D] float32, already multiplied by the softmax scale
// k       [H_kv, num_blocks, D, block_size], v [H_kv, num_blocks, block_size, D]: float32 or
//         bfloat16, contiguous (any block_size; a multiple of 16 reads whole vectors)
// rows    [U, R] int64: the sequence (index into qv) of each task row (padding rows repeat one)
// blocks  [U, MB] int64: each task's key blocks in order (entries past its keys are not read)
// nkeys   [U] int64: each task's key count (>= 1)
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t W = 16;  // keys per score tile (one AVX-512 register of float32)
constexpr int64_t RB = 4;  // query rows whose value sums share one read of the values
typedef float f16v __attribute__((vector_size(W * sizeof(float))));
typedef int32_t i16v __attribute__((vector_size(W * sizeof(int32_t))));

// exp of 16 floats <= 0 (Cephes' expf: x = n ln2 + g, exp(g) by a degree-7 polynomial, times 2^n).
// Inputs below -87 give ~1e-38 instead of a smaller number or 0: scores here are at most 0 after
// the row max is subtracted and the row's maximum contributes exp(0) = 1, so this is immaterial.
inline f16v exp16(f16v x) {
  const f16v lo = f16v{} - 87.0f;
  x = x < lo ? lo : x;
  const f16v fx = x * 1.44269504088896341f + 0.5f;
  f16v n = __builtin_convertvector(__builtin_convertvector(fx, i16v), f16v);  // truncation toward 0
  n = n > fx ? n - 1.0f : n;  // floor(fx), fx may be negative
  const f16v g = x - n * 0.693359375f + n * 2.12194440e-4f;
  f16v y = f16v{} + 1.9875691500e-4f;
  y = y * g + 1.3981999507e-3f;
  y = y * g + 8.3334519073e-3f;
  y = y * g + 4.1665795894e-2f;
  y = y * g + 1.6666665459e-1f;
  y = y * g + 5.0000001201e-1f;
  y = y * g * g + g + 1.0f;
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  return y * reinterpret_cast<const f16v&>(bits);
}

inline f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f16v load16(const at::BFloat16* p) {  // bf16 is the high half of a float32
  typedef uint16_t u16v __attribute__((vector_size(W * sizeof(uint16_t))));
  u16v h;
  std::memcpy(&h, p, sizeof(h));
  const i16v bits = __builtin_convertvector(h, i16v) << 16;
  return reinterpret_cast<const f16v&>(bits);
}

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

template <typename T>
void attend_pass_impl(const at::Tensor& qv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& rows, const at::Tensor& blocks, const at::Tensor& nkeys,
                      at::Tensor& m_out, at::Tensor& den_out, at::Tensor& o_out) {
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
  float* m_all = m_out.data_ptr<float>();
  float* den_all = den_out.data_ptr<float>();
  float* o_all = o_out.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, num_tasks * h_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<f16v> s(RB * tiles);  // per row of a group: the block's scores, then probabilities
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
        const int64_t used = (n + W - 1) / W;
        // Scores and softmax statistics row by row, then the weighted value sums for up to four
        // rows at once: each value vector is read (and, for bf16, widened) once for all of them.
        for (int64_t q0 = 0; q0 < rg; q0 += RB) {
          const int64_t nr = std::min(RB, rg - q0);
          float factor[RB];
          for (int64_t i = 0; i < nr; ++i) {
            const int64_t qi = q0 + i;
            const float* qp = qrow[qi];
            f16v* sr = s.data() + i * tiles;
            for (int64_t j = 0; j < used; ++j) {
              const T* kp = kb + j * W;  // keys 16j.. of dim x at kp[x * bs]: the block is stored [D][block_size]
              f16v acc0{}, acc1{}, acc2{}, acc3{};  // four chains: one multiply-add's latency is hidden
              int64_t x = 0;
              if ((j + 1) * W <= bs) {
                for (; x + 4 <= d; x += 4) {
                  acc0 += qp[x] * load16(kp + x * bs);
                  acc1 += qp[x + 1] * load16(kp + (x + 1) * bs);
                  acc2 += qp[x + 2] * load16(kp + (x + 2) * bs);
                  acc3 += qp[x + 3] * load16(kp + (x + 3) * bs);
                }
                for (; x < d; ++x) acc0 += qp[x] * load16(kp + x * bs);
              } else {  // a block_size that is not a multiple of 16: its last tile is partial
                for (; x < d; ++x) acc0 += qp[x] * load_partial(kp + x * bs, bs - j * W);
              }
              sr[j] = (acc0 + acc1) + (acc2 + acc3);
            }
            float block_max = neg_inf;
            for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sr[t / W][t % W]);
            const float m_new = std::max(m[qi], block_max);
            factor[i] = std::exp(m[qi] - m_new);  // 0 on the first block (m = -inf)
            float sum = 0.0f;
            for (int64_t j = 0; j < used; ++j) sr[j] = exp16(sr[j] - m_new);
            for (int64_t t = 0; t < n; ++t) sum += sr[t / W][t % W];
            den[qi] = den[qi] * factor[i] + sum;
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
    }
  });
}

std::vector<at::Tensor> attend_pass(const at::Tensor& qv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& rows, const at::Tensor& blocks, const at::Tensor& nkeys) {
  TORCH_CHECK(qv.dim() == 4 && qv.scalar_type() == at::kFloat && qv.is_contiguous(),
              "qv must be a contiguous float32 [B, H_kv, G, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2) && k_cache.scalar_type() == v_cache.scalar_type(),
              "k and v caches must be contiguous [H_kv, num_blocks, D, block_size] and [H_kv, num_blocks, block_size, D] "
              "tensors of one dtype");
  TORCH_CHECK(qv.size(1) == v_cache.size(0) && qv.size(3) == v_cache.size(3), "qv and the caches disagree on H_kv or D");
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
  mod.def("attend_pass", &attend_pass, "one pass of cascade decode attention over a paged KV cache (CPU)");
  mod.def("write_kv", &write_kv, "the step's keys and values into their cache slots (CPU)");
}
