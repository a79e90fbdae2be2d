"""The CUDA paths against references: precision policies against fp32, SDPA's kernels against each
other, fused AdamW against the for-loop one, compile against eager, activation checkpointing's memory,
channels-last ResNet-50, DDP / FSDP2 / TP over NCCL against one process, and bitwise resume.

Every test is marked ``gpu`` and skipped without a CUDA device; ``make gpu-check`` runs them
(``pytest -m gpu``). Tolerances are relative L2 errors ``|a - b| / |b|`` over whole tensors, stated
per test with the reason for their size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.conftest import SMALL_SYNTHETIC_RUN, assert_same_training_state, make_config
from tests.dist.test_ddp import _set_args, torchrun
from vitrain.checkpoint import find_latest_checkpoint, load_checkpoint
from vitrain.cli import main
from vitrain.models import build_model
from vitrain.train import make_plan, train
from vitrain.train.build import build_training_step
from vitrain.train.optim import build_param_groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    ours, reference = ours.detach().double(), reference.detach().double()
    return ((ours - reference).norm() / reference.norm()).item()


def cuda_overrides(*extra: str) -> list[str]:
    return [*SMALL_SYNTHETIC_RUN, "train.device=cuda", "optim.name=adamw", "data.image_size=28", *extra]


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 references without TF32, restored after the test."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def one_step(*overrides: str, batch: int = 32, side: int = 28):
    """One training step of a freshly seeded model on a fixed batch: (loss, grad norm, flat fp32 gradient)."""
    plan = make_plan(make_config(*cuda_overrides(*overrides)))
    step = build_training_step(plan)
    generator = torch.Generator(device="cuda").manual_seed(1)
    images = torch.randn(batch, plan.data.in_chans, side, side, device="cuda", generator=generator)
    labels = torch.randint(0, plan.model.num_classes, (batch,), device="cuda", generator=generator)
    loss, grad_norm = step(images, labels)
    grads = torch.cat([param.grad.float().reshape(-1) for param in step.model.parameters()])
    return plan, loss.float(), grad_norm.float(), grads


# bf16 keeps 8 mantissa bits (relative rounding 2**-9 = 2e-3 per op), fp16 11; over a 6-block forward and
# backward the gradient's relative error stays within a few times the per-op rounding.
POLICIES = {
    "bf16-autocast": (["precision=bf16", "precision_mode=autocast"], 2e-2, 5e-2),
    "bf16-o2": (["precision=bf16", "precision_mode=o2"], 2e-2, 5e-2),
    "bf16-full": (["precision=bf16", "precision_mode=full"], 3e-2, 8e-2),
    "fp16-autocast": (["precision=fp16", "precision_mode=autocast"], 5e-3, 1e-2),
    "fp16-o2": (["precision=fp16", "precision_mode=o2"], 5e-3, 1e-2),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_precision_policy_tracks_fp32(policy):
    extra, loss_tol, grad_tol = POLICIES[policy]
    _, loss_ref, norm_ref, grads_ref = one_step("precision=fp32")
    plan, loss, grad_norm, grads = one_step(*extra)
    assert plan.precision.device.startswith("cuda")
    assert torch.isfinite(loss) and torch.isfinite(grad_norm)
    assert abs(loss.item() - loss_ref.item()) / loss_ref.item() < loss_tol
    assert abs(grad_norm.item() - norm_ref.item()) / norm_ref.item() < grad_tol
    assert relative_error(grads, grads_ref) < grad_tol


def test_auto_precision_measures_fp32_and_bf16_on_the_gpu_and_takes_the_faster(tmp_path, monkeypatch):
    monkeypatch.setenv("VITRAIN_CACHE_DIR", str(tmp_path / "cache"))
    plan = make_plan(make_config(*cuda_overrides("precision=auto", "precision_mode=auto")))
    measured = plan.measured
    if not torch.cuda.is_bf16_supported():
        assert measured is None and plan.precision.dtype == "fp32"  # fp16 is never chosen for the user
        return
    assert set(measured.img_s) == {"fp32", "bf16 autocast", "bf16 o2"}
    assert measured.chosen == max(measured.img_s, key=measured.img_s.get)
    assert (plan.precision.dtype, plan.precision.mode) == (measured.precision, measured.mode)


# Each fused kernel (flash, memory-efficient, cuDNN) against the math kernel on fp64 inputs rounded to
# bf16: both see the same bf16 inputs; the fused kernels accumulate in fp32 and round outputs to bf16.
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


@pytest.mark.parametrize("backend", list(SDPA_BACKENDS))
def test_sdpa_kernels_agree_forward_and_backward(backend):
    """ViT-B/16 at 224 px: 12 heads of 64 over 197 tokens (an odd length: the kernels pad it)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (8, 12, 197, 64)
    q, k, v = (torch.randn(shape, device="cuda", generator=generator).bfloat16() for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", generator=generator).bfloat16()

    def run(kernel, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([kernel]):
            out = F.scaled_dot_product_attention(*inputs)
        out.backward(grad_out.to(dtype))
        return [out, *(t.grad for t in inputs)]

    reference = run(SDPBackend.MATH, torch.float64)
    try:
        ours = run(SDPA_BACKENDS[backend], torch.bfloat16)
    except RuntimeError as error:  # a kernel this GPU or build lacks is reported, not failed
        pytest.skip(f"SDPA {backend} kernel not usable here: {error}")
    for name, got, want in zip(("out", "dq", "dk", "dv"), ours, reference, strict=True):
        assert relative_error(got, want) < 1e-2, name


def test_vit_attention_sdpa_equals_matmul_attention():
    """The model's two attention cores (SDPA and the explicit matmul + softmax) give one function."""
    torch.manual_seed(0)
    model = build_model("vit_small_patch16", device="cuda", img_size=64, num_classes=10)
    images = torch.randn(4, 3, 64, 64, device="cuda")
    logits_sdpa = model(images)
    for block in model.blocks:
        block.attn.impl = "matmul"
    assert relative_error(model(images), logits_sdpa) < 1e-5


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kernel", list(SDPA_BACKENDS))
def test_a_pinned_sdpa_kernel_is_the_one_that_runs_in_the_model(kernel, compiled):
    """model.attn_impl=sdpa_<kernel> (the attention probe's CUDA candidates): that kernel's op forward and
    backward and no other SDPA kernel's, eager and under inductor (profiled after a warm-up step, so a
    compile's tracing is not counted); logits and gradients as torch's own SDPA choice within bf16
    rounding (5 % relative L2 of the logits and of all gradients together: the kernels round bf16 outputs
    differently, and 12 blocks add it up)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    probe = torch.randn(8, 6, 197, 64, device="cuda", generator=generator).bfloat16()
    try:  # a kernel this GPU or build lacks is reported, not failed; the model below runs unguarded
        with sdpa_kernel([SDPA_BACKENDS[kernel]]):
            F.scaled_dot_product_attention(probe, probe, probe)
    except RuntimeError as error:
        pytest.skip(f"SDPA {kernel} kernel not usable here: {error}")
    torch.manual_seed(0)
    reference = build_model("vit_small_patch16", device="cuda", num_classes=10).bfloat16()
    pinned = build_model("vit_small_patch16", device="cuda", num_classes=10, attn_impl=f"sdpa_{kernel}").bfloat16()
    pinned.load_state_dict(reference.state_dict())
    if compiled:
        torch._dynamo.reset()
        pinned.compile()
    images = torch.randn(8, 3, 224, 224, device="cuda", generator=generator).bfloat16()
    pinned(images).float().square().sum().backward()  # warm-up: compiles, and picks cuDNN's plans
    pinned.zero_grad(set_to_none=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        out = pinned(images)
        out.float().square().sum().backward()
    names = {event.key for event in profile.key_averages()}
    assert f"aten::_scaled_dot_product_{kernel}_attention" in names, sorted(n for n in names if "attention" in n)
    assert f"aten::_scaled_dot_product_{kernel}_attention_backward" in names
    for other in set(SDPA_BACKENDS) - {kernel}:
        assert f"aten::_scaled_dot_product_{other}_attention" not in names, other
    expected = reference(images)
    expected.float().square().sum().backward()
    assert relative_error(out, expected) < 5e-2

    def gradient(model):
        return torch.cat([param.grad.flatten().float() for param in model.parameters()])

    assert relative_error(gradient(pinned), gradient(reference)) < 5e-2


def test_fused_adamw_equals_the_for_loop_one():
    torch.manual_seed(0)
    model = build_model("vit_tiny6_patch7", device="cuda", num_classes=10)
    twin = build_model("vit_tiny6_patch7", device="cuda", num_classes=10)
    twin.load_state_dict(model.state_dict())
    settings = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
    fused = torch.optim.AdamW(build_param_groups(model, 0.05), fused=True, **settings)
    loop = torch.optim.AdamW(build_param_groups(twin, 0.05), foreach=False, fused=False, **settings)
    for _ in range(5):
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_step_uses_fused_adamw_on_cuda():
    plan = make_plan(make_config(*cuda_overrides()))
    step = build_training_step(plan)
    assert step.optimizer.defaults["fused"] is True
    assert step.device_skip  # non-finite steps are skipped inside the kernel, no host sync


def test_compile_equals_eager():
    """inductor's kernels reorder fp32 sums: gradients agree to ~1e-5 relative, not bitwise."""
    _, loss_ref, _, grads_ref = one_step("precision=fp32")
    _, loss, _, grads = one_step("precision=fp32", "performance.compile=true")
    assert abs(loss.item() - loss_ref.item()) < 1e-5 * loss_ref.item()
    assert relative_error(grads, grads_ref) < 1e-4


def test_activation_checkpointing_saves_memory_and_changes_nothing():
    """ViT-S/16 at 224 px, batch 32, bf16: recomputing every block keeps about one block's activations."""
    peaks, results = {}, {}
    for checkpointing in (0, "all"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _, loss, _, grads = one_step(
            "model.name=vit_small_patch16",
            "data.image_size=224",
            "precision=bf16",
            f"performance.activation_checkpointing={checkpointing}",
            side=224,
        )
        peaks[checkpointing] = torch.cuda.max_memory_allocated()
        results[checkpointing] = (loss, grads)
    assert peaks["all"] < 0.6 * peaks[0], peaks
    assert torch.equal(results["all"][0], results[0][0])
    assert relative_error(results["all"][1], results[0][1]) < 1e-6


def test_channels_last_resnet50_equals_contiguous():
    """cuDNN picks other convolution algorithms for NHWC: equal up to fp32 summation order."""
    common = ("model.name=resnet50", "data.image_size=64", "precision=fp32", "optim.name=sgd")
    _, loss_ref, _, grads_ref = one_step(*common, batch=8, side=64)
    plan, loss, _, grads = one_step(*common, "performance.channels_last=true", batch=8, side=64)
    assert plan.runtime.channels_last
    assert abs(loss.item() - loss_ref.item()) < 1e-4 * loss_ref.item()
    assert relative_error(grads, grads_ref) < 1e-3


def _run_overrides(out_dir, *extra):
    # attention pinned: model.attn_impl=auto times both kernels at build, and two processes may choose apart
    common = ("model.head=gap", "model.attn_impl=sdpa", "train.epochs=2", "checkpoint.keep_last=5")
    return cuda_overrides(*common, f"train.out_dir={out_dir}", *extra)


@pytest.fixture(scope="module")
def one_process_weights(tmp_path_factory):
    """The same command in this process (the CLI's default recipe underneath, as under torchrun), with
    the TF32 settings of a fresh process (module fixtures are set up before ``exact_fp32``)."""
    out_dir = tmp_path_factory.mktemp("cuda-one") / "run"
    assert main(["train", *_set_args(_run_overrides(out_dir))]) == 0
    return load_checkpoint(find_latest_checkpoint(out_dir))["model"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_nccl_strategies_train_as_one_process(strategy, one_process_weights, tmp_path):
    """Every local GPU, one process each (torchrun), NCCL; the global batch is the same, so the weights
    match one process up to reduction order and nondeterministic kernels, which AdamW's normalized
    steps amplify over 12 steps for near-zero gradients: 1e-3 relative per tensor. With one GPU the
    model is not wrapped (one process is the whole world): the test then covers the NCCL process group
    and the torchrun launch; the sharded paths are checked on CPU with gloo (tests/dist)."""
    nproc = torch.cuda.device_count()
    out_dir = tmp_path / "run"
    extra = [f"parallel.strategy={strategy}", "checkpoint.format=file"]
    result = torchrun(["train", *_set_args(_run_overrides(out_dir, *extra))], nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    weights = load_checkpoint(find_latest_checkpoint(out_dir))["model"]
    for key, reference in one_process_weights.items():
        assert relative_error(weights[key], reference) < 1e-3, key


def test_resume_on_cuda_is_bitwise(tmp_path, monkeypatch):
    """Deterministic algorithms (cuBLAS workspace pinned): a run resumed mid-training ends bitwise equal."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        overrides = _run_overrides(tmp_path / "straight", "model.drop_path_rate=0.1", "checkpoint.every_steps=1")
        overrides += ["checkpoint.keep_last=100"]
        straight = make_plan(make_config(*overrides))
        train(straight)
        resumed_dir = tmp_path / "resumed"
        (resumed_dir / "checkpoints").mkdir(parents=True)
        shutil.copy(straight.out_dir / "checkpoints" / "step-000000007.pt", resumed_dir / "checkpoints")
        train(make_plan(make_config(*overrides, f"train.out_dir={resumed_dir}")), resume="auto")
        assert_same_training_state(find_latest_checkpoint(resumed_dir), find_latest_checkpoint(straight.out_dir))
    finally:
        torch.use_deterministic_algorithms(False)


def test_profile_on_cuda_traces_kernels_and_snapshots_memory(tmp_path):
    """train.profile on CUDA: the trace has GPU kernels and a memory snapshot is written beside it."""
    import json
    import pickle

    overrides = cuda_overrides("train.steps=4", "train.profile=1:2", f"train.out_dir={tmp_path / 'run'}")
    summary = train(make_plan(make_config(*overrides)))
    profile = summary["profile"]
    events = json.loads(Path(profile["trace"]).read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)
    with open(profile["memory_snapshot"], "rb") as handle:
        assert pickle.load(handle)["segments"]  # the CUDA caching allocator's segments, with their blocks
    assert "self_cuda_time_total" in Path(profile["ops"]).read_text()


def test_dali_decodes_on_the_gpu_like_its_cpu_pipeline(tmp_path):
    """data.backend=dali on CUDA (nvJPEG, the `mixed` decoder): CUDA batches, the CPU pipeline's labels batch by
    batch, and evaluation images within 3 levels of 255 per image and channel mean (two JPEG decoders)."""
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (pip install 'vitrain[dali]')")
    from tests.unit.test_dali import _overrides, _smooth
    from vitrain.data import build_loaders

    for split, count in (("train", 6), ("val", 2)):
        for name in ("a", "b"):
            (tmp_path / split / name).mkdir(parents=True)
            for index in range(count):
                _smooth(index + 10 * len(name), 60, 80).save(tmp_path / split / name / f"{index}.jpg", quality=95)
    loaders = {}
    for device in ("cuda", "cpu"):
        loaders[device] = build_loaders(make_plan(make_config(*_overrides(tmp_path, f"train.device={device}"))).data)
    gpu_batches, cpu_batches = list(loaders["cuda"][0]), list(loaders["cpu"][0])
    assert all(images.is_cuda and images.dtype == torch.uint8 for images, _ in gpu_batches)
    assert [labels.tolist() for _, labels in gpu_batches] == [labels.tolist() for _, labels in cpu_batches]
    gpu_eval = torch.cat([images.cpu() for images, _ in loaders["cuda"][1]]).float()
    cpu_eval = torch.cat([images for images, _ in loaders["cpu"][1]]).float()
    assert torch.allclose(gpu_eval.mean((2, 3)), cpu_eval.mean((2, 3)), atol=3.0)


def test_gpu_jpeg_decoding_gives_the_pillow_paths_crops_on_cuda(tmp_path):
    """data.decode=gpu on CUDA (torchvision's nvJPEG decoder): CUDA batches with the CPU path's labels, and
    pixels within 3 levels of 255 on average (the same seeded crops; two JPEG decoders, two resizes)."""
    from tests.unit.test_device_decode import _smooth

    for split, count in (("train", 8), ("val", 3)):
        for name in ("a", "b"):
            (tmp_path / split / name).mkdir(parents=True)
            for index in range(count):
                _smooth(index + 10 * len(name), 30 + index, 40).save(
                    tmp_path / split / name / f"{index}.jpg", quality=95
                )
    overrides = [
        "data.name=imagefolder",
        f"data.root={tmp_path}",
        "data.image_size=14",
        "data.num_workers=0",
        "model.name=vit_tiny6_patch7",
        "train.batch_size=4",
        "train.device=cuda",
    ]
    from vitrain.data import build_loaders

    gpu = build_loaders(make_plan(make_config(*overrides, "data.decode=gpu")).data)
    cpu = build_loaders(make_plan(make_config(*overrides)).data)
    for ours, theirs in zip(gpu, cpu, strict=True):
        for (images, labels), (expected, expected_labels) in zip(ours, theirs, strict=True):
            assert images.is_cuda and torch.equal(labels.cpu(), expected_labels.cpu())
            assert (images.float().cpu() - expected.float().cpu()).abs().mean() < 3.0


def test_bench_profile_sorts_the_gpu_kernels_of_a_step(tmp_path):
    """``vitrain bench --profile`` on CUDA: the kernels of a compiled bf16 ViT step land in named categories
    (almost none in ``other``), the matrix products and attention among them; busy and idle make up the
    profiled step; the kernels that do the FLOPs run below the GPU's peak."""
    import json

    path = tmp_path / "bench.json"
    argv = ["bench", "--model", "vit_small_patch16", "--image-size", "64", "--batch", "32", "--precision", "bf16"]
    argv += ["--set", "train.device=cuda", "--compile", "--steps", "2", "--repeats", "1", "--warmup", "2"]
    assert main([*argv, "--profile", "3", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    parts = record["step_breakdown"]
    assert parts["source"] == "CUDA kernels (CUPTI)" and parts["profiled_steps"] == 3
    categories = parts["categories_ms"]
    assert categories["matmul"] > 0 and categories["attention"] > 0 and categories["optimizer"] > 0
    unnamed = [row["name"] for row in parts["top"] if row["category"] == "other"]
    assert categories.get("other", 0) < 0.05 * sum(categories.values()), f"kernels in no category: {unnamed}"
    assert parts["busy_ms"] <= parts["profiled_step_ms"] and parts["busy_ms"] <= sum(categories.values()) * 1.0001
    assert parts["busy_ms"] + parts["idle_ms"] == pytest.approx(parts["profiled_step_ms"])
    assert 0 < parts["tensor_tflops"] < record["peak_tflops"]
