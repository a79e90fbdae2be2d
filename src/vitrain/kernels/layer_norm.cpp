// LayerNorm over the last dimension, forward (with an optional residual add before it) and backward
// (layer_norm_forward, layer_norm_backward; called by the ops of vitrain/kernels/layer_norm.py).
//
// PyTorch's bf16 CPU backward takes about three times as long as one pass over its operands needs,
// hands its row statistics over in bf16, and sums the weight and bias gradients with bf16 round-off
// (off by 7-12 % of the largest value over 8320 rows of 192). Here every row is normalized, and every
// gradient accumulated, in float32, with bf16 only at the edges.
//
// Layout: activations are bf16; LayerNorm takes contiguous rows of width C (the normalized
// dimension), row statistics are float32; per-column sums are accumulated per thread in float32 and
// reduced at the end (ColumnSums, common.h).

#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

using namespace vitrain_kernels;

namespace {

inline fVec load_param(const float* p, int64_t n) { return load_f32(p, n); }
inline fVec load_param(const BF* p, int64_t n) { return load_bf16(p, n); }

void check_param(const at::Tensor& t, int64_t columns, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == columns &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a contiguous float32 or bf16 CPU tensor of ", columns, " elements");
}

// With `branch`, the rows normalized are x + branch, rounded to bf16 and written to `sum` first (a
// residual connection followed by a pre-norm, as the separate add would round it).
template <typename W>
void layer_norm_forward_rows(const BF* xp, const BF* branch, BF* sum, const W* wp, const W* bp, BF* yp, float* mp,
                             float* rp, int64_t R, int64_t C, float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
  at::parallel_for(0, R, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF* row = xp + r * C;
      if (branch != nullptr) {
        for (int64_t c = 0; c < C; c += kF) {
          const int64_t n = std::min(kF, C - c);
          store_bf16(sum + r * C + c, load_bf16(row + c, n) + load_bf16(branch + r * C + c, n), n);
        }
        row = sum + r * C;
      }
      fVec acc(0.f);
      for (int64_t c = 0; c < C; c += kF) acc = acc + load_bf16(row + c, std::min(kF, C - c));
      const float m = horizontal_sum(acc) * inv_c;
      const fVec mv(m);
      fVec sq(0.f);
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        fVec d = load_bf16(row + c, n) - mv;
        if (n < kF) d = fVec::set(fVec(0.f), d, n);  // masked lanes load 0 and would add m^2 each
        sq = sq + d * d;
      }
      const float s = 1.0f / std::sqrt(horizontal_sum(sq) * inv_c + eps);
      mp[r] = m;
      rp[r] = s;
      const fVec sv(s);
      BF* out = yp + r * C;
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        const fVec xhat = (load_bf16(row + c, n) - mv) * sv;
        store_bf16(out + c, xhat * load_param(wp + c, n) + load_param(bp + c, n), n);
      }
    }
  });
}

// With `residual`, dx is the LayerNorm's input gradient plus `residual` (the gradient that reaches a
// residual connection's sum past the norm), each rounded as the separate backward and add round them:
// the same bits.
template <typename W>
void layer_norm_backward_rows(const BF* gp, const BF* xp, const float* mp, const float* rp, const W* wp,
                              const BF* residual, BF* dxp, ColumnSums& sums, int64_t R, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
  at::parallel_for(0, R, 32, [&](int64_t begin, int64_t end) {
    float* dw = sums.block(0);
    float* db = sums.block(1);
    for (int64_t r = begin; r < end; ++r) {
      const BF *g = gp + r * C, *row = xp + r * C;
      const fVec mv(mp[r]), sv(rp[r]);
      fVec sum_gw(0.f), sum_gw_xhat(0.f);
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        const fVec gv = load_bf16(g + c, n), xhat = (load_bf16(row + c, n) - mv) * sv;
        const fVec gw = gv * load_param(wp + c, n);  // masked lanes: g = 0, so gw = 0
        sum_gw = sum_gw + gw;
        sum_gw_xhat = sum_gw_xhat + gw * xhat;
        store_f32(dw + c, load_f32(dw + c, n) + gv * xhat, n);
        store_f32(db + c, load_f32(db + c, n) + gv, n);
      }
      const fVec a(horizontal_sum(sum_gw) * inv_c), b(horizontal_sum(sum_gw_xhat) * inv_c);
      BF* out = dxp + r * C;
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        const fVec gv = load_bf16(g + c, n), xhat = (load_bf16(row + c, n) - mv) * sv;
        fVec dx = sv * (gv * load_param(wp + c, n) - a - xhat * b);
        if (residual != nullptr) dx = round_bf16(dx) + load_bf16(residual + r * C + c, n);
        store_bf16(out + c, dx, n);
      }
    }
  });
}

}  // namespace

