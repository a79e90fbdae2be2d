"""model.attn_impl=auto: shapes found on the meta device, both paths timed, the faster set and cached."""

from __future__ import annotations

import json
import types

import pytest
import torch

from tests.conftest import make_config
from vitrain import kernels
from vitrain.config import precision_policy
from vitrain.models import build_model
from vitrain.train import attention_probe, build_model_for, make_plan, train

O2 = precision_policy("bf16", "o2", "cpu")


def _meta_model(head="cls"):
    return build_model("vit_tiny6_patch7", device="meta", img_size=28, in_chans=1, head=head)


def test_shapes_come_from_a_meta_forward():
    images = torch.empty(1, 1, 28, 28, device="meta")
    shapes = attention_probe.attention_shapes(_meta_model("cls"), images)
    assert {shape: len(modules) for shape, modules in shapes.items()} == {(17, 192, 3): 6}  # 16 patches + CLS
    shapes = attention_probe.attention_shapes(_meta_model("gap"), torch.empty(1, 1, 56, 56, device="meta"))
    assert list(shapes) == [(64, 192, 3)]  # another resolution: the resampled grid
    volo = build_model("volo_d1", device="meta")  # VOLO's transformer stages see a (B, H, W, C) grid
    shapes = attention_probe.attention_shapes(volo, torch.empty(1, 3, 224, 224, device="meta"))
    assert {shape: len(modules) for shape, modules in shapes.items()} == {(196, 384, 12): 4 + 8 + 2}


def test_the_faster_path_is_set_on_every_layer_and_cached(cache_dir, monkeypatch):
    timed = []

    def fake_timing(impl, shape, batch, policy, fused):
        timed.append((impl, shape, batch, policy.dtype, policy.mode, fused))
        return {"sdpa": 2e-3, "matmul": 1e-3}[impl]

    monkeypatch.setattr(attention_probe, "time_attention", fake_timing)
    model, images = _meta_model(), torch.empty(1, 1, 28, 28, device="meta")
    assert attention_probe.choose_attention(model, images, 64, O2, "native") == {(17, 192, 3): "matmul"}
    assert attention_probe.attention_impl(model) == "matmul"
    assert sorted(impl for impl, *_ in timed) == ["matmul", "sdpa"]
    assert timed[0][1:] == ((17, 192, 3), 64, "bf16", "o2", False)
    (entry,) = json.loads((cache_dir / "measured.json").read_text()).values()
    assert entry == {"impl": "matmul", "sdpa_ms": 2.0, "matmul_ms": 1.0}

    def refuse(*args):
        raise RuntimeError("cached shape timed again")

    monkeypatch.setattr(attention_probe, "time_attention", refuse)
    again = _meta_model()
    attention_probe.choose_attention(again, images, 64, O2, "native")
    assert attention_probe.attention_impl(again) == "matmul"
    with pytest.raises(RuntimeError, match="timed again"):  # another batch is another key
        attention_probe.choose_attention(_meta_model(), images, 32, O2, "native")
    monkeypatch.setattr(kernels.build, "load", lambda: types.ModuleType("built"))  # the kernels load here
    with pytest.raises(RuntimeError, match="timed again"):  # the run's model converted: another key
        attention_probe.choose_attention(_meta_model(), images, 64, O2, "auto")


def test_a_real_probe_times_both_paths_and_the_run_uses_its_choice(cache_dir, small_synthetic_overrides):
    plan = make_plan(make_config(*small_synthetic_overrides, "model.attn_impl=auto"))
    model = build_model_for(plan)
    (entry,) = json.loads((cache_dir / "measured.json").read_text()).values()
    assert entry["impl"] in attention_probe.IMPLEMENTATIONS and entry["sdpa_ms"] > 0 and entry["matmul_ms"] > 0
    assert attention_probe.attention_impl(model) == entry["impl"]
    assert model(torch.randn(2, plan.model.in_chans, 14, 14)).shape == (2, plan.model.num_classes)
    summary = train(make_plan(make_config(*small_synthetic_overrides, "model.attn_impl=auto", "train.steps=1")))
    assert summary["attention"] == entry["impl"]  # the run's summary records the measured kernel


