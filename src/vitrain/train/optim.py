"""Optimizer construction: parameter groups with weight-decay exclusion and layer-wise LR decay
(``optim.layer_decay``), Muon for the hidden matrices (``optim.name=muon``) and LAMB for large
batches (``optim.name=lamb``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.adam import adam as adam_update
from torch.optim.adamw import adamw as adamw_update

from vitrain.config import ConfigError, OptimizerPlan
from vitrain.config.precision import PrecisionPolicy
from vitrain.parallel.distributed import holds_dtensors

# Muon's quintic Newton-Schulz coefficients (Jordan et al. 2024, github.com/KellerJordan/Muon): chosen
# for the steepest slope at zero, so five steps bring every singular value into about [0.7, 1.2].
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Muon's update scaled to the RMS of a typical AdamW update (Liu et al. 2025, "Muon is Scalable for
# LLM Training", §2.2): both kinds of parameter then share one learning rate and weight decay.
ADAMW_MATCHED_RMS = 0.2


def evaluate_closure(closure) -> torch.Tensor | None:
    """The loss of an optimizer's ``step(closure)`` (torch's convention: the closure runs with grad on)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def adam_state(state: dict, parameter: torch.Tensor, step_device: torch.device | str = "cpu") -> dict:
    """``state`` holding what torch.optim.AdamW keeps for ``parameter`` (created on first use): a step
    count (on the parameter's device for the fused kernels) and the two moments."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
        state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
    return state


NamedParameters = list[tuple[str, nn.Parameter]]


def trainable_parameters(model: nn.Module) -> NamedParameters:
    return [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]


def split_weight_decay(model: nn.Module, named: NamedParameters, weight_decay: float) -> list[dict]:
    """[decayed, not decayed]: decay matrices and conv kernels; never norms, biases, position
    embeddings or tokens (``model.no_weight_decay()``)."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay = [parameter for name, parameter in named if parameter.ndim > 1 and name not in skip]
    chosen = {id(parameter) for parameter in decay}
    no_decay = [parameter for _, parameter in named if id(parameter) not in chosen]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def layer_lr_scale(layer_id: int, num_layers: int, layer_decay: float) -> float:
    """``layer_decay ** (num_layers + 1 - layer_id)``: 1 for the head, one more factor per layer below it
    down to the embeddings (ELECTRA's layer-wise LR decay, Clark et al. 2020, as BEiT, Bao et al. 2022,
    fine-tunes ViTs; timm's ``param_groups_layer_decay``)."""
    return layer_decay ** (num_layers + 1 - layer_id)


def split_by_layer(
    model: nn.Module, named: NamedParameters, layer_decay: float, split: Callable[[NamedParameters], list[dict]]
) -> list[dict]:
    """``split``'s groups for each layer (``model.layer_id``), from the embeddings to the head, each
    with its ``lr_scale``, the factor :func:`vitrain.train.schedule.apply_lr` multiplies the
    scheduled LR by. Empty groups are left out."""
    by_layer: dict[int, NamedParameters] = {}
    for name, parameter in named:
        by_layer.setdefault(model.layer_id(name), []).append((name, parameter))
    groups = []
    for layer_id in sorted(by_layer):
        scale = layer_lr_scale(layer_id, model.num_layers, layer_decay)
        groups.extend({**group, "lr_scale": scale} for group in split(by_layer[layer_id]) if group["params"])
    return groups


def build_param_groups(model: nn.Module, weight_decay: float, layer_decay: float = 1.0) -> list[dict]:
    """The weight-decay split (:func:`split_weight_decay`); with ``layer_decay < 1`` that split within
    each layer, each group scaled by :func:`layer_lr_scale`."""
    named = trainable_parameters(model)
    split = partial(split_weight_decay, model, weight_decay=weight_decay)
    if layer_decay == 1.0:
        return split(named)
    return split_by_layer(model, named, layer_decay, split)


def is_hidden_matrix(parameter: torch.Tensor) -> bool:
    """A weight that maps features to features: a linear or (grouped) conv weight with more than one
    input channel per group. Depthwise kernels (one input channel) are per-channel filters, not
    matrices, and stay with AdamW."""
    return parameter.ndim == 2 or (parameter.ndim > 2 and parameter.shape[1] > 1)