// y = (x - mean) * rstd * weight + bias over the last dimension (weight and bias float32 or bf16).
// Returns y (bf16) and the row mean and 1/sqrt(var + eps) in float32, for the backward. Given a
// `branch` of x's shape, the rows normalized are s = x + branch (rounded to bf16), returned fourth:
// the residual connection and the pre-norm after it in one pass.
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps, const c10::optional<at::Tensor>& branch) {
  check_rows(x, "layer_norm_forward: x");
  const int64_t C = x.size(-1), R = x.numel() / C;
  check_param(weight, C, "layer_norm_forward: weight");
  check_param(bias, C, "layer_norm_forward: bias");
  TORCH_CHECK(weight.scalar_type() == bias.scalar_type(), "layer_norm_forward: weight and bias differ in dtype");
  at::Tensor sum;
  if (branch.has_value()) {
    check_rows(*branch, "layer_norm_forward: branch");
    TORCH_CHECK(branch->sizes() == x.sizes(), "layer_norm_forward: branch and x differ in shape");
    sum = at::empty_like(x);
  }
  auto y = at::empty_like(x);
  auto stats_shape = x.sizes().vec();
  stats_shape.back() = 1;
  auto mean = at::empty(stats_shape, x.options().dtype(at::kFloat));
  auto rstd = at::empty(stats_shape, x.options().dtype(at::kFloat));
  const BF* xp = x.data_ptr<BF>();
  const BF* bp = branch.has_value() ? branch->data_ptr<BF>() : nullptr;
  BF* sp = branch.has_value() ? sum.data_ptr<BF>() : nullptr;
  BF* yp = y.data_ptr<BF>();
  float *mp = mean.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  if (weight.scalar_type() == at::kFloat) {
    layer_norm_forward_rows(xp, bp, sp, weight.data_ptr<float>(), bias.data_ptr<float>(), yp, mp, rp, R, C, eps);
  } else {
    layer_norm_forward_rows(xp, bp, sp, weight.data_ptr<BF>(), bias.data_ptr<BF>(), yp, mp, rp, R, C, eps);
  }
  return {y, mean, rstd, sum};
}

// Gradients of layer_norm_forward: dx (bf16) and the weight and bias gradients (weight's dtype),
// the latter summed in float32. Given `residual` (of x's shape), dx has it added: the gradient at a
// residual sum that feeds both the next residual and this norm.
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mean,
                                            const at::Tensor& rstd, const at::Tensor& weight,
                                            const c10::optional<at::Tensor>& residual) {
  check_rows(grad_out, "layer_norm_backward: grad_out");
  check_rows(x, "layer_norm_backward: x");
  TORCH_CHECK(grad_out.sizes() == x.sizes(), "layer_norm_backward: grad_out and x differ in shape");
  const int64_t C = x.size(-1), R = x.numel() / C;
  check_param(weight, C, "layer_norm_backward: weight");
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.is_contiguous() &&
                  rstd.is_contiguous() && mean.numel() == R && rstd.numel() == R,
              "layer_norm_backward: mean and rstd must be contiguous float32 with one value per row "
              "(as layer_norm_forward returns them)");
  if (residual.has_value()) {
    check_rows(*residual, "layer_norm_backward: residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "layer_norm_backward: residual and x differ in shape");
  }
  auto dx = at::empty_like(x);
  ColumnSums sums(C, 2);
  const BF *gp = grad_out.data_ptr<BF>(), *xp = x.data_ptr<BF>();
  const BF* res = residual.has_value() ? residual->data_ptr<BF>() : nullptr;
  const float *mp = mean.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  if (weight.scalar_type() == at::kFloat) {
    layer_norm_backward_rows(gp, xp, mp, rp, weight.data_ptr<float>(), res, dx.data_ptr<BF>(), sums, R, C);
  } else {
    layer_norm_backward_rows(gp, xp, mp, rp, weight.data_ptr<BF>(), res, dx.data_ptr<BF>(), sums, R, C);
  }
  return {dx, sums.reduce(0, weight.scalar_type()), sums.reduce(1, weight.scalar_type())};
}
