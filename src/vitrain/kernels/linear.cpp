// Feature-major copies and column sums for linear layers' weight and bias gradients where the AMX
// weight gradient (weight_gradient.cpp) is not taken (transpose_rows, column_sums; called by
// vitrain/kernels/linear.py).
//
// A linear layer's weight gradient is g^T x over all tokens. oneDNN's AMX matmul runs that product
// at about half speed when its left operand is a transposed view (6.8 against 3.5 ms for 6304 tokens,
// 384 x 1536), and PyTorch's transposing copy is slower still for wide rows (2.2 ns an element). This
// copies g (M rows of N) into its feature-major (N, M) layout in 32 x 32 blocks (one cache line of
// each output row per block), and sums its columns (the bias gradient) in float32 on the way.

#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <vector>

using namespace vitrain_kernels;

// g (M, N) bf16 contiguous -> (gT (N, M) bf16 contiguous, column sums of g (N) float32, undefined
// unless column_sums).
std::vector<at::Tensor> transpose_rows(const at::Tensor& g, bool column_sums) {
  check_rows(g, "transpose_rows: g");
  TORCH_CHECK(g.dim() == 2, "transpose_rows: g must be 2-d, got ", g.dim(), " dimensions");
  const int64_t M = g.size(0), N = g.size(1);
  auto out = at::empty({N, M}, g.options());
  constexpr int64_t kBlock = 32, kRows = 256;  // 32 x 32 transposes; 512 contiguous bytes per output row
  ColumnSums sums(column_sums ? N : 0, 1);
  const BF* src = g.data_ptr<BF>();
  BF* dst = out.data_ptr<BF>();
  at::parallel_for(0, (M + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
    float* acc = column_sums ? sums.block(0) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = item * kRows, last = std::min(M, first + kRows);
      for (int64_t c0 = 0; c0 < N; c0 += kBlock) {
        const int cols = static_cast<int>(std::min(kBlock, N - c0));
        for (int64_t r0 = first; r0 < last; r0 += kBlock) {
          const int rows = static_cast<int>(std::min(kBlock, last - r0));
          at::vec::transpose_mxn<BF>(src + r0 * N + c0, N, dst + c0 * M + r0, M, rows, cols);
        }
      }
      if (acc != nullptr) add_rows(src + first * N, last - first, N, acc);
    }
  });
  return {out, column_sums ? sums.reduce(0, at::kFloat) : at::Tensor()};
}

// Column sums of a contiguous bf16 matrix (M, N) in float32: the bias gradient of a layer whose
// output gradient is not copied (an expanding layer copies its input instead).
at::Tensor column_sums(const at::Tensor& g) {
  check_rows(g, "column_sums: g");
  TORCH_CHECK(g.dim() == 2, "column_sums: g must be 2-d, got ", g.dim(), " dimensions");
  const int64_t M = g.size(0), N = g.size(1);
  ColumnSums sums(N, 1);
  const BF* src = g.data_ptr<BF>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
    add_rows(src + begin * N, end - begin, N, sums.block(0));
  });
  return sums.reduce(0, at::kFloat);
}
