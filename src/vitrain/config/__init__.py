"""One typed run configuration, loaded from recipe + YAML + ``--set`` overrides, resolved once.

- :mod:`~vitrain.config.schema`: the sections and fields of :class:`Config`;
- :mod:`~vitrain.config.loading`: recipe -> YAML files -> ``--set`` overrides -> validated config;
- :mod:`~vitrain.config.resolve`: :func:`resolve` turns a config into a frozen :class:`Plan` holding
  every derived number (scaled LR, steps per epoch, total and warmup steps, eval/checkpoint cadence)
  before anything expensive runs (``vitrain.train.make_plan`` does so with this machine's facts);
  with :mod:`~vitrain.config.inputs` (data sources, decoders, pinned kernels, the fine-tuning source) and
  :mod:`~vitrain.config.training` (mixing, weight EMA, distillation, token labeling) checking and planning
  their sections (:mod:`~vitrain.config.checks`: the helpers they share);
- :mod:`~vitrain.config.plan`: the :class:`Plan` and its parts, each handed to the component using it, and
  the facts resolve() is given (:class:`DatasetInfo`, :class:`Hardware`, :class:`ModelFacts`).

Every user mistake is raised as :class:`ConfigError`, whose one-line message names the dotted key and
a fix.
"""

from __future__ import annotations

from vitrain.config.loading import MOVED_KEYS, build_config, config_to_yaml, load_yaml, parse_override, stored_config
from vitrain.config.plan import (
    BatchPlan,
    CheckpointPlan,
    DataPlan,
    DatasetInfo,
    DistillPlan,
    EmaPlan,
    Hardware,
    LogPlan,
    LoopPlan,
    MeasuredPrecision,
    MixPlan,
    ModelFacts,
    ModelLookup,
    ModelPlan,
    OptimizerPlan,
    ParallelPlan,
    Plan,
    RuntimePlan,
    SchedulePlan,
    Stage,
    StepPlan,
    TokenLabelPlan,
    World,
)
from vitrain.config.resolve import (
    model_overrides,
    parse_duration_s,
    precision_policy,
    resolve,
    resolve_device,
)
from vitrain.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    CurriculumConfig,
    CurriculumStage,
    DataConfig,
    DistillConfig,
    EmaConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PerformanceConfig,
    ScheduleConfig,
    TokenLabelConfig,
    TrainConfig,
)

__all__ = [
    "MOVED_KEYS",
    "BatchPlan",
    "CheckpointConfig",
    "CheckpointPlan",
    "DataPlan",
    "DistillPlan",
    "EmaPlan",
    "LogPlan",
    "LoopPlan",
    "MeasuredPrecision",
    "MixPlan",
    "ModelFacts",
    "ModelLookup",
    "ModelPlan",
    "OptimizerPlan",
    "ParallelPlan",
    "RuntimePlan",
    "SchedulePlan",
    "TokenLabelPlan",
    "StepPlan",
    "Config",
    "ConfigError",
    "CurriculumConfig",
    "CurriculumStage",
    "DataConfig",
    "DatasetInfo",
    "DistillConfig",
    "EmaConfig",
    "Hardware",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PerformanceConfig",
    "Plan",
    "ScheduleConfig",
    "Stage",
    "TokenLabelConfig",
    "TrainConfig",
    "World",
    "build_config",
    "config_to_yaml",
    "load_yaml",
    "model_overrides",
    "parse_duration_s",
    "parse_override",
    "precision_policy",
    "resolve",
    "resolve_device",
    "stored_config",
]
