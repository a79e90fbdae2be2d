"""Refactoring guard: a few steps of tiny models give bitwise the weights recorded in
``tests/data/reference_weights.json`` (fp32, and bf16 O2 with the fused CPU kernels; chained blocks,
activation checkpointing, the locality and LocalViT FFNs).

The digests depend on the CPU's kernels (ISA, native bf16, AMX), the thread count and the torch
version, so they are recorded per CPU kind; a kind with no entry is skipped, naming the command that
records it: ``python -m tests.unit.test_reference_weights --write`` (run it on the code you trust,
before the change you want to check, and again under the emulated AVX2 environment of
``test_avx2_emulation.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference_weights.json"
THREADS = 2

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
]
BF16_O2 = ["precision=bf16", "precision_mode=o2"]
CASES: dict[str, list[str]] = {
    "vit-fp32": ["precision=fp32", "model.name=vit_tiny6_patch7", "model.attn_impl=matmul"],
    "vit-bf16-o2": [*BF16_O2, "model.name=vit_tiny6_patch7", "model.attn_impl=matmul", "model.drop_rate=0.1"],
    "vit-sdpa-gap-bf16-o2": [*BF16_O2, "model.name=vit_tiny6_patch7", "model.attn_impl=sdpa", "model.head=gap"],
    "vit-checkpointed-bf16-o2": [
        *BF16_O2,
        "model.name=vit_tiny6_patch7",
        "model.attn_impl=matmul",
        "train.activation_checkpointing=3",
    ],
    "locality-fp32": ["precision=fp32", "model.name=locality_vit_tiny6_patch7", "model.attn_impl=matmul"],
    "locality-bf16-o2": [*BF16_O2, "model.name=locality_vit_tiny6_patch7", "model.attn_impl=matmul"],
    "localvit-bf16-o2": [*BF16_O2, "model.name=localvit_tiny6_patch7", "model.attn_impl=matmul"],
}


def cpu_kind() -> str:
    """What the digests depend on: ATen's vector ISA, native bf16, AMX tiles, threads, torch."""
    from vitrain import cpu_features, kernels

    features = [
        torch.backends.cpu.get_cpu_capability().lower(),
        "bf16" if cpu_features.cpu_bf16_native() else "nobf16",
        "amx" if kernels.paths().amx_tiles else "noamx",
        f"threads{torch.get_num_threads()}",
        f"torch{torch.__version__.split('+')[0]}",
    ]
    return "-".join(features)


def _digests(case: str, out_dir: Path) -> dict[str, str]:
    from tests.conftest import make_config
    from vitrain.checkpoint import load_checkpoint
    from vitrain.train import make_plan, train

    plan = make_plan(make_config(*COMMON, *CASES[case], f"train.out_dir={out_dir / case}", "train.seed=0"))
    train(plan)
    final = sorted((plan.out_dir / "checkpoints").glob("step-*.pt"))[-1]
    weights = load_checkpoint(final)["model"]
    return {name: hashlib.sha256(tensor.float().numpy().tobytes()).hexdigest()[:20] for name, tensor in weights.items()}


def _reference() -> dict[str, dict[str, dict[str, str]]]:
    return json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_match_the_recorded_reference(case, tmp_path):
    torch.set_num_threads(THREADS)
    kind = cpu_kind()
    recorded = _reference().get(kind, {}).get(case)
    if recorded is None:
        pytest.skip(f"no reference digests for CPU kind {kind}: python -m tests.unit.test_reference_weights --write")
    ours = _digests(case, tmp_path)
    assert ours.keys() == recorded.keys()
    differing = [name for name in ours if ours[name] != recorded[name]]
    assert not differing, f"{len(differing)} of {len(ours)} tensors differ from the reference, first: {differing[:5]}"


def main() -> None:
    if "--write" not in sys.argv:
        raise SystemExit("usage: python -m tests.unit.test_reference_weights --write")
    torch.set_num_threads(THREADS)
    os.environ.setdefault("VITRAIN_LOG_LEVEL", "WARNING")
    kind = cpu_kind()
    reference = _reference()
    with tempfile.TemporaryDirectory() as folder:
        reference[kind] = {case: _digests(case, Path(folder)) for case in sorted(CASES)}
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(CASES)} cases for {kind} in {REFERENCE}")


if __name__ == "__main__":
    main()
