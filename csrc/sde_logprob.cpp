// Fused SDE transition log-prob and KL surrogate on CPU tensors (the SDE step and log-prob of
// PaCo-RL/PaCo-GRPO/paco_grpo/diffusers_patch/sde_denoising_step.py; the KL term of compute_ppo_loss
// in PaCo-RL/PaCo-GRPO/scripts/train_flux.py).
//
// One pass over x_t, v and x_{t+1} (or the noise, when sampling) gives the per-sample log-prob
// without any fp32 copy of the latents: elements are widened to fp32 in registers, and the sum of
// squared residuals is accumulated in fp32. Both transitions are affine in (x, v), with
// per-sample coefficients computed once per row in double (`coefficients`):
//
//   mean     = cx * x + cv * v
//   x'       = mean + sd * noise              (sampling, rounded to the dtype of x)
//   log_prob = -k1 * sum((x' - mean)^2) - k0  (sum over the N elements of the sample)
//
// Determinism: every row is cut into fixed chunks of kChunk elements (the parallel tasks); a
// chunk is summed in kLanes independent lanes followed by a fixed tree, and the chunk partials of
// a row by a fixed pairwise tree. The order depends on neither the thread count nor on whether
// the transition is being sampled or scored, so the rollout and training log-probs of the same
// transition are bitwise equal. The build uses -ffp-contract=off so that no FMA contraction
// differs between the sampling and scoring instantiations (or between machines).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kChunk = 4096;  // elements per parallel task (a fixed part of the reduction tree)
constexpr int kLanes = 64;        // independent accumulators per task: 64 terms each, then a tree

// bf16 tensors are handled as their raw uint16_t bits: with c10::BFloat16 values GCC leaves the
// sampling loop scalar (8x slower); plain integers vectorise.
inline float widen(float v) { return v; }
inline float widen(uint16_t bf16_bits) {
  const uint32_t u = static_cast<uint32_t>(bf16_bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float widen(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T narrow(float f);
template <>
inline float narrow<float>(float f) { return f; }
template <>
inline uint16_t narrow<uint16_t>(float f) {
  // fp32 -> bf16 bits, rounded to nearest even exactly as torch's .to(torch.bfloat16); NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? uint16_t{0x7FC0} : rounded;
}
template <>
inline c10::Half narrow<c10::Half>(float f) { return c10::Half(f); }

inline float lane_tree(float* a) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) a[l] += a[l + w];
  return a[0];
}

float pairwise(const float* p, int64_t n) {
  if (n <= 2) return n == 0 ? 0.f : (n == 1 ? p[0] : p[0] + p[1]);
  const int64_t h = n / 2;
  return pairwise(p, h) + pairwise(p + h, n - h);
}

// Runs f(t, b, off, n) for every chunk of every row in parallel: task t is chunk t % nchunk of row
// b = t / nchunk, its n elements starting at element off of the [B, N] tensor. The chunks fix the
// reduction tree, whatever the thread count.
template <typename F>
void over_chunks(int64_t B, int64_t N, F&& f) {
  const int64_t nchunk = (N + kChunk - 1) / kChunk;
  at::parallel_for(0, B * nchunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / nchunk, c = t % nchunk;
      f(t, b, b * N + c * kChunk, std::min(kChunk, N - c * kChunk));
    }
  });
}

struct Row {  // per-sample coefficients of the transition (see the comment at the top)
  float cx, cv, sd, k1, k0, std_t;
};

// The step of sde_denoising_step.py. sig = (sigma, sigma_next, sigma_max) of one sample; N = elements per sample.
// Flow-GRPO: k1 = 1 / (2 N sd^2) and k0 = log(sd) + log(sqrt(2 pi)) make log_prob the mean of the
// elementwise Gaussian log-density; CPS: k1 = 1 / N, k0 = 0 (the unnormalised -mean((x' - mean)^2)).
Row coefficients(const float* sig, double a, int64_t sde_type, int64_t N) {
  const double s = sig[0], sn = sig[1], smax = sig[2];
  double cx, cv, sd, k1, k0, std_t;
  if (sde_type == 0) {
    const double dt = sn - s;
    const double s_safe = s == 1.0 ? smax : s;  // sigma == 1 at step 0: the reference substitutes sigma_max
    std_t = a * std::sqrt(s / (1 - s_safe));
    cx = 1 + std_t * std_t / (2 * s) * dt;
    cv = (1 + std_t * std_t * (1 - s) / (2 * s)) * dt;
    sd = std_t * std::sqrt(-dt);
    k1 = 1 / (2 * static_cast<double>(N) * sd * sd);
    k0 = std::log(sd) + 0.5 * std::log(2 * M_PI);
  } else {
    // mean = (x - s v)(1 - sn) + (x + (1 - s) v) * root, regrouped by x and v
    std_t = sn * std::sin(a * M_PI / 2);
    const double root = std::sqrt(sn * sn - std_t * std_t);
    cx = (1 - sn) + root;
    cv = (1 - s) * root - s * (1 - sn);
    sd = std_t;
    k1 = 1 / static_cast<double>(N);
    k0 = 0;
  }
  return {float(cx), float(cv), float(sd), float(k1), float(k0), float(std_t)};
}

