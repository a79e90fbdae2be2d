"""A trained model written for use elsewhere (``vitrain export``): vitrain's safetensors file
(:mod:`~vitrain.export.weights`), a timm model folder (:mod:`~vitrain.export.timm`) and an ONNX file checked
with onnxruntime (:mod:`~vitrain.export.onnx`). The timm and ONNX exports build the model from the
checkpoint alone (:func:`vitrain.weights.inference.exported_model`), without the training data or a
training plan; the safetensors export copies the checkpoint's tensors."""

from vitrain.export.onnx import export_onnx
from vitrain.export.timm import export_timm
from vitrain.export.weights import export_model

__all__ = ["export_model", "export_onnx", "export_timm"]
