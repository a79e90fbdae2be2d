"""The typed sections of a run's configuration: every field with its default and a one-line doc.

Unknown keys and wrong types fail validation (``extra="forbid"``); :mod:`vitrain.config.loading`
turns that into a :class:`ConfigError` naming the dotted key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ConfigError(ValueError):
    """A user mistake in the configuration or its resources; the CLI exits with code 2."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


CUDA_ONLY_IMPLS = ("sdpa_efficient", "sdpa_cudnn")
"""Pinned SDPA kernels (``model.attn_impl``) that exist on CUDA only (the CPU has flash and math)."""

CUDA_HALF_ONLY_IMPLS = ("sdpa_flash", "sdpa_cudnn")
"""Pinned SDPA kernels that take only bf16/fp16 inputs on CUDA."""


class ModelConfig(Section):
    name: str = "locality_vit_tiny6_patch7"
    """Registered model variant (see `vitrain list-models`)."""
    patch_size: int | None = Field(None, ge=1)
    """Patch size override; the variant's own when unset."""
    head: Literal["cls", "gap"] | None = None
    """Classifier input: CLS token or global average pool of the patch tokens; variant's when unset."""
    stem: Literal["patch", "conv"] | None = None
    """ViTs: patch (one strided convolution) or conv (Xiao et al. 2021: 3x3 stride-2 convolutions with
    BatchNorm and ReLU, then 1x1; power-of-two patch sizes); the variant's (patch) when unset."""
    mlp_ratio: float | None = Field(None, gt=0.0)
    """FFN hidden size over embedding width; the variant's (4 for ViTs) when unset."""
    num_heads: int | None = Field(None, ge=1)
    """Attention heads (must divide the embedding width); the variant's when unset."""
    attn_impl: Literal["auto", "sdpa", "matmul", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math"] | None = (
        None
    )
    """Attention kernel: torch SDPA (flash/efficient/cuDNN/math chosen by torch), explicit matmuls, SDPA
    pinned to one kernel (sdpa_flash, sdpa_math; on CUDA also sdpa_efficient, sdpa_cudnn), or auto (the
    candidates timed on this device at the run's shape when the model is built, the fastest kept, the
    result cached in ~/.cache/vitrain; on CUDA the pinned SDPA kernels are candidates too); the variant's
    (sdpa) when unset."""
    attn_softmax_fp32: bool | None = None
    """Matmul attention: scores q.k^T and softmax in fp32 under fp16/bf16 (DeiT's fix for fp16 NaN
    losses; SDPA's kernels do this already); the variant's (off) when unset."""
    drop_rate: float | None = Field(None, ge=0.0, lt=1.0)
    """Dropout on embeddings, MLP outputs and before the head; the variant's (0) when unset."""
    attn_drop_rate: float | None = Field(None, ge=0.0, lt=1.0)
    """Dropout on attention probabilities; the variant's (0) when unset."""
    drop_path_rate: float | None = Field(None, ge=0.0, lt=1.0)
    """Stochastic depth rate of the last block (linearly increasing from 0); the variant's when unset."""
    distill_token: bool | None = None
    """ViTs with a CLS head: DeiT's distillation token and second classifier (``head_dist``), trained against
    the teacher by train.distill.kind; the model's logits are the mean of both heads. The variant's when unset
    (on for deit_*_distilled_patch16)."""
    aux_head: bool | None = None
    """Token labeling's auxiliary head: a classifier on every patch token (ViTs' ``aux_head``, VOLO's
    ``use_aux_head``); predictions add 0.5 x its max over tokens to the class logits. Not with
    model.distill_token. The variant's when unset (off for ViTs, on for VOLO)."""


RANDAUGMENT_FORM = (
    "the form is timm's: rand, then dash-separated options in any order, e.g. rand-m9-mstd0.5-inc1: "
    "-m<magnitude, integer >= 0> -n<ops per image, integer >= 1> -p<probability of each op, 0-1> "
    "-mstd<magnitude std, >= 0; above 100: uniform in 0..m> -mmax<magnitude cap, integer >= 1> "
    "-inc<0|1: ops whose strength grows with the magnitude> -t<weights|3a|3aw: timm's op set>"
)
"""How a RandAugment policy is written, for error messages."""