std::vector<Row> rows_of(const at::Tensor& sig, double a, int64_t sde_type, int64_t B, int64_t N) {
  TORCH_CHECK(sig.scalar_type() == at::kFloat && sig.is_contiguous() && sig.dim() == 2 && sig.size(0) == B &&
                  sig.size(1) == 3,
              "sig must be a contiguous float32 [B, 3] tensor (sigma, sigma_next, sigma_max)");
  TORCH_CHECK(sde_type == 0 || sde_type == 1, "sde_type must be 0 (flow_grpo) or 1 (cps)");
  std::vector<Row> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = coefficients(sig.const_data_ptr<float>() + 3 * b, a, sde_type, N);
  return rows;
}

// ---------------------------------------------------------------- SDE log-prob, forward
template <typename T, typename S, bool kSample, bool kMean>
inline __attribute__((always_inline)) float fwd_elem(const T* __restrict__ x, const T* __restrict__ v,
                                                     const S* __restrict__ src, T* __restrict__ prev,
                                                     float* __restrict__ mean, int64_t i, const Row& r) {
  const float mu = r.cx * widen(x[i]) + r.cv * widen(v[i]);
  float xp;
  if constexpr (kSample) {
    // Round x' to the latent dtype first: the log-prob is that of the transition that is stored.
    const T stored = narrow<T>(mu + r.sd * widen(src[i]));
    prev[i] = stored;
    xp = widen(stored);
  } else {
    xp = widen(src[i]);
  }
  if constexpr (kMean) mean[i] = mu;
  const float d = xp - mu;
  return d * d;
}

template <typename T, typename S, bool kSample, bool kMean>
float fwd_chunk(const T* __restrict__ x, const T* __restrict__ v, const S* __restrict__ src, T* __restrict__ prev,
                float* __restrict__ mean, int64_t n, const Row& r) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) acc[l] += fwd_elem<T, S, kSample, kMean>(x, v, src, prev, mean, i + l, r);
  }
  for (int l = 0; i + l < n; ++l) acc[l] += fwd_elem<T, S, kSample, kMean>(x, v, src, prev, mean, i + l, r);
  return lane_tree(acc);
}

template <typename T, typename S, bool kSample, bool kMean>
void fwd_rows(const at::Tensor& x, const at::Tensor& v, const at::Tensor& src, const Row* rows, float* log_prob,
              T* prev, float* mean) {
  const int64_t B = x.size(0), N = x.numel() / B, nchunk = (N + kChunk - 1) / kChunk;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  const T* vp = static_cast<const T*>(v.const_data_ptr());
  const S* sp = static_cast<const S*>(src.const_data_ptr());
  std::vector<float> partial(B * nchunk);
  over_chunks(B, N, [&](int64_t t, int64_t b, int64_t off, int64_t n) {
    partial[t] = fwd_chunk<T, S, kSample, kMean>(xp + off, vp + off, sp + off, prev ? prev + off : nullptr,
                                                 mean ? mean + off : nullptr, n, rows[b]);
  });
  for (int64_t b = 0; b < B; ++b)
    log_prob[b] = -rows[b].k1 * pairwise(partial.data() + b * nchunk, nchunk) - rows[b].k0;
}

