"""vitrain doctor's GPU section on a real GPU: every probe runs and agrees with torch.cuda."""

from __future__ import annotations

import pytest
import torch

from vitrain.config import build_config
from vitrain.doctor import gpu, run_doctor
from vitrain.recipes import get_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the doctor's GPU probes"),
]


def test_gpu_section_on_this_gpu():
    config = build_config(get_recipe("fmnist"), [], ["data.name=synthetic"])
    report = run_doctor(config, device="cuda", checks=[("GPU", gpu.check_gpus)])
    assert not [check for check in report.checks if "probe failed" in check.value or "crashed" in check.value]
    assert report.find("GPU", "versions").data["torch"] == torch.__version__
    for index in range(torch.cuda.device_count()):
        line = report.find("GPU", f"gpu{index}")
        assert line.data["name"] == torch.cuda.get_device_name(index)
        assert tuple(line.data["capability"]) == torch.cuda.get_device_capability(index)
        sdpa = report.find("GPU", f"gpu{index} sdpa")
        assert "math" in sdpa.data["backends"], sdpa.data["errors"]
        if torch.cuda.get_device_capability(index) >= (8, 0):
            assert {"flash", "efficient"} <= set(sdpa.data["backends"]), sdpa.data["errors"]
    assert report.exit_code == 0