def build_muon_param_groups(model: nn.Module, weight_decay: float, layer_decay: float = 1.0) -> list[dict]:
    """Muon for the hidden matrices of the repeated blocks (``model.block_modules()``); AdamW for the
    rest: the input embedding and the classifier (Muon's authors keep the first and last layer on
    AdamW), norms, biases, position embeddings, tokens and depthwise kernels. With ``layer_decay < 1``
    both kinds are split by layer, as :func:`build_param_groups` does."""
    in_blocks = {id(p) for block in model.block_modules() for p in block.parameters()}

    def split(named: NamedParameters) -> list[dict]:
        muon = [parameter for _, parameter in named if id(parameter) in in_blocks and is_hidden_matrix(parameter)]
        chosen = {id(parameter) for parameter in muon}
        rest = [(name, parameter) for name, parameter in named if id(parameter) not in chosen]
        return [
            {"params": muon, "weight_decay": weight_decay, "use_muon": True},
            *split_weight_decay(model, rest, weight_decay),
        ]

    named = trainable_parameters(model)
    groups = split(named) if layer_decay == 1.0 else split_by_layer(model, named, layer_decay, split)
    return [group for group in groups if group["params"]]


def orthogonalize(matrices: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """About ``U V^T`` for each ``matrix = U S V^T`` of a ``(..., rows, cols)`` stack, by Muon's
    Newton-Schulz iteration in ``dtype`` (singular values land near 1, not on it; Muon needs no more).
    A stack runs as batched matmuls: the iteration is compute bound, and one batched call per shape
    beats a call per matrix (docs/benchmarks.md, "What each technique buys", Muon)."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = matrices.to(dtype).reshape(-1, *matrices.shape[-2:])
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)  # Frobenius >= spectral norm: it converges
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(matrices.shape)


def shards_rows(parameter: torch.Tensor) -> bool:
    """A DTensor whose every mesh dimension shards its first dimension (FSDP2; column-parallel layers, the
    fused qkv's strided shards; both at once): each process holds whole rows, every row on one process.
    ``_StridedShard`` is named apart: torch 2.14's is no ``Shard`` subclass, and its ``full_tensor()`` of
    fsdp+tp's doubly strided qkv puts rows in the wrong places."""
    return isinstance(parameter, DTensor) and all(
        isinstance(placement, (Shard, _StridedShard)) and placement.dim == 0 for placement in parameter.placements
    )


def row_counts(local: torch.Tensor) -> list[int]:
    """How many rows each process holds of a row-sharded matrix (``local``: this process's rows)."""
    counts = [torch.zeros((), dtype=torch.long, device=local.device) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(counts, torch.tensor(len(local), device=local.device))
    return [int(count) for count in counts]


def gather_rows(local: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, int]:
    """Every process's rows of a matrix (``sizes``: :func:`row_counts`), stacked in rank order (the matrix
    with its rows permuted, which Newton-Schulz orthogonalizes to the rows of the same permutation), and
    where this process's rows start."""
    rank = torch.distributed.get_rank()
    padded = local.new_zeros((max(sizes), *local.shape[1:]))
    padded[: len(local)] = local
    pieces = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(pieces, padded)
    return torch.cat([piece[:size] for piece, size in zip(pieces, sizes, strict=True)]), sum(sizes[:rank])


class MuonAdamW(torch.optim.Optimizer):
    """Muon (momentum orthogonalized by Newton-Schulz; Jordan et al. 2024) on the groups marked
    ``use_muon``, AdamW on the others: one optimizer, so the LR schedule, gradient clipping, NaN
    skipping and checkpoints see a single object and one learning rate.

    A Muon step: Nesterov momentum ``buffer = momentum * buffer + (1 - momentum) * grad``, the update
    ``grad + momentum * (buffer - grad)`` viewed as an ``(out, in * kernel)`` matrix and orthogonalized,
    decoupled weight decay ``w *= 1 - lr * weight_decay``, then ``w -= lr * 0.2 * sqrt(max(out, in)) * O``
    (torch.optim.Muon with ``adjust_lr_fn="match_rms_adamw"``, which only takes 2-D parameters).

    Sharded parameters (FSDP2, tensor parallelism, both) get the update of the whole
    matrix: each update is gathered over all processes (the meshes span them all), every process
    orthogonalizes the same stack and adds its own elements of the result; the momentum stays sharded. So a
    sharded run takes the steps one process takes."""

    def __init__(
        self,
        params: Iterable[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.95,
        ns_steps: int = 5,
        orthogonalize_dtype: torch.dtype = torch.float32,
        fused: bool = False,
        foreach: bool = False,
    ):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "momentum": momentum, "use_muon": False}
        super().__init__(params, defaults)
        self.ns_steps, self.orthogonalize_dtype = ns_steps, orthogonalize_dtype
        self.fused, self.foreach = fused, foreach
        self._row_counts: dict[int, list[int]] = {}  # per row-sharded parameter: each process's rows

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        by_shape: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for parameter in group["params"]:
            if parameter.grad is None:
                continue
            state = self.state[parameter]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.lerp_(parameter.grad, 1 - momentum)
            update, start = self._whole_matrix(parameter, parameter.grad.lerp(buffer, momentum))
            by_shape.setdefault(tuple(update.shape), []).append((parameter, update, start))
        for shape, triples in by_shape.items():  # the blocks repeat their shapes: one batched iteration each
            parameters, updates, starts = zip(*triples, strict=True)
            orthogonal = orthogonalize(torch.stack(updates), self.ns_steps, self.orthogonalize_dtype)
            step_size = lr * ADAMW_MATCHED_RMS * math.sqrt(max(shape))
            for parameter, matrix, start in zip(parameters, orthogonal, starts, strict=True):
                parameter.mul_(1 - lr * group["weight_decay"])
                own = self._own_part(matrix.to(parameter.dtype), parameter, start)
                (parameter.to_local() if isinstance(parameter, DTensor) else parameter).add_(own, alpha=-step_size)

    def _whole_matrix(self, parameter: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """The whole ``(rows, -1)`` matrix of ``parameter``'s update and where this process's rows start in it
        (None: the matrix is in its own order): row shards are gathered as rows (each shard's row count asked
        once per parameter), other DTensors whole."""
        if shards_rows(update):
            local = update.to_local()
            local = local.reshape(len(local), -1)
            sizes = self._row_counts.get(id(parameter))
            if sizes is None:
                sizes = self._row_counts[id(parameter)] = row_counts(local)
            return gather_rows(local, sizes)
        return (update.full_tensor() if isinstance(update, DTensor) else update).reshape(len(update), -1), None

    @staticmethod
    def _own_part(matrix: torch.Tensor, parameter: torch.Tensor, start: int | None) -> torch.Tensor:
        """This process's part of the orthogonalized ``matrix``, shaped as its part of ``parameter``."""
        if not isinstance(parameter, DTensor):
            return matrix.view_as(parameter)
        local = parameter.to_local()
        if start is not None:
            return matrix[start : start + len(local)].view_as(local)
        full = matrix.view(parameter.shape)  # every process holds it: each cuts its own shard, no communication
        return distribute_tensor(full, parameter.device_mesh, parameter.placements, src_data_rank=None).to_local()

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for parameter in group["params"]:
            if parameter.grad is None:
                continue
            state = adam_state(self.state[parameter], parameter, parameter.device if self.fused else "cpu")
            params.append(parameter)
            grads.append(parameter.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            beta1, beta2 = group["betas"]
            adamw_update(
                params, grads, exp_avgs, exp_avg_sqs, [], steps,
                foreach=self.foreach, fused=self.fused, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )  # fmt: skip


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"), NVIDIA's variant as in
    apex's FusedLAMB and timm's ``Lamb``: the bias-corrected Adam direction plus L2 weight decay,
    ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w``, scaled per tensor by the trust ratio
    ``||w|| / ||u||`` (1 when either norm is 0), then ``w -= lr * ratio * u``. Tensors without weight
    decay (norms, biases, embeddings) take the plain Adam step, as in apex and timm. Gradient clipping
    stays with the training step (``optim.grad_clip``). Multi-tensor (``torch._foreach_*``) throughout:
    torch has no fused LAMB kernel; ``foreach=False`` runs the same ops one tensor at a time."""

    def __init__(
        self,
        params: Iterable[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        foreach: bool = True,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.foreach = foreach

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            params = [parameter for parameter in group["params"] if parameter.grad is not None]
            if params:
                self._update_group(group, params)
        return loss

    def _update_group(self, group: dict, params: list[torch.Tensor]) -> None:
        for parameter in params:
            adam_state(self.state[parameter], parameter)["step"] += 1
        if not self.foreach:  # one tensor at a time, same arithmetic
            for parameter in params:
                self._update_tensors(group, [parameter], [self.state[parameter]])
            return
        by_step: dict[float, list[torch.Tensor]] = {}  # tensors added to the group later have fewer steps
        for parameter in params:
            by_step.setdefault(self.state[parameter]["step"].item(), []).append(parameter)
        for tensors in by_step.values():
            self._update_tensors(group, tensors, [self.state[parameter] for parameter in tensors])

    @staticmethod
    def _update_tensors(group: dict, params: list[torch.Tensor], states: list[dict]) -> None:
        beta1, beta2 = group["betas"]
        step = states[0]["step"].item()
        grads = [parameter.grad for parameter in params]
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, math.sqrt(1 - beta2**step))
        torch._foreach_add_(denominators, group["eps"])
        updates = torch._foreach_div(exp_avgs, denominators)
        torch._foreach_div_(updates, 1 - beta1**step)
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
            weight_norms = torch.stack(torch._foreach_norm(params))
            update_norms = torch.stack(torch._foreach_norm(updates))
            ratios = torch.where(
                (weight_norms > 0) & (update_norms > 0), weight_norms / update_norms, torch.ones_like(weight_norms)
            )
            torch._foreach_mul_(
                updates, [ratio.to(update.dtype) for ratio, update in zip(ratios, updates, strict=True)]
            )
        torch._foreach_add_(params, updates, alpha=-group["lr"])


@torch.optim.Optimizer.profile_hook_step  # the step hooks run around it, as around step()
@torch.no_grad()
def adam_step_unless_found_inf(optimizer: torch.optim.Adam, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` of a torch Adam/AdamW with ``found_inf`` (a device flag) handed to its fused kernel,
    which then leaves parameters, moments and step counts as they were where the flag is set: the input
    torch's GradScaler gives the kernel, here an argument instead of the ``grad_scale``/``found_inf``
    attributes ``Adam.step`` would read off the optimizer. The same update as ``step()`` otherwise."""
    for group in optimizer.param_groups:
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam_update(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
            fused=group["fused"], grad_scale=None, found_inf=found_inf,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )  # fmt: skip


def implementation_flags(implementation: str, device: str) -> dict[str, bool]:
    """torch.optim keyword arguments for an ``optim.implementation`` on ``device``."""
    if implementation == "auto":
        # torch's fused AdamW/SGD kernels exist for CPU and CUDA tensors alike
        implementation = "fused" if torch.device(device).type in ("cpu", "cuda") else "foreach"
    return {
        "fused": {"fused": True, "foreach": False},
        "foreach": {"fused": False, "foreach": True},
        "for-loop": {"fused": False, "foreach": False},
    }[implementation]


def build_optimizer(model: nn.Module, optim: OptimizerPlan, precision: PrecisionPolicy) -> torch.optim.Optimizer:
    flags = implementation_flags(optim.implementation, precision.device)
    if optim.name == "sgd" and flags["fused"] and holds_dtensors(model):
        # torch's fused SGD kernel has no DTensor rule (FSDP/TP parameters): auto takes the multi-tensor one
        if optim.implementation == "fused":
            raise ConfigError(
                "optim.implementation=fused with optim.name=sgd cannot update sharded (FSDP/TP) parameters; "
                "use optim.implementation=auto or foreach"
            )
        flags = implementation_flags("foreach", precision.device)
    if optim.name == "muon":
        # Newton-Schulz in bf16 where the run computes in bf16 (the device has it natively), else fp32
        dtype = torch.bfloat16 if precision.dtype == "bf16" else torch.float32
        groups = build_muon_param_groups(model, optim.weight_decay, optim.layer_decay)
        return MuonAdamW(groups, optim.lr, optim.betas, optim.eps, optim.muon_momentum, optim.ns_steps, dtype, **flags)
    groups = build_param_groups(model, optim.weight_decay, optim.layer_decay)
    if optim.name == "lamb":  # no fused LAMB in torch: multi-tensor unless one tensor at a time is asked for
        foreach = optim.implementation != "for-loop"
        return Lamb(groups, optim.lr, optim.betas, optim.eps, optim.weight_decay, foreach=foreach)
    if optim.name == "adamw":
        return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, **flags)
    return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, **flags)