template <typename T, typename S>
void fwd_typed(const at::Tensor& x, const at::Tensor& v, const at::Tensor& src, const Row* rows, bool sample,
               float* lp, const std::optional<at::Tensor>& prev, const std::optional<at::Tensor>& mean) {
  T* pp = prev ? static_cast<T*>(prev->mutable_data_ptr()) : nullptr;
  float* mp = mean ? mean->mutable_data_ptr<float>() : nullptr;
  if (sample && mp) fwd_rows<T, S, true, true>(x, v, src, rows, lp, pp, mp);
  else if (sample) fwd_rows<T, S, true, false>(x, v, src, rows, lp, pp, mp);
  else if (mp) fwd_rows<T, S, false, true>(x, v, src, rows, lp, pp, mp);
  else fwd_rows<T, S, false, false>(x, v, src, rows, lp, pp, mp);
}

// ---------------------------------------------------------------- SDE log-prob, backward
// e = 2 k1 g (x' - mean) of element i, the mean recomputed from x and v
template <typename T, typename S>
inline float lp_residual(const T* x, const T* v, const S* xnext, int64_t i, const Row& r, float gd) {
  const float mu = r.cx * widen(x[i]) + r.cv * widen(v[i]);
  return gd * (widen(xnext[i]) - mu);
}

// d log_prob / d v_i = cv * e_i and d log_prob / d x_i = cx * e_i with e_i = 2 k1 (x'_i - mean_i),
// scaled by the incoming per-sample gradient g; a gradient g_mean of the mean output adds to e.
// The mean is recomputed here from x and v, so nothing but the inputs is kept for backward.
template <typename T, typename S, bool kMean, bool kGv, bool kGx>
void bwd_rows(const at::Tensor& x, const at::Tensor& v, const at::Tensor& xnext, const Row* rows, const float* g_lp,
              const float* g_mean, T* gv, T* gx) {
  const int64_t B = x.size(0), N = x.numel() / B;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  const T* vp = static_cast<const T*>(v.const_data_ptr());
  const S* np = static_cast<const S*>(xnext.const_data_ptr());
  over_chunks(B, N, [&](int64_t t, int64_t b, int64_t off, int64_t n) {
    const Row& r = rows[b];
    const float gd = 2.f * r.k1 * g_lp[b];
#pragma omp simd
    for (int64_t i = off; i < off + n; ++i) {
      float e = lp_residual(xp, vp, np, i, r, gd);
      if constexpr (kMean) e += g_mean[i];
      if constexpr (kGv) gv[i] = narrow<T>(r.cv * e);
      if constexpr (kGx) gx[i] = narrow<T>(r.cx * e);
    }
  });
}

template <typename T, typename S, bool kMean>
void bwd_flags(const at::Tensor& x, const at::Tensor& v, const at::Tensor& xnext, const Row* rows, const float* g,
               const float* gm, T* gv, T* gx) {
  if (gv && gx) bwd_rows<T, S, kMean, true, true>(x, v, xnext, rows, g, gm, gv, gx);
  else if (gv) bwd_rows<T, S, kMean, true, false>(x, v, xnext, rows, g, gm, gv, gx);
  else if (gx) bwd_rows<T, S, kMean, false, true>(x, v, xnext, rows, g, gm, gv, gx);
}

template <typename T, typename S>
void bwd_typed(const at::Tensor& x, const at::Tensor& v, const at::Tensor& xnext, const Row* rows, const float* g,
               const std::optional<at::Tensor>& g_mean, const std::optional<at::Tensor>& gv,
               const std::optional<at::Tensor>& gx) {
  T* gvp = gv ? static_cast<T*>(gv->mutable_data_ptr()) : nullptr;
  T* gxp = gx ? static_cast<T*>(gx->mutable_data_ptr()) : nullptr;
  if (g_mean) bwd_flags<T, S, true>(x, v, xnext, rows, g, g_mean->const_data_ptr<float>(), gvp, gxp);
  else bwd_flags<T, S, false>(x, v, xnext, rows, g, nullptr, gvp, gxp);
}

// ---------------------------------------------------------------- KL surrogate
// kl[b] = scale[b] * sum((m - m_ref)^2) with scale = 1 / (2 N std^2); same reduction tree as above.
std::vector<float> kl_scale(const at::Tensor& std_t, int64_t B, int64_t N) {
  TORCH_CHECK(std_t.scalar_type() == at::kFloat && std_t.is_contiguous() && std_t.numel() == B,
              "std must be a contiguous float32 [B] tensor");
  std::vector<float> scale(B);
  for (int64_t b = 0; b < B; ++b) {
    const double sd = std_t.const_data_ptr<float>()[b];
    scale[b] = float(1 / (2 * static_cast<double>(N) * sd * sd));
  }
  return scale;
}

