"""``vitrain bench --profile``: the step breakdown's categories, its arithmetic, and the CLI on the CPU.

The CUDA path is fed events shaped as torch.profiler gives them on a GPU (kernels with a device type and
a time range); ``tests/gpu`` checks it on a real one.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from vitrain.bench import breakdown
from vitrain.bench.breakdown import busy_us, category, step_breakdown
from vitrain.cli import main

# names as torch.profiler reports them: CPU operators and annotations, then CUDA kernels (H100/H200)
NAMES = [
    ("aten::mm", "matmul"),
    ("aten::addmm", "matmul"),
    ("vitrain::weight_gradient", "matmul"),
    ("mkldnn::_linear_pointwise", "matmul"),
    ("vitrain::linear_gelu", "elementwise"),  # its product is an operator of its own: the GELU is left
    ("vitrain::linear_backward", "elementwise"),  # its products are aten::mm events of their own
    ("GeneratedBackwardFor_vitrain_linear_gelu_default", "elementwise"),  # the forward of vitrain::linear_gelu
    ("GeneratedBackwardFor_vitrain_add_layer_norm_default", "normalization"),
    ("GeneratedBackwardFor_vitrain_attention_default", "attention"),
    ("GeneratedBackwardFor_vitrain_linear_default", "framework"),
    ("GeneratedBackwardFor_vitrain_linear_gelu_defaultBackward", "framework"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("vitrain::attention_forward", "attention"),
    ("aten::_fused_adamw_", "optimizer"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    ("aten::_foreach_norm", "optimizer"),
    ("aten::linalg_vector_norm", "optimizer"),
    ("aten::native_layer_norm_backward", "normalization"),
    ("vitrain::layer_norm_forward", "normalization"),
    ("aten::gelu_backward", "elementwise"),
    ("vitrain::gelu", "elementwise"),
    ("aten::add_", "elementwise"),
    ("aten::copy_", "copy"),
    ("aten::_to_copy", "copy"),
    ("aten::to", "copy"),
    ("aten::cat", "copy"),
    ("aten::t", "framework"),
    ("aten::view", "framework"),
    ("detach", "framework"),
    ("autograd::engine::evaluate_function: AddmmBackward0", "framework"),
    ("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0", "framework"),
    ("NativeLayerNormBackward0", "framework"),
    ("SumBackward1", "framework"),
    ("aten::mkldnn_convolution", "convolution"),
    ("aten::convolution_backward", "convolution"),
    ("aten::_log_softmax", "loss"),
    ("aten::nll_loss_forward", "loss"),
    ("c10d::allreduce_", "communication"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_kernel__5x_cublas", "matmul"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("triton_tem_fused_addmm_0", "matmul"),
    (
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
        "cutlass::bfloat16_t>, false, false, false, false, false, true, false, false>(Flash_fwd_params)",
        "attention",
    ),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "attention"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "convolution"),
    ("triton_per_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_view_12", "normalization"),
    ("triton_poi_fused__to_copy_gelu_view_5", "elementwise"),
    ("triton_red_fused__to_copy_sum_3", "elementwise"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float)", "normalization"),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
        "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}>(int)",
        "elementwise",
    ),
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>(long)",
        "optimizer",
    ),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda({lambda()#3})>(int)", "copy"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false>(int)", "copy"),
    ("void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, float>(float const*)", "optimizer"),
    ("void cunn_SoftMaxForward<8, c10::BFloat16, float, c10::BFloat16, LogSoftMaxForwardEpilogue>(float*)", "loss"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float>>>", "elementwise"),
    ("ProfilerStep#3", "other"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "expected"), NAMES)
def test_each_kernel_and_operator_falls_in_its_category(name, expected):
    assert category(name) == expected


def test_every_category_has_its_place_in_the_tables():
    assert sorted(breakdown.DISPLAY_ORDER) == sorted([name for name, _ in breakdown.CATEGORIES] + ["other"])


def test_busy_time_is_the_union_of_kernel_intervals():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (20, 25)]) == 15  # disjoint
    assert busy_us([(0, 10), (5, 15)]) == 15  # overlapping (two streams)
    assert busy_us([(0, 10), (2, 3), (4, 9)]) == 10  # nested
    assert busy_us([(20, 30), (0, 10), (10, 20)]) == 30  # unsorted, touching


def test_breakdown_arithmetic_per_step():
    totals = {"aten::mm": [6000.0, 8], "aten::_fused_adamw_": [2000.0, 2], "aten::view": [500.0, 40]}
    record = step_breakdown(totals, busy=8500.0, steps=2, profiled_s=0.005, train_flops_per_step=3 * 10**9, cuda=False)
    assert record["categories_ms"] == {"matmul": 3.0, "optimizer": 1.0, "framework": 0.25}
    assert list(record["categories_ms"]) == ["matmul", "optimizer", "framework"]  # largest first
    assert record["profiled_step_ms"] == pytest.approx(2.5)
    assert record["busy_ms"] == pytest.approx(4.25) and record["idle_ms"] == 0  # busy above the wall: no idle
    assert record["tensor_tflops"] == pytest.approx(3e9 / 3e-3 / 1e12)  # 3 GFLOP in 3 ms of matmul
    assert record["top"][0] == {"name": "aten::mm", "category": "matmul", "ms": 3.0, "calls": 4.0}
    assert record["source"] == "CPU operators' self time"
    without = step_breakdown({"aten::view": [10.0, 1]}, 10.0, 1, 1.0, 1, cuda=True)
    assert without["tensor_tflops"] is None and without["idle_ms"] == pytest.approx(1000 - 0.01)


def _kernel(name: str, start: float, end: float, device=DeviceType.CUDA, annotation: bool = False):
    span = SimpleNamespace(start=start, end=end)
    return SimpleNamespace(name=name, device_type=device, time_range=span, is_user_annotation=annotation)


def test_cuda_kernels_are_summed_by_name_and_their_union_is_the_busy_time():
    events = [
        _kernel("aten::mm", 0, 400, DeviceType.CPU),  # the launching operator: not device time
        _kernel("Optimizer.step#AdamW.step", 0, 300, annotation=True),  # a span on the GPU's timeline: no kernel
        _kernel("nvjet_tst_256x128", 0, 100),
        _kernel("nvjet_tst_256x128", 150, 250),
        _kernel("pytorch_flash::flash_fwd_kernel", 200, 300),  # overlaps the second gemm
    ]
    totals, busy = breakdown._device_times(SimpleNamespace(events=lambda: events))
    assert totals == {"nvjet_tst_256x128": [200, 2], "pytorch_flash::flash_fwd_kernel": [100, 1]}
    assert busy == 250
    record = step_breakdown(totals, busy, steps=1, profiled_s=400e-6, train_flops_per_step=6 * 10**9, cuda=True)
    assert record["categories_ms"] == {"matmul": pytest.approx(0.2), "attention": pytest.approx(0.1)}
    assert record["idle_ms"] == pytest.approx(0.15) and record["source"] == "CUDA kernels (CUPTI)"
    assert record["tensor_tflops"] == pytest.approx(6e9 / 0.3e-3 / 1e12)


def test_bench_profile_breaks_down_ours_and_timms_step(tmp_path, capsys):
    pytest.importorskip("timm")
    path = tmp_path / "bench.json"
    argv = ["bench", "--model", "vit_tiny_patch16", "--image-size", "32", "--batch", "2", "--precision", "fp32"]
    argv += ["--steps", "1", "--repeats", "1", "--warmup", "1", "--profile", "2", "--compare-timm", "--json", str(path)]
    assert main(argv) == 0
    result = json.loads(path.read_text())
    for record in (result, result["timm"]):
        parts = record["step_breakdown"]
        assert parts["profiled_steps"] == 2 and parts["source"] == "CPU operators' self time"
        categories = parts["categories_ms"]
        assert {"matmul", "attention", "optimizer", "normalization"} <= categories.keys()
        assert all(ms > 0 for ms in categories.values())
        assert sum(categories.values()) == pytest.approx(parts["busy_ms"])  # every operator in one category
        assert parts["busy_ms"] + parts["idle_ms"] >= parts["profiled_step_ms"] * 0.999
        assert parts["tensor_tflops"] > 0 and len(parts["top"]) == breakdown.TOP_ROWS
    printed = capsys.readouterr().out
    assert "vitrain step breakdown (CPU operators' self time, 2 steps profiled): " in printed
    assert "timm step breakdown" in printed and "outside operators" in printed


def test_a_negative_profile_count_is_refused(capsys):
    argv = ["bench", "--model", "vit_tiny_patch16", "--image-size", "32", "--batch", "2", "--precision", "fp32"]
    assert main([*argv, "--profile", "-1"]) == 2
    assert "--profile must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("kernels", ["fused", "native"])
def test_the_cpu_training_paths_operators_all_have_a_category(kernels):
    """bf16 O2 with the fused CPU kernels (or PyTorch's ops): what the step runs is named, not ``other``."""
    from vitrain.bench import BenchSettings, bench_overrides, measure_training_step
    from vitrain.config import Config, build_config
    from vitrain.train import make_plan

    settings = BenchSettings(steps=1, warmup=1, repeats=1, profile=1)
    flags = bench_overrides("vit_tiny6_patch7", 28, 4, "bf16", "o2", settings)
    plan = make_plan(build_config(Config(), [], [*flags, f"performance.cpu_kernels={kernels}"]))
    parts = measure_training_step(plan, settings)["step_breakdown"]
    unnamed = [row["name"] for row in parts["top"] if row["category"] == "other"]
    assert parts["categories_ms"].get("other", 0) < 0.02 * parts["busy_ms"], unnamed
    assert parts["categories_ms"]["matmul"] > 0 and parts["categories_ms"]["normalization"] > 0
