// The Python module of the fused CPU kernels for bf16 training: its bindings only, the functions
// being declared in kernels.h and defined one op family a source (vitrain.kernels builds the sources
// with torch's JIT extension loader on first use, for the host's vector ISA; see
// vitrain/kernels/__init__.py).

#include "kernels.h"

// Raises a c10::Error as every TORCH_CHECK of the kernels does. vitrain.kernels.build calls it once per
// build in a child process: where the compiler's unwind tables do not suit the runtime's unwinder, the
// first error of the extension kills the process instead of reaching Python, and the kernels are not used.
static void raise_error(const std::string& message) { TORCH_CHECK(false, message); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("raise_error", &raise_error, "raise a c10::Error with this message (the build's error-path check)");
  m.def("layer_norm_forward", &layer_norm_forward, "LayerNorm over the last dimension, bf16 in and out",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("branch") = py::none());
  m.def("layer_norm_backward", &layer_norm_backward, "LayerNorm backward with float32 accumulation",
        py::arg("grad_out"), py::arg("x"), py::arg("mean"), py::arg("rstd"), py::arg("weight"),
        py::arg("residual") = py::none());
  m.def("column_sums", &column_sums, "column sums of a bf16 matrix in float32");
  m.def("transpose_rows", &transpose_rows, "feature-major copy of a bf16 matrix and its column sums");
  m.def("gelu_forward", &gelu_forward, "the exact GELU of bf16 values, by table");
  m.def("gelu_backward", &gelu_backward, "the exact GELU's backward for bf16 values, by table");
  m.def("depthwise_conv3x3_backward", &depthwise_conv3x3_backward, "its input, weight and bias gradients");
  m.def("cat_hardswish", &cat_hardswish, "the locality FFN's concatenation and h-swish in one pass");
  m.def("amx_available", &vitrain_kernels::amx_available, "whether the AMX tile kernels can run here");
  m.def("attention_forward", &attention_forward, "softmax(scale q k^T) v per image and head, from fused qkv");
  m.def("weight_gradient", &weight_gradient, "a linear layer's weight and bias gradients from token-major g and x",
        py::arg("g"), py::arg("x"), py::arg("bias"), py::arg("chunk") = 0, py::arg("emulate") = false,
        py::arg("gelu_input") = py::none());
  m.def("attention_backward", &attention_backward, "the gradient at qkv of attention_forward");
}
