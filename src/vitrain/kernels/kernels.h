// Declarations of every function the Python module binds (module.cpp), grouped by the source that
// defines them; each of those sources includes this header too. What each function takes and returns
// is said at its definition.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

// layer_norm.cpp
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps, const c10::optional<at::Tensor>& branch);
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mean,
                                            const at::Tensor& rstd, const at::Tensor& weight,
                                            const c10::optional<at::Tensor>& residual);

// gelu.cpp
at::Tensor gelu_forward(const at::Tensor& h);
std::vector<at::Tensor> gelu_backward(const at::Tensor& grad_out, const at::Tensor& h, bool column_sums);

// linear.cpp
std::vector<at::Tensor> transpose_rows(const at::Tensor& g, bool column_sums);
at::Tensor column_sums(const at::Tensor& g);

// depthwise.cpp
std::vector<at::Tensor> depthwise_conv3x3_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                   const at::Tensor& weight, bool has_bias, bool need_input_grad,
                                                   const std::optional<at::Tensor>& act_input,
                                                   const std::optional<at::Tensor>& dx_out, bool dx_sums);
at::Tensor cat_hardswish(const at::Tensor& u, const at::Tensor& conv_out, int64_t prefix);

// attention.cpp
std::vector<at::Tensor> attention_forward(const at::Tensor& qkv, int64_t heads, double scale, bool emulate);
at::Tensor attention_backward(const at::Tensor& grad_out, const at::Tensor& qkv, const at::Tensor& stats,
                              int64_t heads, double scale, bool emulate);

namespace vitrain_kernels {

// Whether the AMX path can run: the CPU has AMX-TILE and AMX-BF16, the extension was built with them,
// and Linux granted this process the tile state (attention.cpp; the tile kernels check it, tiles.h).
bool amx_available();

}  // namespace vitrain_kernels

// weight_gradient.cpp
std::vector<at::Tensor> weight_gradient(const at::Tensor& g, const at::Tensor& x, bool bias, int64_t chunk,
                                        bool emulate, const c10::optional<at::Tensor>& gelu_input);
