"""Model weights from elsewhere: a run folder, a checkpoint, a safetensors file or timm's weights
(:mod:`~vitrain.weights.sources`, for ``train.init_from`` and fine-tuning), a frozen distillation teacher
(:mod:`~vitrain.weights.teacher`), and a trained model ready to use from its checkpoint alone
(:mod:`~vitrain.weights.inference`, for ``vitrain predict`` and ``vitrain export``)."""
