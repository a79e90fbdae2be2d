"""A resolved run: a :class:`Plan` made of small frozen parts, each handed to the component that uses it.

:func:`~vitrain.config.resolve.resolve` makes every part; outside :mod:`vitrain.config` nothing reads
the raw config (``Plan.config``) except to record it (checkpoints, ``config.yaml``, the summary).

- :class:`ModelPlan` -> the model build; :class:`BatchPlan` -> every batch size, per process included;
- :class:`~vitrain.config.precision.PrecisionPolicy` -> step, optimizer, parallelism, evaluation;
- :class:`ParallelPlan` -> ``parallelize``; :class:`OptimizerPlan` -> ``build_optimizer``;
- :class:`SchedulePlan` -> LR schedule, run length, curriculum stages; :class:`DataPlan` -> the loaders
  (its :class:`MixPlan` -> the batch mixer);
- :class:`StepPlan` (its :class:`DistillPlan` -> the teacher and the distillation loss; its
  :class:`TokenLabelPlan` -> the label maps, the token-labeling loss and MixToken), :class:`RuntimePlan`, :class:`LoopPlan`, :class:`CheckpointPlan` -> the step, the
  process and model conversions, the loop, the checkpoints; :class:`EmaPlan` -> the weight EMA;
  :class:`LogPlan` -> the metric sinks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from vitrain.config.schema import Config, DataConfig

if TYPE_CHECKING:
    from vitrain.config.precision import PrecisionPolicy


@dataclasses.dataclass(frozen=True)
class Stage:
    """A stretch of the run at one image size and batch size (the curriculum is a tuple of them)."""

    image_size: int
    batch_size: int
    lr_scale: float = 1.0
    until: float | None = None
    """Ends when this fraction of the run is done (None: no fraction limit)."""
    until_epoch: float | None = None
    """Ends at this epoch (None: no epoch limit)."""

    def covers(self, progress: float, epoch: float) -> bool:
        if self.until is not None and progress >= self.until:
            return False
        return self.until_epoch is None or epoch < self.until_epoch


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place among the processes of a run (torchrun's RANK, WORLD_SIZE, LOCAL_RANK, or srun's)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    tp_size: int = 1
    """Processes per tensor-parallel group (set by resolve); they see the same data."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which slice of every global batch this process takes (tensor-parallel peers share one)."""
        return self.rank // self.tp_size

    @property
    def data_size(self) -> int:
        """Number of distinct data slices: processes over the tensor-parallel degree."""
        return self.size // self.tp_size

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> World:
        """torchrun's RANK / WORLD_SIZE / LOCAL_RANK; without them, in a job step ``srun`` started (one task
        per process), Slurm's SLURM_PROCID / SLURM_STEP_NUM_TASKS (or SLURM_NTASKS) / SLURM_LOCALID;
        otherwise one process. A batch script's own shell has Slurm's job variables but no step
        (SLURM_STEP_ID): it is one process."""
        import os

        env = os.environ if environ is None else environ
        if "RANK" not in env and "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
            size = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
            return cls(int(env["SLURM_PROCID"]), int(size), int(env.get("SLURM_LOCALID", 0)))
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What resolve() needs to know about the data, read cheaply from the source."""

    num_train: int
    num_eval: int
    num_classes: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The facts about the machine that resolve() depends on (injected so resolve stays pure)."""

    cuda_available: bool
    bf16_supported: bool
    """The device computes bf16 natively (CPU: AVX512-BF16 or AMX-BF16 that oneDNN may use; CUDA: compute
    capability 8+)."""
    bf16_emulated: bool = False
    """bf16 still runs, converted in software (any CPU): allowed when asked for or measured faster."""
    amx_tiles: bool = False
    """The CPU has AMX-BF16 tiles vitrain's kernels may use (the environment's ``VITRAIN_AMX`` not off)."""
    cuda_capability: tuple[int, int] | None = None
    """The CUDA device's compute capability (None on a CPU): FP8 tensor cores from 8.9."""


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What ``resolve()`` must know of a model family, handed in by the model catalog
    (:func:`vitrain.models.model_facts`): the config layer imports nothing above it."""

    args: Any
    """The variant's default arguments (a dataclass; its fields are the options the family takes)."""
    splits_heads: bool
    """Tensor parallelism can split its blocks (ViT/DeiT blocks with the plain MLP FFN)."""
    stem_problem: Callable[[int], str | None]
    """Why the convolutional stem cannot make an input stride (None: it can)."""


