// The exact GELU forward and backward by table (gelu_forward, gelu_backward; called by the ops of
// vitrain/kernels/gelu.py and linear.py).
//
// A bf16 activation has 65536 possible values, so the exact (erf) GELU and its derivative are two
// tables of 65536 floats (256 KiB each, L2-resident), computed once in double precision: the forward
// is a gather, the backward a gather and a multiply. PyTorch's bf16 kernels evaluate erf and two
// exponentials per element (its backward took 2.3 ms for 8320 x 768, this 1.0 ms), and round each
// result once from float; these round once from the double-precision value. NaN stays NaN, and the
// infinities map to GELU's limits (0 and x; derivatives 0 and 1). The tables are in common.h.

#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <vector>

using namespace vitrain_kernels;

// The exact GELU of a contiguous bf16 tensor.
at::Tensor gelu_forward(const at::Tensor& h) {
  check_rows(h, "gelu_forward: h");
  const float* table = gelu_tables().value.data();
  auto y = at::empty_like(h);
  const BF* hp = h.data_ptr<BF>();
  BF* out = y.data_ptr<BF>();
  at::parallel_for(0, h.numel(), 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += kF) {
      const int64_t n = std::min(kF, end - i);
      store_bf16(out + i, gather(table, hp + i, n), n);
    }
  });
  return y;
}

// grad_out and h (the GELU's input) bf16, contiguous, of one shape -> the gradient at h (bf16) and,
// if column_sums, its sums over all but the last dimension in float32 (the bias gradient of the
// linear layer that produced h; undefined otherwise).
std::vector<at::Tensor> gelu_backward(const at::Tensor& grad_out, const at::Tensor& h, bool column_sums) {
  check_rows(grad_out, "gelu_backward: grad_out");
  check_rows(h, "gelu_backward: h");
  TORCH_CHECK(grad_out.sizes() == h.sizes(), "gelu_backward: grad_out and h differ in shape");
  auto dh = at::empty_like(h);
  const int64_t C = h.dim() > 0 ? h.size(-1) : 1, R = C > 0 ? h.numel() / C : 0;
  ColumnSums sums(column_sums ? C : 0, 1);
  const BF *gp = grad_out.data_ptr<BF>(), *hp = h.data_ptr<BF>();
  BF* out = dh.data_ptr<BF>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1)), [&](int64_t begin, int64_t end) {
    gelu_backward_rows(gp + begin * C, hp + begin * C, end - begin, C, out + begin * C,
                       column_sums ? sums.block(0) : nullptr);
  });
  return {dh, column_sums ? sums.reduce(0, at::kFloat) : at::Tensor()};
}