template <typename T>
void kl_fwd_typed(const at::Tensor& m, const at::Tensor& mr, const float* scale, float* out) {
  const int64_t B = m.size(0), N = m.numel() / B, nchunk = (N + kChunk - 1) / kChunk;
  const T* a = static_cast<const T*>(m.const_data_ptr());
  const T* b_ = static_cast<const T*>(mr.const_data_ptr());
  std::vector<float> partial(B * nchunk);
  over_chunks(B, N, [&](int64_t t, int64_t b, int64_t off, int64_t n) {
    float acc[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const float d = widen(a[off + i + l]) - widen(b_[off + i + l]);
        acc[l] += d * d;
      }
    }
    for (int l = 0; i + l < n; ++l) {
      const float d = widen(a[off + i + l]) - widen(b_[off + i + l]);
      acc[l] += d * d;
    }
    partial[t] = lane_tree(acc);
  });
  for (int64_t b = 0; b < B; ++b) out[b] = scale[b] * pairwise(partial.data() + b * nchunk, nchunk);
}

// grad_m = 2 scale g (m - m_ref) = -grad_m_ref
template <typename T>
void kl_bwd_typed(const at::Tensor& m, const at::Tensor& mr, const float* scale, const float* g, T* gm, T* gmr) {
  const int64_t B = m.size(0), N = m.numel() / B;
  const T* a = static_cast<const T*>(m.const_data_ptr());
  const T* b_ = static_cast<const T*>(mr.const_data_ptr());
  over_chunks(B, N, [&](int64_t t, int64_t b, int64_t off, int64_t n) {
    const float k = 2.f * scale[b] * g[b];
#pragma omp simd
    for (int64_t i = off; i < off + n; ++i) {
      const float gi = k * (widen(a[i]) - widen(b_[i]));
      if (gm) gm[i] = narrow<T>(gi);
      if (gmr) gmr[i] = narrow<T>(-gi);
    }
  });
}

// ---------------------------------------------------------------- log-prob and KL in one pass (training)
// The KL surrogate's two means share x: mean - mean_ref = cv (v - v_ref), so
//   kl = f * sum((v - v_ref)^2),  f = cv^2 / (2 N std_t^2),
// with neither mean in memory. The log-prob's terms and reduction tree are fwd_chunk's scoring ones,
// so the log-prob is bitwise the one the rollout stored.
float kl_factor(const Row& r, int64_t N) {
  const double cv = r.cv, sd = r.std_t;
  return float(cv * cv / (2 * static_cast<double>(N) * sd * sd));
}

template <typename T, typename S>
void sde_kl_fwd_typed(const at::Tensor& x, const at::Tensor& v, const at::Tensor& vr, const at::Tensor& xnext,
                      const Row* rows, float* log_prob, float* kl) {
  const int64_t B = x.size(0), N = x.numel() / B, nchunk = (N + kChunk - 1) / kChunk;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  const T* vp = static_cast<const T*>(v.const_data_ptr());
  const T* rp = static_cast<const T*>(vr.const_data_ptr());
  const S* np = static_cast<const S*>(xnext.const_data_ptr());
  std::vector<float> partial(B * nchunk), kl_partial(B * nchunk);
  over_chunks(B, N, [&](int64_t t, int64_t b, int64_t off, int64_t n) {
    const Row& r = rows[b];
    float acc[kLanes] = {}, acc_kl[kLanes] = {};
    auto term = [&](int64_t i, int l) {
      acc[l] += fwd_elem<T, S, false, false>(xp, vp, np, nullptr, nullptr, i, r);
      const float dv = widen(vp[i]) - widen(rp[i]);
      acc_kl[l] += dv * dv;
    };
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) term(off + i + l, l);
    }
    for (int l = 0; i + l < n; ++l) term(off + i + l, l);
    partial[t] = lane_tree(acc);
    kl_partial[t] = lane_tree(acc_kl);
  });
  for (int64_t b = 0; b < B; ++b) {
    log_prob[b] = -rows[b].k1 * pairwise(partial.data() + b * nchunk, nchunk) - rows[b].k0;
    kl[b] = kl_factor(rows[b], N) * pairwise(kl_partial.data() + b * nchunk, nchunk);
  }
}

