"""Refactoring guard: a few steps of tiny models give bitwise the weights recorded in
``tests/data/reference_weights.json`` (fp32, and bf16 O2 with the fused CPU kernels; chained blocks,
activation checkpointing, the locality and LocalViT FFNs); and, on every machine, checks that need no
recording: each case run twice gives bitwise the same weights, and the fused kernels' updates follow
PyTorch's ops within a stated tolerance.

Bitwise digests hold only where the same code computes on the same CPU: its model (an Intel Xeon with
AVX-512 but no AVX512-BF16 and this AMD EPYC once shared a key, and all cases failed there), the ISA
levels ATen, oneDNN and the kernels use, AMX, the threads, torch, and the compiler that built the kernels.
So they are recorded per :func:`reference_key`; a key with no entry is skipped, naming the command that
records it: ``python -m tests.unit.test_reference_weights --write`` (run it on the code you trust, before
the change you want to check, natively and under each emulated level of the suite: ``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2 VITRAIN_AMX=off`` and ``ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512
VITRAIN_AMX=off``).

Every case pins how it computes: ``precision``, ``precision_mode`` and, in bf16, ``performance.cpu_kernels=fused``
(``auto`` would time the step with and without the kernels and take the faster, so the bits would depend on
the clock); where the kernels cannot be built here, the bf16 cases are skipped."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference_weights.json"
THREADS = 2
WRITE_COMMAND = "python -m tests.unit.test_reference_weights --write"

COMMON = [
    "data.name=synthetic",
    "data.image_size=14",
    "data.synthetic_num_train=64",
    "data.synthetic_num_eval=16",
    "train.batch_size=16",
    "train.steps=3",
    "train.progress=off",
    "train.log_every_steps=1",
    "optim.lr=0.2",
    "schedule.warmup_epochs=0",
    "model.drop_path_rate=0.1",
    "train.seed=0",
]
FP32 = ["precision=fp32", "precision_mode=autocast", "performance.cpu_kernels=native"]
BF16_O2 = ["precision=bf16", "precision_mode=o2", "performance.cpu_kernels=fused"]
CASES: dict[str, list[str]] = {
    "vit-fp32": [*FP32, "model.name=vit_tiny6_patch7", "model.attn_impl=matmul"],
    "vit-bf16-o2": [*BF16_O2, "model.name=vit_tiny6_patch7", "model.attn_impl=matmul", "model.drop_rate=0.1"],
    "vit-sdpa-gap-bf16-o2": [*BF16_O2, "model.name=vit_tiny6_patch7", "model.attn_impl=sdpa", "model.head=gap"],
    "vit-checkpointed-bf16-o2": [
        *BF16_O2,
        "model.name=vit_tiny6_patch7",
        "model.attn_impl=matmul",
        "performance.activation_checkpointing=3",
    ],
    "locality-fp32": [*FP32, "model.name=locality_vit_tiny6_patch7", "model.attn_impl=matmul"],
    "locality-bf16-o2": [*BF16_O2, "model.name=locality_vit_tiny6_patch7", "model.attn_impl=matmul"],
    "localvit-bf16-o2": [*BF16_O2, "model.name=localvit_tiny6_patch7", "model.attn_impl=matmul"],
}
FUSED_CASES = sorted(case for case in CASES if "performance.cpu_kernels=fused" in CASES[case])
AGAINST_NATIVE = ["locality-bf16-o2", "localvit-bf16-o2", "vit-bf16-o2"]
"""The cases whose fused kernels are checked against PyTorch's ops: between them every fused op (layer norm
and its chained form, linear, linear + GELU, the locality front, the depthwise convolution, and on AMX CPUs
the attention); the SDPA and checkpointed cases run no other kernels, and where bf16 is emulated (AVX2) each
run costs ~5x more."""

PLAIN_SGD = [
    "optim.name=sgd",
    "optim.momentum=0",
    "optim.weight_decay=0",
    "optim.grad_clip=null",
    "schedule.name=constant",
]
"""The fused-against-native check trains with plain SGD: each update is the learning rate times the
gradient, so a gradient off by a factor shows in the update by that factor. AdamW divides it by its own
running magnitude and clipping rescales all of them: both would hide a uniformly scaled gradient."""
SCALE_TOLERANCE = 0.025
"""How far each tensor's update with the fused kernels may be scaled from the one with PyTorch's ops, as
``<fused, native> / <native, native>`` over the tensor (the least-squares factor ``s`` in
``fused ~ s * native``), after the 3 SGD steps of a case. Measured ``|s - 1|``, largest over the checked
tensors of the three cases, on an AMD EPYC (Zen 5, 2 threads, torch 2.14.1): 0.0038 natively
(AVX512-BF16), 0.0056 with oneDNN limited to AVX512_CORE, 0.0091 with everything limited to AVX2 (LocalViT's
squeeze-excite weights, whose updates are ~100x smaller than most; every other tensor 0.004 or less):
bf16 rounding in different places, of the same order on any CPU. A kernel's gradient 5 % off gives 0.048
to 0.054 in the tensors it feeds (measured with layer-norm weight, linear weight and bias, depthwise
weight and GELU input gradients scaled by 1.05), and more upstream."""
RELATIVE_TOLERANCE = 0.3
"""The same updates' ``|fused - native| / |native|`` per tensor, for errors that do not scale a gradient
but scramble it: measured at most 0.070 natively, 0.067 (AVX512_CORE) and 0.100 (AVX2), all LocalViT's
BatchNorm weights (0.026 or less in the other cases); the linear weight gradients with noise of 30 % of
their mean magnitude added, or their elements permuted, came to 1.08 and 1.44."""
SQUEEZE_EXCITE = re.compile(r"blocks\.\d+\.mlp\.se\.fc1\.weight")
"""LocalViT's squeeze-excite reduction, left out of the factor (not of the relative check): its updates are
~100x smaller than most, so bf16 rounding alone moves its factor by up to 0.030 where AMX tiles compute the
weight gradients (Intel Xeon with AMX-BF16, 2 threads, torch 2.14.1: 0.9698 and 0.9769, relative 0.17 and
0.11; every other tensor of the three cases within 0.0065 there)."""
MIN_ELEMENTS = 64
"""Tensors this small are left out of the fused-against-native check: the noise of a factor fitted over
4 values (LocalViT's squeeze-excite bias) is ~1.7 %, too close to the tolerance."""
NO_GRADIENT = re.compile(r"blocks\.\d+\.norm2\.bias")
"""In LocalViT the FFN's 1x1 expansion (no bias) is followed by a BatchNorm, which removes anything
constant over the tokens, such as the pre-norm's bias times the weights: that bias has no gradient but
rounding noise, in both runs alike (``localvit-bf16-o2`` only)."""


def reference_key() -> str:
    """What decides the bits of a case: :func:`vitrain.cpu_features.cpu_key` (the CPU's model name with its
    family and model numbers, the ISA ATen and oneDNN use, AMX, threads, torch), and the fused kernels' paths
    (oneDNN's bias-in-product linear, AMX tiles) and the compiler that built them."""
    from vitrain import cpu_features, kernels

    parts = [cpu_features.cpu_key()]
    if kernels.load() is None:
        parts.append("no fused kernels")
    else:
        chosen = kernels.paths()
        parts.append(
            f"fused kernels by {_compiler()}, bias {'in' if chosen.bias_in_product else 'after'} oneDNN's product, "
            f"{'AMX tiles' if chosen.amx_tiles else 'no AMX tiles'}"
        )
    return " | ".join(parts)


@functools.cache
def _compiler() -> str:
    """The compiler torch's extension loader builds the kernels with (``$CXX``, default ``c++``) and its
    release."""
    compiler = os.environ.get("CXX", "c++")
    try:
        answer = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return f"{compiler} (version unknown)"
    first_line = (answer.stdout.strip().splitlines() or ["(version unknown)"])[0]
    return first_line if first_line.startswith(Path(compiler).name) else f"{compiler}: {first_line}"


def _skip_without_kernels(case: str) -> None:
    from vitrain import kernels

    if case in FUSED_CASES and kernels.load() is None:
        pytest.skip(
            f"the fused CPU kernels could not be built here ({kernels.build.failure()}); {case} pins "
            "performance.cpu_kernels=fused, since with auto whether they are used would depend on a measurement"
        )


def _plan(case: str, out_dir: Path, *extra: str):
    from tests.conftest import make_config
    from vitrain.train import make_plan

    return make_plan(make_config(*COMMON, *CASES[case], *extra, f"train.out_dir={out_dir}"), measure=False)


def _final_weights(plan) -> dict[str, torch.Tensor]:
    from vitrain.checkpoint import load_checkpoint
    from vitrain.train import train

    train(plan)
    final = sorted((plan.out_dir / "checkpoints").glob("step-*.pt"))[-1]
    return load_checkpoint(final)["model"]


def _initial_weights(plan) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The weights ``plan``'s training starts from (the model its step builds: seeded, the fp32 master), and
    which of them are parameters (not buffers such as BatchNorm's running statistics)."""
    from vitrain.train.build import build_training_step

    step = build_training_step(plan)
    weights = {name: tensor.detach().clone() for name, tensor in step.model.state_dict().items()}
    parameters = {name for name, _ in step.model.named_parameters()}
    del step
    return weights, parameters


def _digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: hashlib.sha256(tensor.float().numpy().tobytes()).hexdigest()[:20] for name, tensor in weights.items()}


def _fused_against_native(case: str, out_dir: Path) -> tuple[dict[str, float], dict[str, float], float, float]:
    """The case under plain SGD with PyTorch's ops and with the fused kernels: per checked tensor, the factor
    of the fused update against the native one and their relative difference; and the sums of squares of
    the parameters' native updates and of their initial values."""
    native_plan = _plan(case, out_dir / "native", *PLAIN_SGD, "performance.cpu_kernels=native")
    initial, parameters = _initial_weights(native_plan)
    native = _final_weights(native_plan)
    fused = _final_weights(_plan(case, out_dir / "fused", *PLAIN_SGD))
    scales, relative, moved, total = {}, {}, 0.0, 0.0
    for name, start in initial.items():
        if not start.is_floating_point():
            continue
        native_update = native[name].double() - start.double()
        fused_update = fused[name].double() - start.double()
        if name in parameters:
            moved += native_update.square().sum().item()
            total += start.double().square().sum().item()
        checked = start.numel() >= MIN_ELEMENTS and not (case.startswith("localvit") and NO_GRADIENT.fullmatch(name))
        if not checked or not native_update.any():
            continue
        if not SQUEEZE_EXCITE.fullmatch(name):
            scales[name] = ((fused_update * native_update).sum() / native_update.square().sum()).item()
        relative[name] = ((fused_update - native_update).norm() / native_update.norm()).item()
    return scales, relative, moved, total


_first_runs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


def _first_run(case: str, out_dir: Path) -> dict[str, torch.Tensor]:
    """The case's final weights, trained once per process and key (the digest and determinism tests share it)."""
    key = (case, reference_key())
    if key not in _first_runs:
        _first_runs[key] = _final_weights(_plan(case, out_dir / "first"))
    return _first_runs[key]


def _reference() -> dict[str, dict[str, dict[str, str]]]:
    return json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}


