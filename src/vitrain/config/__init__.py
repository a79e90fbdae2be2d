"""One typed run configuration, loaded from recipe + YAML + ``--set`` overrides, resolved once.

- :mod:`~vitrain.config.schema`: the sections and fields of :class:`Config`;
- :mod:`~vitrain.config.loading`: recipe -> YAML files -> ``--set`` overrides -> validated config;
- :mod:`~vitrain.config.resolve`: :func:`resolve` turns a config into a frozen :class:`Plan` holding
  every derived number (scaled LR, steps per epoch, total and warmup steps, eval/checkpoint cadence)
  before anything expensive runs (``vitrain.train.make_plan`` does so with this machine's facts);
- :mod:`~vitrain.config.plan`: the :class:`Plan` and its parts, each handed to the component using it.

Every user mistake is raised as :class:`ConfigError`, whose one-line message names the dotted key and
a fix.
"""

from __future__ import annotations

from vitrain.config.loading import build_config, config_to_yaml, load_yaml, parse_override
from vitrain.config.plan import (
    BatchPlan,
    CheckpointPlan,
    DataPlan,
    DistillPlan,
    EmaPlan,
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
    DatasetInfo,
    Hardware,
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
    LogConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
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
    "Hardware",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "Plan",
    "ScheduleConfig",
    "Stage",
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
]