// d log_prob / d v = cv e, d log_prob / d x = cx e with e = 2 k1 g (x' - mean) (as bwd_rows);
// d kl / d v = 2 f g_kl (v - v_ref); x gets no gradient from the KL (both means share it).
template <typename T, typename S, bool kGv, bool kGx>
void sde_kl_bwd_rows(const at::Tensor& x, const at::Tensor& v, const at::Tensor& vr, const at::Tensor& xnext,
                     const Row* rows, const float* g_lp, const float* g_kl, T* gv, T* gx) {
  const int64_t B = x.size(0), N = x.numel() / B;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  const T* vp = static_cast<const T*>(v.const_data_ptr());
  const T* rp = static_cast<const T*>(vr.const_data_ptr());
  const S* np = static_cast<const S*>(xnext.const_data_ptr());
  over_chunks(B, N, [&](int64_t t, int64_t b, int64_t off, int64_t n) {
    const Row& r = rows[b];
    const float gd = 2.f * r.k1 * g_lp[b], gk = 2.f * kl_factor(r, N) * g_kl[b];
#pragma omp simd
    for (int64_t i = off; i < off + n; ++i) {
      const float e = lp_residual(xp, vp, np, i, r, gd);
      if constexpr (kGv) gv[i] = narrow<T>(r.cv * e + gk * (widen(vp[i]) - widen(rp[i])));
      if constexpr (kGx) gx[i] = narrow<T>(r.cx * e);
    }
  });
}

// ---------------------------------------------------------------- dtype dispatch and checks
void check_rows(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.sizes() == like.sizes() && t.numel() > 0, what,
              " must have the non-empty shape [B, N] of x");
}

// Calls f(T{}, S{}) for the element type T of x and v and the type S of the third input (T or fp32).
template <typename F>
void dispatch2(at::ScalarType t, at::ScalarType s, F&& f) {
  auto with_s = [&](auto tag) {
    using T = decltype(tag);
    if (s == t) f(T{}, T{});
    else if (s == at::kFloat) f(T{}, float{});
    else TORCH_CHECK(false, "unsupported dtype pair ", t, "/", s);
  };
  switch (t) {
    case at::kFloat: with_s(float{}); break;
    case at::kBFloat16: with_s(uint16_t{}); break;  // raw bits, see widen()
    case at::kHalf: with_s(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", t, " (float32, bfloat16 or float16)");
  }
}

void sde_fwd(const at::Tensor& x, const at::Tensor& v, const at::Tensor& src, const at::Tensor& sig,
             double noise_level, int64_t sde_type, bool sample, at::Tensor& log_prob, at::Tensor& std_t,
             const std::optional<at::Tensor>& prev, const std::optional<at::Tensor>& mean) {
  check_rows(x, x, "x");
  check_rows(v, x, "v");
  check_rows(src, x, sample ? "noise" : "prev_sample");
  TORCH_CHECK(v.scalar_type() == x.scalar_type(), "x and v must share a dtype");
  TORCH_CHECK(!sample || (prev && prev->scalar_type() == x.scalar_type()), "sampling needs prev in the dtype of x");
  if (prev) check_rows(*prev, x, "prev");
  if (mean) check_rows(*mean, x, "mean");
  TORCH_CHECK(!mean || mean->scalar_type() == at::kFloat, "mean must be float32");
  for (const at::Tensor* t : {&log_prob, &std_t})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == x.size(0),
                "log_prob and std must be contiguous float32 [B] tensors");
  const std::vector<Row> rows = rows_of(sig, noise_level, sde_type, x.size(0), x.size(1));
  for (int64_t b = 0; b < x.size(0); ++b) std_t.mutable_data_ptr<float>()[b] = rows[b].std_t;
  dispatch2(x.scalar_type(), src.scalar_type(), [&](auto t, auto s) {
    fwd_typed<decltype(t), decltype(s)>(x, v, src, rows.data(), sample, log_prob.mutable_data_ptr<float>(), prev,
                                        mean);
  });
}