@pytest.fixture
def threads():
    """The digests' thread count for the test, the process's own put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_case_pins_how_it_computes(case, tmp_path):
    plan = _plan(case, tmp_path)
    precision = plan.precision
    assert precision.dtype in ("fp32", "bf16") and precision.mode in ("autocast", "o2"), precision
    assert plan.runtime.cpu_kernels == ("fused" if precision.dtype == "bf16" else "native")
    for setting in ("precision=", "precision_mode=", "performance.cpu_kernels="):
        values = [override.removeprefix(setting) for override in CASES[case] if override.startswith(setting)]
        assert values and "auto" not in values, (setting, values)


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_match_the_recorded_reference(case, tmp_path, threads):
    _skip_without_kernels(case)
    key = reference_key()
    recorded = _reference().get(key, {}).get(case)
    if recorded is None:
        pytest.skip(f"no reference digests of {case} for {key!r}; record them with: {WRITE_COMMAND}")
    ours = _digests(_first_run(case, tmp_path))
    assert ours.keys() == recorded.keys()
    differing = [name for name in ours if ours[name] != recorded[name]]
    assert not differing, (
        f"{len(differing)} of {len(ours)} tensors differ from the reference of {key!r}, first: {differing[:5]}"
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_case_trained_twice_gives_bitwise_the_same_weights(case, tmp_path, threads):
    _skip_without_kernels(case)
    first = _first_run(case, tmp_path)
    second = _final_weights(_plan(case, tmp_path / "second"))
    assert first.keys() == second.keys()
    differing = [name for name in first if not torch.equal(first[name], second[name])]
    assert not differing, f"{len(differing)} of {len(first)} tensors differ between two runs: {differing[:5]}"


@pytest.mark.parametrize("case", AGAINST_NATIVE)
def test_fused_kernels_update_the_weights_as_pytorchs_ops_do(case, tmp_path, threads):
    """The fused kernels against ``performance.cpu_kernels=native``, same case under plain SGD: per tensor, the
    update's factor against PyTorch's (within :data:`SCALE_TOLERANCE`) and its relative difference (within
    :data:`RELATIVE_TOLERANCE`). Holds on every CPU, recorded or not."""
    _skip_without_kernels(case)
    scales, relative, moved, total = _fused_against_native(case, tmp_path)
    # the updates are the training's (~0.1 % of the weights), not the difference of two initializations
    assert 0.0 < moved**0.5 < 0.05 * total**0.5, (
        f"the native run moved its parameters by {moved**0.5:.3g} in all, against {total**0.5:.3g}: the initial "
        "weights taken are not those it trained from"
    )
    assert len(scales) >= 20, sorted(scales)
    worst_scale = max(scales, key=lambda name: abs(scales[name] - 1.0))
    assert abs(scales[worst_scale] - 1.0) <= SCALE_TOLERANCE, (
        f"{worst_scale}: the fused kernels' update is {scales[worst_scale]:.4f} times PyTorch's ops' "
        f"(tolerance {SCALE_TOLERANCE})"
    )
    worst_relative = max(relative, key=relative.__getitem__)
    assert relative[worst_relative] <= RELATIVE_TOLERANCE, (
        f"{worst_relative}: the fused kernels' update differs from PyTorch's ops' by "
        f"{relative[worst_relative]:.3f} of it (tolerance {RELATIVE_TOLERANCE})"
    )


def main() -> None:
    if "--write" not in sys.argv:
        raise SystemExit(f"usage: {WRITE_COMMAND}")
    from vitrain import kernels

    torch.set_num_threads(THREADS)
    os.environ.setdefault("VITRAIN_LOG_LEVEL", "WARNING")
    key = reference_key()
    cases = sorted(case for case in CASES if case not in FUSED_CASES or kernels.load() is not None)
    reference = _reference()
    with tempfile.TemporaryDirectory() as folder:
        reference[key] = {case: _digests(_final_weights(_plan(case, Path(folder) / case))) for case in cases}
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(cases)} of {len(CASES)} cases for {key!r} in {REFERENCE}")


if __name__ == "__main__":
    main()