def test_an_unwritable_cache_costs_a_probe_not_the_run(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("VITRAIN_CACHE_DIR", str(blocker / "cache"))  # a folder under a file: cannot exist
    monkeypatch.setattr(attention_probe, "time_attention", lambda impl, *args: {"sdpa": 1.0, "matmul": 2.0}[impl])
    model = _meta_model()
    attention_probe.choose_attention(
        model, torch.empty(1, 1, 28, 28, device="meta"), 8, precision_policy("fp32", "autocast", "cpu"), "auto"
    )
    assert attention_probe.attention_impl(model) == "sdpa"


def test_on_cuda_the_pinned_sdpa_kernels_are_candidates_and_one_that_cannot_run_is_left_out(cache_dir, monkeypatch):
    policy = precision_policy("bf16", "o2", "cuda")
    milliseconds = {"sdpa": 3.0, "matmul": 5.0, "sdpa_flash": 3.0, "sdpa_cudnn": 2.0}

    def fake_timing(impl, shape, batch, policy, fused):
        assert not fused  # the fused CPU kernels never convert a CUDA run's layers
        if impl == "sdpa_efficient":
            raise RuntimeError("No available kernel. Aborting execution.\nmore lines")
        return milliseconds[impl] / 1e3

    monkeypatch.setattr(attention_probe, "time_attention", fake_timing)
    monkeypatch.setattr(attention_probe, "device_key", lambda device: "a GPU")
    model, images = _meta_model(), torch.empty(1, 1, 28, 28, device="meta")
    assert attention_probe.choose_attention(model, images, 64, policy, "auto") == {(17, 192, 3): "sdpa_cudnn"}
    assert attention_probe.attention_impl(model) == "sdpa_cudnn"
    assert {m.core.backend for m in model.modules() if isinstance(m, attention_probe.Attention)} == {"sdpa_cudnn"}
    (entry,) = json.loads((cache_dir / "measured.json").read_text()).values()
    assert entry["unavailable"] == {"sdpa_efficient": "No available kernel. Aborting execution."}
    assert {key for key in entry if key.endswith("_ms")} == {f"{impl}_ms" for impl in milliseconds}

    milliseconds["sdpa_cudnn"] = 9.0  # cached: not timed again
    assert attention_probe.choose_attention(_meta_model(), images, 64, policy, "auto") == {(17, 192, 3): "sdpa_cudnn"}


def test_a_cached_entry_without_the_cuda_candidates_is_measured_again(cache_dir, monkeypatch):
    policy = precision_policy("bf16", "o2", "cuda")
    monkeypatch.setattr(attention_probe, "device_key", lambda device: "a GPU")
    key = attention_probe._key((17, 192, 3), 64, policy, False)
    cache_dir.mkdir()  # as the probe wrote it before the pinned kernels were candidates
    (cache_dir / "measured.json").write_text(json.dumps({key: {"impl": "sdpa", "sdpa_ms": 1.0, "matmul_ms": 2.0}}))
    timed = []
    monkeypatch.setattr(attention_probe, "time_attention", lambda impl, *args: timed.append(impl) or 1.0)
    attention_probe.choose_attention(_meta_model(), torch.empty(1, 1, 28, 28, device="meta"), 64, policy, "auto")
    assert sorted(timed) == sorted(attention_probe.CUDA_IMPLEMENTATIONS)


@pytest.mark.parametrize(("impl", "kernel"), [("sdpa_flash", "flash_attention"), ("sdpa_math", "attention_math")])
def test_a_pinned_sdpa_kernel_runs_that_kernel_with_the_same_result(impl, kernel):
    torch.manual_seed(0)
    reference = build_model("vit_tiny6_patch7", img_size=28, in_chans=1)
    pinned = build_model("vit_tiny6_patch7", img_size=28, in_chans=1, attn_impl=impl)
    pinned.load_state_dict(reference.state_dict())
    images = torch.randn(3, 1, 28, 28)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = pinned(images)
        out.square().sum().backward()
    names = {event.key for event in profile.key_averages()}
    assert any(kernel in name for name in names), sorted(n for n in names if "attention" in n)
    other = "attention_math" if kernel == "flash_attention" else "flash_attention"
    assert not any(other in name for name in names)
    assert attention_probe.attention_impl(pinned) == impl
    torch.testing.assert_close(out, reference(images), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa_cudnn", "sdpa_efficient"])
def test_cuda_only_kernels_are_refused_on_the_cpu_naming_the_choices(impl, small_synthetic_overrides):
    from vitrain.config import ConfigError

    with pytest.raises(ConfigError, match=f"model.attn_impl={impl} .* CUDA only .* use sdpa, sdpa_flash"):
        make_plan(make_config(*small_synthetic_overrides, f"model.attn_impl={impl}", "train.device=cpu"))


@pytest.mark.parametrize("impl", ["sdpa_flash", "sdpa_cudnn"])
def test_half_only_kernels_are_refused_in_fp32_on_cuda(impl, small_synthetic_overrides, monkeypatch):
    from vitrain.config import ConfigError, Hardware

    cuda = Hardware(cuda_available=True, bf16_supported=True)
    monkeypatch.setattr("vitrain.train.plan.detect_hardware", lambda device: cuda)
    overrides = [*small_synthetic_overrides, f"model.attn_impl={impl}", "train.device=cuda"]
    with pytest.raises(ConfigError, match=f"model.attn_impl={impl} .* bf16/fp16 on CUDA .* set precision=bf16"):
        make_plan(make_config(*overrides, "precision=fp32"))
    assert make_plan(make_config(*overrides, "precision=bf16")).model.arguments["attn_impl"] == impl


def test_eval_and_predict_take_torchs_choice_for_a_kernel_the_training_run_pinned():
    from vitrain.config import Config
    from vitrain.weights.inference import checkpoint_config

    saved = make_config("model.attn_impl=sdpa_cudnn", "train.device=cuda").model_dump()
    assert checkpoint_config(saved).model.attn_impl == "sdpa"
    assert checkpoint_config(saved, overrides=["model.attn_impl=sdpa_math"]).model.attn_impl == "sdpa_math"
    matmul = make_config("model.attn_impl=matmul").model_dump()
    assert checkpoint_config(matmul).model.attn_impl == "matmul" and Config().model.attn_impl is None


def test_a_pinned_kernel_failing_otherwise_than_by_refusing_the_shape_fails_the_probe(cache_dir, monkeypatch):
    """Out of memory (or a CUDA fault) is no property of the kernel to cache: it is raised."""
    policy = precision_policy("bf16", "o2", "cuda")
    monkeypatch.setattr(attention_probe, "device_key", lambda device: "a GPU")

    def timing(impl, *args):
        if impl == "sdpa_cudnn":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 1e-3

    monkeypatch.setattr(attention_probe, "time_attention", timing)
    with pytest.raises(torch.OutOfMemoryError):
        attention_probe.choose_attention(_meta_model(), torch.empty(1, 1, 28, 28, device="meta"), 64, policy, "auto")
    assert not (cache_dir / "measured.json").exists()