ModelLookup = Callable[[str], ModelFacts]
"""Model name -> :class:`ModelFacts`; KeyError naming the known models for an unknown name."""


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """The model to build (``model.*`` with the data's shape)."""

    name: str
    options: dict[str, Any]
    """The model.* options as model arguments (unset ones None)."""
    image_size: int
    in_chans: int
    num_classes: int
    patch_size: int
    """The model's input stride (patch size; VOLO's patch x downsampling)."""
    choose_attention: bool
    """model.attn_impl=auto: each attention shape takes the faster implementation, measured at build."""

    @property
    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of ``vitrain.models.build_model`` besides the name."""
        return {"img_size": self.image_size, "in_chans": self.in_chans, "num_classes": self.num_classes, **self.options}


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Every batch size of the run. Batches are global (all processes together); each data slice takes an
    equal share (resolve checked that they split), computed here alone."""

    global_batch: int
    """train.batch_size: images per optimizer step (the final stage's)."""
    eval_batch: int
    """Images per evaluation batch (train.eval_batch_size, or twice the training batch)."""
    micro_batch: int | None
    """Images per forward/backward on each process (train.micro_batch_size; None: its whole share)."""
    data_slices: int
    """Processes with distinct data (tensor-parallel peers share one slice)."""

    def per_process(self, global_batch: int) -> int:
        """This process's share of a global batch."""
        return global_batch // self.data_slices

    def global_of(self, per_process: int) -> int:
        """The global batch whose share is ``per_process``."""
        return per_process * self.data_slices

    @property
    def eval_per_process(self) -> int:
        return self.per_process(self.eval_batch)

    def forward_batches(self, global_batch: int) -> list[int]:
        """Images per forward pass at a global batch: the micro-batch, and the smaller last piece when the
        share does not divide into micro-batches."""
        share = self.per_process(global_batch)
        micro = min(self.micro_batch or share, share)
        return [micro] + ([share % micro] if share % micro else [])


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """How ``parallelize`` spreads the model over the processes and what it applies to it."""

    strategy: Literal["ddp", "fsdp", "tp", "fsdp+tp"]
    world: World
    device: str
    activation_checkpointing: int | Literal["all"]
    """Blocks whose activations are recomputed in the backward (all: every one; 0: none)."""
    compile: bool
    compile_backend: str
    compile_mode: str = "default"
    """torch.compile's mode (``performance.compile_mode``)."""
    compile_scope: Literal["blocks", "model"] = "blocks"
    """blocks: each block compiled (training); model: the whole module (``vitrain bench --compile``)."""
    fsdp_reshard: Literal["zero2", "zero3"] = "zero3"
    fsdp_cpu_offload: bool = False

    @property
    def shards_model(self) -> bool:
        """FSDP and/or tensor parallelism over several processes: the parameters become DTensors."""
        return self.world.size > 1 and self.strategy != "ddp"

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the model (fsdp or fsdp+tp over several processes)."""
        return self.shards_model and "fsdp" in self.strategy


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """The optimizer (``optim.*``) with its peak LR scaled to the global batch."""

    name: Literal["adamw", "sgd", "lamb", "muon"]
    implementation: Literal["auto", "fused", "foreach", "for-loop"]
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    layer_decay: float
    """Per-layer LR factor (1.0: off); each parameter group's ``lr_scale`` is a power of it."""
    momentum: float
    muon_momentum: float
    ns_steps: int


@dataclasses.dataclass(frozen=True)
class SchedulePlan:
    """The run's length, LR schedule and curriculum stages."""

    lr: float
    """Peak LR (optim.lr scaled to the global batch)."""
    name: Literal["cosine", "constant"]
    warmup_start: float
    min_lr_ratio: float
    duration_unit: Literal["steps", "samples", "seconds"]
    """What measures the run's length: optimizer steps, images, or training seconds (train.budget)."""
    run_length: float
    """Length of the run in its duration unit."""
    warmup: float
    """Warmup length: in steps when the run is measured in steps, otherwise in images."""
    steps_per_epoch: int
    """Optimizer steps per epoch at train.batch_size (the final stage's batch)."""
    num_train: int
    """Training images per epoch."""
    stages: tuple[Stage, ...]
    """Curriculum stages in order; the last is the final one (data.image_size, train.batch_size)."""
    total_steps: int | None
    """Optimizer steps of the whole run, when known before it runs."""
    epochs: float | None
    """Epochs of the whole run, when known before it runs."""

    def stage_at(self, progress: float, epoch: float) -> Stage:
        """The stage for a run ``progress`` (fraction done) and ``epoch`` (fractional)."""
        return next((stage for stage in self.stages if stage.covers(progress, epoch)), self.stages[-1])