RANDAUGMENT_OPTIONS = {
    "m": (int, 0.0, float("inf")),
    "n": (int, 1.0, float("inf")),
    "p": (float, 0.0, 1.0),
    "mstd": (float, 0.0, float("inf")),
    "mmax": (int, 1.0, float("inf")),
    "inc": (int, 0.0, 1.0),
}
"""The numeric options of timm's ``rand_augment_transform``: type and range of each."""

RANDAUGMENT_OP_SETS = ("weights", "3a", "3aw")
"""timm's named op sets (-t<name>); any other name would silently fall back to the default set."""


def _randaugment_section_problem(section: str) -> str | None:
    if section.startswith("t"):
        return None if section[1:] in RANDAUGMENT_OP_SETS else f"unknown op set '{section}'"
    key, text = re.fullmatch(r"([a-z]*)(.*)", section).groups()
    if not section:
        return "an empty option (two dashes in a row, or one at the end)"
    if key not in RANDAUGMENT_OPTIONS:
        return f"unknown option '{section}'"
    kind, low, high = RANDAUGMENT_OPTIONS[key]
    if not re.fullmatch(r"\d+" if kind is int else r"\d+(\.\d*)?", text):
        return f"-{key} takes {'an integer' if kind is int else 'a number'}, got '{text}'"
    return None if low <= kind(text) <= high else f"-{key}{text} is out of range"


def randaugment_problem(policy: str) -> str | None:
    """What is wrong with a RandAugment policy string (None: timm reads it as written)."""
    head, *sections = policy.split("-")
    if head != "rand":
        return f"'{policy}' does not start with 'rand'"
    keys = [re.match(r"t|[a-z]*", section).group() for section in sections]
    repeated = next((key for key in keys if key and keys.count(key) > 1), None)
    if repeated is not None:
        return f"option -{repeated} is given twice"
    return next(filter(None, map(_randaugment_section_problem, sections)), None)


