"""Native bf16 is read from the CPU's flags within oneDNN's ISA limit, never from PyTorch's flag (true on every
AVX-512 CPU, where oneDNN emulates bf16); the emulated-bf16 warning; the key of measured choices and digests."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import make_config
from vitrain import cpu_features


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be an x86 CPU with the given flags, PyTorch saying bf16 is supported (as on any AVX-512 CPU)."""

    def pretend(flags: set[str], limit: str | None = None, torch_says: bool = True):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: set(flags))
        monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(cpu_features.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: torch_says)
        if limit is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
        cpu_features.cpu_bf16_native.cache_clear()
        return cpu_features.cpu_bf16_native()

    yield pretend
    cpu_features.cpu_bf16_native.cache_clear()


ICE_LAKE = {"avx2", "avx512f", "avx512bw", "avx512_vnni"}
ZEN4 = {"avx2", "avx512f", "avx512_bf16"}
SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def test_native_bf16_needs_the_cpu_flag_within_onednn_s_limit(cpu):
    assert not cpu(ICE_LAKE)  # PyTorch says supported: oneDNN emulates it there (4x slower than fp32)
    assert cpu(ZEN4) and cpu(SAPPHIRE_RAPIDS)
    assert not cpu(ZEN4, limit="AVX512_CORE") and not cpu(SAPPHIRE_RAPIDS, limit="avx512_core")
    assert not cpu(ZEN4, limit="AVX2") and cpu(ZEN4, limit="AVX512_CORE_BF16") and cpu(ZEN4, limit="ALL")
    assert not cpu(ZEN4, torch_says=False)  # a build of torch without oneDNN's bf16


def test_the_bf16_state_says_why(cpu):
    cpu(ICE_LAKE)
    assert cpu_features.bf16_state().startswith("emulated: the CPU has neither AVX512-BF16 nor AMX-BF16")
    cpu(ZEN4, limit="AVX512_CORE")
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE keeps oneDNN from the CPU's AVX512-BF16" in cpu_features.bf16_state()
    cpu(SAPPHIRE_RAPIDS)
    assert cpu_features.bf16_state() == "native (AVX512-BF16 and AMX-BF16, used by oneDNN)"


def test_the_cpu_key_changes_with_each_switch_that_changes_the_kernels(monkeypatch):
    keys = set()
    for limit, amx in (("", "auto"), ("AVX512_CORE", "auto"), ("AVX512_CORE", "off")):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
        monkeypatch.setattr(cpu_features, "amx_tiles_possible", lambda amx=amx: amx == "auto")
        keys.add(cpu_features.cpu_key())
    assert len(keys) == 3 and all(cpu_features.cpu_model() in key for key in keys)


def test_bf16_asked_for_on_an_emulating_cpu_warns_once_and_auto_never_does(cpu, caplog, monkeypatch, tmp_path):
    from vitrain.train import make_plan, precision_choice

    cpu(ICE_LAKE)
    monkeypatch.setattr(cpu_features, "_warned_emulated_bf16", False)
    monkeypatch.setenv("VITRAIN_CACHE_DIR", str(tmp_path))
    bf16 = precision_choice.MeasuredPrecision("bf16", "o2", "native", {"fp32": 1.0, "bf16 o2": 2.0}, "bf16 o2", 16)
    monkeypatch.setattr("vitrain.train.plan.measure_precision", lambda *args, **kwargs: bf16)
    tiny = ["model.name=vit_tiny6_patch7", "data.name=synthetic", "data.image_size=14", "train.batch_size=16"]
    with caplog.at_level(logging.WARNING, logger="vitrain"):
        assert make_plan(make_config(*tiny, "precision=auto", "precision_mode=auto")).precision.dtype == "bf16"
        assert not [record for record in caplog.records if "emulated" in record.getMessage()]  # measured faster
        make_plan(make_config(*tiny, "precision=bf16"))
        make_plan(make_config(*tiny, "precision=bf16"))
    warnings = [record.getMessage() for record in caplog.records if "without native bf16" in record.getMessage()]
    assert len(warnings) == 1 and "precision=auto measures both" in warnings[0]