@dataclasses.dataclass(frozen=True)
class MixPlan:
    """Mixup/CutMix of the training batches (``data.mixup``, ``data.cutmix`` and the ``data.mix_*`` keys),
    with the label smoothing and class count their soft targets need."""

    mixup_alpha: float
    """Beta(alpha, alpha) of Mixup's lam; 0: no Mixup."""
    cutmix_alpha: float
    """Beta(alpha, alpha) of CutMix's lam; 0: no CutMix (1 when cutmix_minmax is set, as timm)."""
    cutmix_minmax: tuple[float, float] | None
    prob: float
    switch_prob: float
    mode: Literal["batch", "pair", "elem"]
    label_smoothing: float
    num_classes: int


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """What the loaders need: the data.* settings and the facts resolve derived for them."""

    source: DataConfig
    """The data.* settings as validated: source, limits, augmentation, decoding, workers."""
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    seed: int
    device: str
    world: World
    batch: BatchPlan
    mixing: MixPlan | None = None
    """Mixup/CutMix of the training batches, applied by the loop on the device; None: off."""
    crop_geometry: bool = False
    """Training batches also carry each sample's index, crop box and flip (token labeling's dense targets)."""


@dataclasses.dataclass(frozen=True)
class DistillPlan:
    """Knowledge distillation (``train.distill.kind``, DeiT): the teacher to load and how its logits enter the loss."""

    kind: Literal["soft", "hard"]
    alpha: float
    """Weight of the distillation term; the label loss gets 1 - alpha."""
    tau: float
    """Temperature of soft distillation."""
    teacher: str
    """Run folder, checkpoint, .safetensors file or timm model name (``vitrain.weights.teacher.load_teacher``)."""
    teacher_weights: Path | None = None
    teacher_model: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenLabelPlan:
    """Token labeling (``token_labels.maps``): the label maps, the loss weights and MixToken."""

    maps: Path
    """The label-map folder (``vitrain label``'s, or the published per-image maps)."""
    num_classes: int
    dense_weight: float
    cls_weight: float
    ground_truth: bool
    """The class token's target: the mean of the smoothed label and the teacher's (else the teacher's)."""
    mix_token: bool
    mix_alpha: float
    patch_size: int
    """The model's input stride: the auxiliary grid of an image of side S is S // patch_size."""

    def grid(self, image_size: int) -> int:
        """The side of the auxiliary token grid at ``image_size``."""
        return image_size // self.patch_size


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The loss and update settings of the training step besides precision and batch."""

    label_smoothing: float
    """Applied to hard labels; mixed batches carry it inside their soft targets."""
    grad_clip: float | None
    loss: Literal["ce", "bce"] = "ce"
    """Softmax cross-entropy, or binary cross-entropy per class (DeiT III)."""
    distill: DistillPlan | None = None
    """Knowledge distillation from a teacher; None: off."""
    token_labels: TokenLabelPlan | None = None
    """Token labeling; None: off."""


@dataclasses.dataclass(frozen=True)
class RuntimePlan:
    """How this process runs the model: host memory, fused CPU kernels, memory layout."""

    host_allocator: Literal["cached", "system"]
    cpu_kernels: Literal["auto", "fused", "native"]
    channels_last: bool
    amx_tiles: bool = False
    """vitrain's AMX tile kernels may run: the CPU has AMX-BF16, and neither performance.amx nor VITRAIN_AMX is off."""


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """How the loop evaluates, logs and stops."""

    eval_every_epochs: int
    log_every_steps: int
    max_skipped_steps: int
    progress: bool | Literal["auto"]
    init_from: str | None
    """Fine-tune from these model weights (train.init_from: a checkpoint, run folder, .safetensors, timm:NAME)."""
    init_weights: Path | None = None
    """The weights file of a timm:NAME init_from (train.init_weights); None: the Hugging Face cache's."""
    profile: tuple[int, int] | None = None
    """(START, N): trace N steps from step START with torch.profiler (train.profile)."""