class DataConfig(Section):
    name: Literal["fashion-mnist", "imagefolder", "webdataset", "synthetic"] = "fashion-mnist"
    """Data source."""
    root: Path | str | None = None
    """Dataset folder; fashion-mnist defaults to /usr/share/datasets/fashion-mnist. webdataset: a folder written by
    `vitrain shard` or the training shards' pattern (DIR/train-{000000..000127}.tar; pipe:COMMAND and URLs kept as
    text)."""
    image_size: int = Field(28, ge=1)
    """Side of the square model input, in pixels."""
    val_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    """Image folders and CSV lists without a validation split (no val/, no split column): this fraction of each
    class's images is held out for evaluation, the same images in every run (chosen by a hash of their paths);
    the list is written to the run folder (val_split.json)."""
    limit_train: int | None = Field(None, ge=1)
    """Use only the first N training samples (quick runs)."""
    limit_eval: int | None = Field(None, ge=1)
    """Use only the first N evaluation samples (quick runs)."""
    num_workers: int = Field(4, ge=0)
    """Decode worker processes for file-backed sources (in-memory sources need none); data.backend=dali: its
    CPU threads (at least 1)."""
    decode: Literal["cpu", "gpu"] = "cpu"
    """data.backend=pillow: where image files are decoded; gpu, JPEGs in batches on the run's CUDA device
    (torchvision.io.decode_jpeg, nvJPEG) with crop, flip and resize there, the workers only reading bytes."""
    backend: Literal["pillow", "dali"] = "pillow"
    """Decoder of file-backed sources (imagefolder, webdataset): pillow, worker processes with Pillow and
    torchvision transforms; dali, NVIDIA DALI pipelines (extra vitrain[dali]) decoding on the GPU with CUDA and
    on CPU threads otherwise, with crop, flip, erasing and translation only (docs/data.md)."""
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    """Image folders: stop when more than this fraction of a split's files cannot be decoded (below it each is
    skipped, replaced by the next decodable file and counted in summary.json); 0 stops at the first."""
    max_image_pixels: int = Field(2 * 89_478_485, ge=1)
    """Image folders: a file with more pixels is refused as a decompression bomb (default: Pillow's own limit)."""
    scale: tuple[float, float] = (0.08, 1.0)
    """RandomResizedCrop area range, as fractions of the image."""
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    """RandomResizedCrop aspect-ratio range."""
    hflip: float = Field(0.5, ge=0.0, le=1.0)
    """Probability of a horizontal flip."""
    translate: int = Field(0, ge=0)
    """Random translation after the crop: shift by up to this many pixels along each axis, filling with
    black (torchvision's RandomCrop(image_size, padding=translate)); 0 turns it off."""
    random_erase: float = Field(0.0, ge=0.0, le=1.0)
    """Probability of random erasing (Zhong et al. 2017, timm's rule): one rectangle of 2-33 % of the
    image, aspect ratio 0.3-3.3, replaced by uniform noise; 0 turns it off."""
    randaugment: str | None = None
    """RandAugment policy in timm's form, e.g. rand-m9-mstd0.5-inc1 (DeiT's): rand, then -m<magnitude>
    -n<ops per image> -p<op probability> -mstd<magnitude std> -mmax<magnitude cap> -inc<0|1> -t<op set>;
    timm's ops, applied per image after the crop (in-memory sources too: docs/data.md); null turns it off."""
    three_augment: bool = False
    """3-Augment (DeiT III, Touvron et al. 2022, sec. 3): after the crop each image gets one of grayscale,
    solarization (threshold 128) or Gaussian blur (sigma 0.1-2), chosen uniformly."""
    color_jitter: float = Field(0.0, ge=0.0, le=1.0)
    """Color jitter strength: brightness, contrast and saturation each scaled by a factor drawn from
    [1 - s, 1 + s], in random order, per image (DeiT III: 0.3 with 3-Augment); 0 turns it off."""
    repeated_aug: int = Field(1, ge=1)
    """Repeated augmentation (Hoffer et al. 2020; DeiT uses 3): each epoch takes 1/N of the training images,
    each N times with its own augmentation, so an epoch keeps its length; 1 turns it off."""
    crop_pct: float = Field(0.875, gt=0.0, le=2.0)
    """Eval: resize the short side to image_size / crop_pct, then center-crop image_size; above 1 (VOLO-D5:
    1.15) the resized image is smaller than the crop and the border is padded with black, as in timm."""
    mean: tuple[float, ...] | None = None
    """Per-channel normalization mean (0..1 scale); the source's default when unset."""
    std: tuple[float, ...] | None = None
    """Per-channel normalization std (0..1 scale); the source's default when unset."""
    synthetic_num_train: int = Field(4096, ge=1)
    """Synthetic source: number of training samples."""
    synthetic_num_eval: int = Field(1024, ge=1)
    """Synthetic source: number of evaluation samples."""
    synthetic_num_classes: int = Field(10, ge=2)
    """Synthetic source: number of classes."""
    mixup: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Mixup alpha (Zhang et al. 2018): blend each image with its partner by lam ~ Beta(alpha, alpha); 0 turns it off."""
    cutmix: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """CutMix alpha (Yun et al. 2019): paste a box of the partner covering 1 - lam of the image; 0 turns it off."""
    cutmix_minmax: tuple[float, float] | None = None
    """CutMix box sides drawn uniformly between these fractions of the image sides, lam from the box area
    (timm's rule); setting it turns CutMix on, whatever data.cutmix; null: the box from lam."""
    mix_prob: float = Field(1.0, ge=0.0, le=1.0)
    """Probability that a batch (mix_mode=batch) or an image or pair is mixed, when mixup or cutmix is on."""
    mix_switch_prob: float = Field(0.5, ge=0.0, le=1.0)
    """With both mixup and cutmix on: probability of CutMix rather than Mixup for each mixing."""
    mix_mode: Literal["batch", "pair", "elem"] = "batch"
    """Mixing parameters drawn once per batch, per pair of images, or per image (timm's modes); each image's
    partner is the one at the mirrored position of this process's batch."""
    wds_eval_shards: str | None = None
    """webdataset with a pattern as data.root: the evaluation shards' pattern; null: data.root's pattern with the
    last 'train' of its file name replaced by 'val'."""
    wds_image_keys: str = "jpg;jpeg;png;webp"
    """webdataset: the sample entries that may hold the image (file extensions in the tar), tried in order."""
    wds_label_key: str = "cls"
    """webdataset: the entry holding the class index, as text (cls), or KEY:FIELD for a field of a JSON entry
    (json:label)."""
    wds_shuffle_buffer: int = Field(1000, ge=0)
    """webdataset training: samples held in each loader worker's shuffle buffer (besides the per-epoch shard
    order); 0 turns it off."""

    @field_validator("root", mode="before")
    @classmethod
    def _keep_url_text(cls, value: object) -> object:
        """A ``pipe:`` command or URL stays text: a path would fold its ``//``."""
        if isinstance(value, str) and not (value.startswith("pipe:") or "://" in value):
            return Path(value)
        return value

    @field_validator("cutmix_minmax")
    @classmethod
    def _check_minmax(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not 0 < value[0] < value[1] <= 1:
            raise ValueError(f"must be (min, max) with 0 < min < max <= 1 (fractions of the image side), got {value}")
        return value

    @field_validator("randaugment")
    @classmethod
    def _check_randaugment(cls, value: str | None) -> str | None:
        if not value:
            return None
        problem = randaugment_problem(value)
        if problem:
            raise ValueError(f"{problem}; {RANDAUGMENT_FORM}")
        return value

    @field_validator("scale", "ratio")
    @classmethod
    def _check_range(cls, value: tuple[float, float], info) -> tuple[float, float]:
        low, high = value
        if not 0 < low <= high:
            raise ValueError(f"must be (low, high) with 0 < low <= high, got {value}")
        if info.field_name == "scale" and high > 1:
            raise ValueError(f"must not exceed 1.0 (a fraction of the image area), got {value}")
        return value


class OptimConfig(Section):
    name: Literal["adamw", "sgd", "muon", "lamb"] = "adamw"
    """Optimizer. muon: Muon (orthogonalized momentum) on the blocks' weight matrices and AdamW (betas,
    eps) on the rest (embeddings, head, norms, biases, depthwise kernels), one lr and weight decay.
    lamb: LAMB (You et al. 2020) for large batches: the Adam step (betas, eps) with weight decay, scaled
    per tensor by ||w|| / ||update|| (NVIDIA's variant, as apex and timm; eps 1e-6 is theirs)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """fused: one kernel for all parameters; foreach: multi-tensor ops (pycls's "MTA"); for-loop: one
    parameter at a time; auto: fused where torch has it for the device (CPU and CUDA), else foreach."""
    lr: float = Field(1e-3, gt=0.0)
    """Base learning rate at optim.reference_batch; scaled linearly to the global batch."""
    reference_batch: int = Field(1024, ge=1)
    """Batch size at which optim.lr applies (lr = lr * global_batch / reference_batch)."""
    weight_decay: float = Field(0.05, ge=0.0)
    """Decoupled weight decay (LAMB: L2 inside its update); never on norms, biases, position embeddings or tokens."""
    layer_decay: float = Field(1.0, gt=0.0, le=1.0)
    """Layer-wise LR decay for fine-tuning: layer i of L below the head trains at lr * layer_decay^(L + 1 - i)
    (BEiT, DeiT III: 0.65-0.75); 1.0 turns it off."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """SGD momentum (Nesterov off)."""
    muon_momentum: float = Field(0.95, ge=0.0, lt=1.0)
    """Muon's Nesterov momentum (optim.name=muon)."""
    ns_steps: int = Field(5, ge=1, le=20)
    """Newton-Schulz iterations per Muon update (optim.name=muon)."""
    grad_clip: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value; null disables clipping."""


class ScheduleConfig(Section):
    name: Literal["cosine", "constant"] = "cosine"
    """LR decay after warmup."""
    warmup_epochs: float = Field(0.0, ge=0.0)
    """Linear warmup length, in epochs (fractions allowed)."""
    warmup_start: float = Field(0.0, ge=0.0, le=1.0)
    """Warmup starts at this fraction of the peak LR."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the decay, as a fraction of the peak LR."""


class EmaConfig(Section):
    """An exponential moving average of the weights (fp32: ema = decay * ema + (1 - decay) * weights after each
    update), checkpointed and evaluated beside the live weights; off while decay is 0."""

    decay: float = Field(0.0, ge=0.0, lt=1.0)
    """The EMA's decay per update; 0 turns it off (DeiT: 0.99996)."""
    warmup: bool = False
    """Warm the decay up as timm's ModelEmaV3: min(decay, 1 - (1 + t)^(-2/3)) at optimizer step t + 1."""
    every_steps: int = Field(1, ge=1)
    """Update the EMA every N optimizer steps (the decay applies per update)."""
    evaluate: bool = True
    """Evaluate the EMA weights beside the live ones at every evaluation (ema_top1 in metrics and summary)."""


class DistillConfig(Section):
    """Knowledge distillation from a frozen teacher (DeiT, Touvron et al. 2021)."""

    kind: Literal["none", "soft", "hard"] = "none"
    """soft (KL divergence to the teacher's softened probabilities) or hard (cross-entropy to the teacher's top
    class), on the distillation head's logits (the class head's when the model has no distillation token);
    none: off."""
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    """Weight of the distillation term; the label loss gets 1 - alpha (DeiT: 0.5)."""
    tau: float = Field(1.0, gt=0.0)
    """Temperature of soft distillation (DeiT: 1.0); hard distillation ignores it."""
    teacher: str | None = None
    """The teacher: a vitrain run folder or checkpoint (step-N.pt or sharded step-N/), a .safetensors file
    written by `vitrain export`, or a timm model name (then train.distill.teacher_weights)."""
    teacher_weights: Path | None = None
    """Weights of a timm-name teacher: a local .safetensors, .pth or .bin file (nothing is downloaded)."""
    teacher_model: str | None = None
    """vitrain model name of a .safetensors teacher whose metadata holds no config (not written by
    `vitrain export`)."""


class TrainConfig(Section):
    batch_size: int = 256
    """Global batch size (images per optimizer step); the final curriculum stage's."""
    epochs: float | None = Field(10.0, gt=0.0)
    """Training length in epochs (fractions allowed), unless train.steps, train.samples or train.budget is set.
    Setting one of the four in a --config file or --set clears the other three."""
    steps: int | None = Field(None, ge=1)
    """Training length in optimizer steps; replaces train.epochs when set."""
    samples: int | None = Field(None, ge=1)
    """Training length in images; replaces train.epochs when set."""
    budget: str | None = None
    """Training length in wall-clock training seconds (evaluation and checkpoints excluded), e.g. 600s, 10m,
    24h, 1h30m; the LR schedule and curriculum are planned against the fraction of it used."""
    init_from: str | None = None
    """Fine-tune: start from these model weights (position embeddings resampled to data.image_size, the
    classifier re-initialized when the class count differs): a checkpoint (step-N.pt file or sharded folder),
    a run folder (its best checkpoint), a .safetensors file of `vitrain export`, or timm:NAME (timm's
    weights of model NAME: train.init_weights, else the local Hugging Face cache; nothing is downloaded).
    Optimizer, schedule and counters start fresh. A resumed run continues from its own checkpoint instead."""
    init_weights: Path | None = None
    """The weights file (.safetensors, .pth, .bin) of a train.init_from=timm:NAME; unset: the file the local
    Hugging Face cache holds for NAME."""
    eval_batch_size: int | None = None
    """Evaluation batch size; twice train.batch_size when unset."""
    eval_every_epochs: int = Field(1, ge=0)
    """Evaluate every N epochs (0: only at the end)."""
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    """Label smoothing of the training loss (with mixup/cutmix: of the one-hot targets before they are mixed)."""
    loss: Literal["ce", "bce"] = "ce"
    """Training loss: ce (softmax cross-entropy) or bce (DeiT III: binary cross-entropy of each class's logit
    against the smoothed, possibly mixed, one-hot target; timm's BinaryCrossEntropy without a threshold)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Gradient accumulation: images per forward/backward on each process; every step accumulates over
    its share of the global batch in pieces of this size (null: the whole share at once)."""
    seed: int = 0
    """Seed of model init, data order and augmentation."""
    device: str = "auto"
    """auto (CUDA if present, else CPU), cpu, cuda or cuda:N."""
    out_dir: str = "runs/{recipe}-{time}"
    """Run folder; {recipe} and {time} are filled in at start."""
    profile: str | None = None
    """START:N: a torch.profiler trace of N training steps from step START (0-based) into <run>/profile/:
    Chrome/TensorBoard trace, operator tables, and on CUDA a memory snapshot; the paths in summary.json."""

    @field_validator("profile", mode="before")
    @classmethod
    def _profile_as_text(cls, value: Any) -> str | None:
        return None if value is None else str(value)  # a bare START reads as a number; resolve() explains

    log_every_steps: int = Field(50, ge=1)
    """Write a metrics line every N steps (the only steps that synchronize with the device)."""
    max_skipped_steps: int = Field(16, ge=0)
    """A step whose loss or gradient norm is NaN/inf changes nothing (no update, like fp16 loss scaling);
    more than this many such steps in a row stop the run with a diagnostic. 16: fp16's loss scale starts
    at 2^16 and halves per skipped step, so a 17th skip in a row would happen at scale 1 (no scaling)."""
    progress: bool | Literal["auto"] = "auto"
    """Live progress bar (true/false); auto shows it only on a terminal."""
    ema: EmaConfig = EmaConfig()
    """The weight EMA (train.ema.decay turns it on)."""
    distill: DistillConfig = DistillConfig()
    """Knowledge distillation (train.distill.kind turns it on)."""


class TokenLabelConfig(Section):
    """Token labeling (Jiang et al. 2021; VOLO): every patch token is trained against a teacher's label map cut
    to its crop (docs/token-labeling.md)."""

    maps: Path | None = None
    """A folder of label maps from `vitrain label` (or the published per-image TokenLabeling maps); setting it
    turns token labeling on (needs a model with an auxiliary head: model.aux_head=true for ViTs); null: off."""
    mix_token: bool = False
    """MixToken: a CutMix box on the token grid after the patch embedding, each image mixed with its partner of
    the mirrored batch position; replaces data.mixup/cutmix."""
    mix_token_alpha: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    """MixToken: the share of own tokens is drawn from Beta(alpha, alpha) (VOLO and LV-ViT: 1.0)."""
    dense_weight: float = Field(0.5, ge=0.0, allow_inf_nan=False)
    """Weight of the mean per-token loss (VOLO: 0.5, LV-ViT: 0.5)."""
    cls_weight: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    """Weight of the class-token loss."""
    ground_truth: bool = False
    """The class token's target is the mean of the (smoothed) ground-truth label and the teacher's map over the
    crop (the toolbox's --ground-truth); false: the teacher's alone (its default)."""


class PerformanceConfig(Section):
    """How the step computes, none of which changes what it computes beyond rounding: memory, kernels, layout,
    recomputation, compilation."""

    activation_checkpointing: Annotated[int, Field(ge=0)] | Literal["all"] = 0
    """Recompute the activations of the first N blocks in the backward pass (all: every block; 0: off)."""
    channels_last: bool = False
    """NHWC memory format for the model's convolution weights and its input images (cuDNN and oneDNN
    convolutions run faster on it: ResNet, VOLO; ViT has one convolution, the patch embedding)."""
    fp8_scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    """precision=fp8: the scale of each FP8 cast, one per tensor (tensorwise: fastest) or one per row
    (rowwise: closer to bf16 where rows differ in range)."""
    host_allocator: Literal["cached", "system"] = "cached"
    """CPU memory: cached keeps freed memory in the process for reuse (glibc: no mmap per large tensor,
    no trimming), so a step's tensors stop page-faulting in fresh pages (docs/benchmarks.md, "What each
    technique buys"); system: the C library's defaults (memory handed back as freed)."""
    cpu_kernels: Literal["auto", "fused", "native"] = "auto"
    """Fused CPU kernels for bf16 tensors outside autocast (O2, full): LayerNorm with float32 statistics and
    gradient sums, and more (vitrain/kernels). auto: the run's step is timed with and without them and the
    faster is taken; they are built (first use, cached; needs g++ and ninja) only where bf16 is within their
    reach of the fastest candidate; fused: fail if they cannot be built; native: PyTorch's own ops."""
    amx: bool = True
    """vitrain's AMX tile kernels where the CPU has AMX-BF16 (unless the environment sets VITRAIN_AMX=off); off
    (false): never. oneDNN's own use of AMX is unaffected."""
    compile: bool = False
    """torch.compile each block (one graph reused by every block of a shape: compiles faster than the whole
    model). Every shape the run will use (each curriculum stage, accumulation pieces, evaluation; the last
    eval batch is padded) is compiled before the training clock starts, so budgets do not pay for it."""
    compile_backend: str = "inductor"
    """torch.compile backend (inductor; cudagraphs, aot_eager, ... for debugging)."""
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"
    """Inductor's mode: default, or max-autotune-no-cudagraphs (matrix products and convolutions tried in
    several generated kernels and the fastest kept; on GPUs, compiling takes minutes longer)."""


class CurriculumStage(Section):
    until: float = Field(gt=0.0, le=1.0)
    """The stage lasts until this fraction of the run (in the run's duration unit) is done."""
    image_size: int = Field(ge=1)
    """Image side during the stage (a multiple of the patch size)."""
    batch_size: int | None = Field(None, ge=1)
    """Batch size during the stage; from curriculum.batch_rule when unset."""
    lr_scale: float = Field(1.0, gt=0.0)
    """Multiplier of the scheduled LR during the stage."""


class CurriculumConfig(Section):
    """Image-size curriculum: early stages at lower resolution (Borealis: Irandoust et al. 2022). The run ends at
    data.image_size with train.batch_size; evaluation is always at data.image_size."""

    stages: list[CurriculumStage] = []
    """Explicit stages before the final one, in order of `until`."""
    start_size: int | None = Field(None, ge=1)
    """Linear rule: start at this size and grow by curriculum.grow_by every curriculum.grow_every_epochs
    epochs up to data.image_size (the paper's best: 32, +32, every 5 epochs, to 224)."""
    grow_by: int = Field(32, ge=1)
    """Linear rule: pixels added at each growth."""
    grow_every_epochs: float = Field(5.0, gt=0.0)
    """Linear rule: epochs per size."""
    batch_rule: Literal["fixed", "constant_tokens"] = "fixed"
    """Batch size of stages that do not set one: fixed (train.batch_size) or constant_tokens (train.batch_size
    times the final stage's tokens per image over the stage's, so each step carries as many tokens)."""


class CheckpointConfig(Section):
    every_epochs: int = Field(1, ge=0)
    """Save every N epochs (0: only at the end)."""
    format: Literal["auto", "file", "sharded"] = "auto"
    """file: one step-N.pt holding the full model and optimizer (rank 0 writes; FSDP/TP gather first);
    sharded: a step-N/ folder written by every rank with torch.distributed.checkpoint, loadable at any
    process count; auto: sharded for fsdp/tp runs of several processes, else file."""
    every_steps: int = Field(0, ge=0)
    """Also save every N optimizer steps, mid-epoch included (0: off); a resumed run still ends bitwise equal."""
    every_minutes: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Also save when this many wall-clock minutes (evaluation included) have passed since this process's
    last checkpoint or its start (0: off): bounds the work a crash or a kill can lose."""
    keep_last: int = Field(2, ge=1)
    """Keep this many newest checkpoints, and also the one with the best eval top-1 (checkpoints/best.json)."""


class LogConfig(Section):
    """Where a run's metrics go: metrics.jsonl always, and the tools listed in log.sinks (docs/monitoring.md)."""

    sinks: list[Literal["jsonl", "tensorboard", "mlflow", "wandb", "csv"]] = ["jsonl"]
    """Metric sinks: tensorboard (event files in the run folder's tb/), mlflow, wandb, csv (metrics-<event>.csv
    in the run folder, one table per record kind); metrics.jsonl is always written, listed or not. Each tool
    comes with its extra: pip install 'vitrain[tensorboard]', 'vitrain[mlflow]', 'vitrain[wandb]'."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store (http://host:5000, file:/path, sqlite:///mlflow.db); null: the local file
    store <run folder>/mlruns (browse it with `mlflow ui --backend-store-uri <run folder>/mlruns`)."""
    mlflow_experiment: str = "vitrain"
    """MLflow experiment the run is logged under (created when missing)."""
    wandb_project: str = "vitrain"
    """Weights & Biases project of the run."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: W&B writes the run into the run folder's wandb/ only (upload later with `wandb sync`);
    online: streams it to the W&B server (needs `wandb login` or WANDB_API_KEY)."""
    run_name: str | None = None
    """The run's name in MLflow and W&B; null: the run folder's name."""


class ParallelConfig(Section):
    strategy: Literal["ddp", "fsdp", "tp", "fsdp+tp"] = "ddp"
    """How several processes (torchrun) share the work. ddp: every process holds the model, gradients are
    averaged; fsdp: FSDP2 shards parameters, gradients and optimizer state over the processes (per block,
    then the root); tp: tensor parallelism inside each ViT block (column-parallel qkv/fc1, row-parallel
    proj/fc2), every process sees the same batch; fsdp+tp: a 2-D mesh, TP inside groups of parallel.tp_size
    processes and FSDP across them. In every mode the global batch means what it means in one process."""
    tp_size: int = Field(0, ge=0)
    """Processes per tensor-parallel group (fsdp+tp: required; tp: 0 means all processes)."""
    fsdp_reshard: Literal["zero3", "zero2"] = "zero3"
    """FSDP: zero3 frees each block's gathered parameters after its forward (least memory, gathers again in
    backward); zero2 keeps them gathered until the backward (one all-gather per step, more memory)."""
    fsdp_cpu_offload: bool = False
    """FSDP: keep the sharded parameters, gradients and optimizer state in host memory (CUDA only)."""
    timeout_s: float = Field(600.0, gt=0.0)
    """Collective timeout from the first step (before it, 30 min at least: rank 0 measures alone): a peer
    that died or hangs fails the job instead of hanging it."""


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    recipe: str = "custom"
    """Name of the recipe this config came from."""
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    """Compute precision: fp32, or bf16/fp16 (fp16 with loss scaling). auto: the run's own training step is
    timed in fp32 and in bf16 (where the device has bf16) before it starts, and the faster is taken (cached per
    machine and model shape; vitrain.train.precision_choice). bf16 asked for on a CPU without native bf16
    (AVX512-BF16 or AMX) runs emulated: correct, slower than fp32. fp8: bf16, with the linear layers of the
    blocks (qkv, proj, fc1, fc2; not the patch embedding or the head) in FP8 through torchao's float8
    training (performance.fp8_scaling; pip install 'vitrain[fp8]'); GPUs of compute capability 8.9+ (Ada,
    Hopper, Blackwell); on a CPU torchao emulates it (slow: for tests)."""
    precision_mode: Literal["auto", "autocast", "o2", "full"] = "autocast"
    """autocast: fp32 weights cast per op (O1); o2: a bf16/fp16 copy of the model computes, fp32 master
    weights are updated; full: weights, gradients and optimizer state all in bf16/fp16, no master copy
    (pycls's "full FP16": fastest and leanest, but updates smaller than the weights' precision are lost
    and can cost accuracy; BatchNorm stays fp32); auto: autocast and o2 both timed, the faster taken. No
    effect at fp32."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig()
    token_labels: TokenLabelConfig = TokenLabelConfig()
    performance: PerformanceConfig = PerformanceConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    parallel: ParallelConfig = ParallelConfig()
    log: LogConfig = LogConfig()