void sde_bwd(const at::Tensor& x, const at::Tensor& v, const at::Tensor& xnext, const at::Tensor& sig,
             double noise_level, int64_t sde_type, const at::Tensor& grad_log_prob,
             const std::optional<at::Tensor>& grad_mean, const std::optional<at::Tensor>& grad_v,
             const std::optional<at::Tensor>& grad_x) {
  check_rows(x, x, "x");
  check_rows(v, x, "v");
  check_rows(xnext, x, "prev_sample");
  TORCH_CHECK(v.scalar_type() == x.scalar_type(), "x and v must share a dtype");
  if (grad_mean) check_rows(*grad_mean, x, "grad_mean");
  if (grad_v) check_rows(*grad_v, x, "grad_v");
  if (grad_x) check_rows(*grad_x, x, "grad_x");
  TORCH_CHECK(!grad_mean || grad_mean->scalar_type() == at::kFloat, "grad_mean must be float32");
  TORCH_CHECK(grad_log_prob.scalar_type() == at::kFloat && grad_log_prob.is_contiguous() &&
                  grad_log_prob.numel() == x.size(0),
              "grad_log_prob must be a contiguous float32 [B] tensor");
  const std::vector<Row> rows = rows_of(sig, noise_level, sde_type, x.size(0), x.size(1));
  dispatch2(x.scalar_type(), xnext.scalar_type(), [&](auto t, auto s) {
    bwd_typed<decltype(t), decltype(s)>(x, v, xnext, rows.data(), grad_log_prob.const_data_ptr<float>(), grad_mean,
                                        grad_v, grad_x);
  });
}

void kl_fwd(const at::Tensor& m, const at::Tensor& mr, const at::Tensor& std_t, at::Tensor& out) {
  check_rows(m, m, "mean");
  check_rows(mr, m, "mean_ref");
  TORCH_CHECK(mr.scalar_type() == m.scalar_type(), "mean and mean_ref must share a dtype");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == m.size(0),
              "out must be a contiguous float32 [B] tensor");
  const std::vector<float> scale = kl_scale(std_t, m.size(0), m.size(1));
  dispatch2(m.scalar_type(), m.scalar_type(), [&](auto t, auto) {
    kl_fwd_typed<decltype(t)>(m, mr, scale.data(), out.mutable_data_ptr<float>());
  });
}

void kl_bwd(const at::Tensor& m, const at::Tensor& mr, const at::Tensor& std_t, const at::Tensor& grad_out,
            const std::optional<at::Tensor>& grad_m, const std::optional<at::Tensor>& grad_mr) {
  check_rows(m, m, "mean");
  check_rows(mr, m, "mean_ref");
  TORCH_CHECK(mr.scalar_type() == m.scalar_type(), "mean and mean_ref must share a dtype");
  if (grad_m) check_rows(*grad_m, m, "grad_mean");
  if (grad_mr) check_rows(*grad_mr, m, "grad_mean_ref");
  TORCH_CHECK(grad_out.scalar_type() == at::kFloat && grad_out.is_contiguous() && grad_out.numel() == m.size(0),
              "grad_out must be a contiguous float32 [B] tensor");
  const std::vector<float> scale = kl_scale(std_t, m.size(0), m.size(1));
  dispatch2(m.scalar_type(), m.scalar_type(), [&](auto t, auto) {
    using T = decltype(t);
    kl_bwd_typed<T>(m, mr, scale.data(), grad_out.const_data_ptr<float>(),
                    grad_m ? static_cast<T*>(grad_m->mutable_data_ptr()) : nullptr,
                    grad_mr ? static_cast<T*>(grad_mr->mutable_data_ptr()) : nullptr);
  });
}

void sde_kl_fwd(const at::Tensor& x, const at::Tensor& v, const at::Tensor& v_ref, const at::Tensor& xnext,
                const at::Tensor& sig, double noise_level, int64_t sde_type, at::Tensor& log_prob, at::Tensor& std_t,
                at::Tensor& kl) {
  check_rows(x, x, "x");
  check_rows(v, x, "v");
  check_rows(v_ref, x, "v_ref");
  check_rows(xnext, x, "prev_sample");
  TORCH_CHECK(v.scalar_type() == x.scalar_type() && v_ref.scalar_type() == x.scalar_type(),
              "x, v and v_ref must share a dtype");
  for (const at::Tensor* t : {&log_prob, &std_t, &kl})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == x.size(0),
                "log_prob, std and kl must be contiguous float32 [B] tensors");
  const std::vector<Row> rows = rows_of(sig, noise_level, sde_type, x.size(0), x.size(1));
  for (int64_t b = 0; b < x.size(0); ++b) std_t.mutable_data_ptr<float>()[b] = rows[b].std_t;
  dispatch2(x.scalar_type(), xnext.scalar_type(), [&](auto t, auto s) {
    sde_kl_fwd_typed<decltype(t), decltype(s)>(x, v, v_ref, xnext, rows.data(), log_prob.mutable_data_ptr<float>(),
                                               kl.mutable_data_ptr<float>());
  });
}