@dataclasses.dataclass(frozen=True)
class EmaPlan:
    """The exponential moving average of the weights (``train.ema_*``): what ``vitrain.train.ema`` needs."""

    decay: float = 0.0
    """Decay per update; 0: no EMA."""
    warmup: bool = False
    """Warm the decay up (timm's ModelEmaV3 rule)."""
    every_steps: int = 1
    """Update after every N-th optimizer step."""
    evaluate: bool = False
    """Evaluate the EMA weights at every evaluation (False whenever there is no EMA)."""

    @property
    def enabled(self) -> bool:
        return self.decay > 0


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """Where and when the run checkpoints, and where ``--resume auto`` looks."""

    format: Literal["file", "sharded"]
    keep_last: int
    every_epochs: int
    every_steps: int = 0
    """Also checkpoint at every multiple of this many steps (0: off)."""
    every_s: float = 0.0
    """Also checkpoint when this many wall-clock seconds have passed since the last one (0: off)."""
    sibling_runs: str | None = None
    """A glob of this recipe's run folders when train.out_dir holds {time}: ``--resume auto`` takes the
    newest checkpoint among them; None: only this run's folder."""


@dataclasses.dataclass(frozen=True)
class LogPlan:
    """Where the run's metrics go besides metrics.jsonl (``log.*``): what ``vitrain.metrics.sinks`` needs.
    Paths inside the run folder are left to it, since a resumed run takes the folder of its checkpoint."""

    sinks: tuple[Literal["tensorboard", "mlflow", "wandb", "csv"], ...] = ()
    """The sinks besides metrics.jsonl, each once, in the order given."""
    mlflow_tracking_uri: str | None = None
    """None: the local file store <run folder>/mlruns."""
    mlflow_experiment: str = "vitrain"
    wandb_project: str = "vitrain"
    wandb_mode: Literal["offline", "online"] = "offline"
    run_name: str | None = None
    """None: the run folder's name."""

    def name_of(self, out_dir: Path) -> str:
        """The run's name in the tracking tools."""
        return self.run_name or out_dir.name


@dataclasses.dataclass(frozen=True)
class MeasuredPrecision:
    """What ``precision=auto``, ``precision_mode=auto`` and ``performance.cpu_kernels=auto`` chose by timing the run's
    own training step on this machine (:mod:`vitrain.train.precision_choice`); a fact ``resolve()`` is given."""

    precision: Literal["fp32", "bf16", "fp16"]
    mode: Literal["autocast", "o2", "full"]
    cpu_kernels: Literal["auto", "native"]
    """auto: the fused CPU kernels were faster (or cannot apply); native: PyTorch's ops were."""
    img_s: dict[str, float]
    """Each measured candidate's training img/s (``bf16 o2 + fused kernels``: its label)."""
    chosen: str
    """The label of the fastest candidate."""
    batch: int
    """Images per step of the measurement (the run's per-process batch, or less where a step took seconds)."""
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    """Candidates not measured, and why (cannot run here, or cannot win)."""
    cached: bool = False
    """The figures came from the cache of an earlier measurement of the same key."""

    def describe(self) -> str:
        """``bf16 o2 + fused kernels (img/s at batch 256: fp32 610, ...; cached)``."""
        rates = ", ".join(f"{label} {rate:.0f}" for label, rate in self.img_s.items())
        skipped = "".join(f"; {label}: {why}" for label, why in self.skipped.items())
        return f"{self.chosen} (img/s at batch {self.batch}: {rates}{skipped}{'; cached' if self.cached else ''})"

    def record(self) -> dict[str, Any]:
        """The summary's and show-config's fields."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A resolved run: its parts and the config it came from. Immutable."""

    config: Config
    """The config as given: recorded (checkpoints, config.yaml, summary), never read to run."""
    device: str
    out_dir: Path
    seed: int
    world: World
    """The processes sharing the run; batches are global, each data slice takes its share."""
    model: ModelPlan
    batch: BatchPlan
    precision: PrecisionPolicy
    parallel: ParallelPlan
    optim: OptimizerPlan
    schedule: SchedulePlan
    data: DataPlan
    step: StepPlan
    runtime: RuntimePlan
    loop: LoopPlan
    checkpoint: CheckpointPlan
    ema: EmaPlan = EmaPlan()
    """The weight EMA (off by default)."""
    log: LogPlan = LogPlan()
    """The metric sinks besides metrics.jsonl (none by default)."""
    measured: MeasuredPrecision | None = None
    """The measured choice behind an ``auto`` precision, mode or CPU kernels setting (None: none was made)."""