void sde_kl_bwd(const at::Tensor& x, const at::Tensor& v, const at::Tensor& v_ref, const at::Tensor& xnext,
                const at::Tensor& sig, double noise_level, int64_t sde_type, const at::Tensor& grad_log_prob,
                const at::Tensor& grad_kl, const std::optional<at::Tensor>& grad_v,
                const std::optional<at::Tensor>& grad_x) {
  check_rows(x, x, "x");
  check_rows(v, x, "v");
  check_rows(v_ref, x, "v_ref");
  check_rows(xnext, x, "prev_sample");
  TORCH_CHECK(v.scalar_type() == x.scalar_type() && v_ref.scalar_type() == x.scalar_type(),
              "x, v and v_ref must share a dtype");
  if (grad_v) check_rows(*grad_v, x, "grad_v");
  if (grad_x) check_rows(*grad_x, x, "grad_x");
  for (const at::Tensor* t : {&grad_log_prob, &grad_kl})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == x.size(0),
                "grad_log_prob and grad_kl must be contiguous float32 [B] tensors");
  const std::vector<Row> rows = rows_of(sig, noise_level, sde_type, x.size(0), x.size(1));
  dispatch2(x.scalar_type(), xnext.scalar_type(), [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    T* gvp = grad_v ? static_cast<T*>(grad_v->mutable_data_ptr()) : nullptr;
    T* gxp = grad_x ? static_cast<T*>(grad_x->mutable_data_ptr()) : nullptr;
    const float* g = grad_log_prob.const_data_ptr<float>();
    const float* gk = grad_kl.const_data_ptr<float>();
    if (gvp && gxp) sde_kl_bwd_rows<T, S, true, true>(x, v, v_ref, xnext, rows.data(), g, gk, gvp, gxp);
    else if (gvp) sde_kl_bwd_rows<T, S, true, false>(x, v, v_ref, xnext, rows.data(), g, gk, gvp, gxp);
    else if (gxp) sde_kl_bwd_rows<T, S, false, true>(x, v, v_ref, xnext, rows.data(), g, gk, gvp, gxp);
  });
}

}  // namespace

TORCH_LIBRARY(paco_kernels, m) {
  // sig: [B, 3] float32 (sigma, sigma_next, sigma_max); sde_type: 0 flow_grpo, 1 cps
  m.def("sde_fwd(Tensor x, Tensor v, Tensor src, Tensor sig, float noise_level, int sde_type, bool sample, "
        "Tensor(a!) log_prob, Tensor(b!) std, Tensor(c!)? prev, Tensor(d!)? mean) -> ()",
        &sde_fwd);
  m.def("sde_bwd(Tensor x, Tensor v, Tensor prev_sample, Tensor sig, float noise_level, int sde_type, "
        "Tensor grad_log_prob, Tensor? grad_mean, Tensor(a!)? grad_v, Tensor(b!)? grad_x) -> ()",
        &sde_bwd);
  m.def("sde_kl_fwd(Tensor x, Tensor v, Tensor v_ref, Tensor prev_sample, Tensor sig, float noise_level, "
        "int sde_type, Tensor(a!) log_prob, Tensor(b!) std, Tensor(c!) kl) -> ()",
        &sde_kl_fwd);
  m.def("sde_kl_bwd(Tensor x, Tensor v, Tensor v_ref, Tensor prev_sample, Tensor sig, float noise_level, "
        "int sde_type, Tensor grad_log_prob, Tensor grad_kl, Tensor(a!)? grad_v, Tensor(b!)? grad_x) -> ()",
        &sde_kl_bwd);
  m.def("kl_fwd(Tensor mean, Tensor mean_ref, Tensor std, Tensor(a!) out) -> ()", &kl_fwd);
  m.def("kl_bwd(Tensor mean, Tensor mean_ref, Tensor std, Tensor grad_out, Tensor(a!)? grad_mean, "
        "Tensor(b!)? grad_mean_ref) -> ()",
        &kl_bwd);
}
