"""performance.host_allocator: with ``cached`` (the default) a large CPU tensor freed and allocated again
reuses resident memory instead of faulting in fresh pages; ``system`` keeps glibc's behaviour."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vitrain.train.host_memory import glibc

# In a fresh process (the setting is process-wide): build a training step with each policy given, then
# count the page faults of 4 further rounds of allocating, touching and freeing 64 MiB.
_PROBE = """
import json, resource, sys, torch
from vitrain.config import Config, build_config
from vitrain.train import make_plan
from vitrain.train.build import build_training_step
overrides = ["data.name=synthetic", "model.name=vit_tiny6_patch7", "data.image_size=14", "train.batch_size=4",
             "precision=fp32"]
for policy in sys.argv[1:]:  # one training step built per policy, in this order
    build_training_step(make_plan(build_config(Config(), [], overrides + ["performance.host_allocator=" + policy])))
for _ in range(2):  # the first rounds grow the heap
    torch.empty(16 * 2**20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB of fp32, written, then freed
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""
PAGES_PER_ROUND = 64 * 2**20 // 4096


def _faults(*policies: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *policies], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(glibc() is None, reason="the allocator setting is glibc's mallopt; this C library is not glibc")
def test_cached_allocator_reuses_freed_memory_and_system_faults_it_in_again():
    system, cached, undone = _faults("system"), _faults("cached"), _faults("cached", "system")
    assert system >= 3 * PAGES_PER_ROUND, system  # glibc's default: a fresh mmap per round (4 KiB pages)
    assert cached < PAGES_PER_ROUND // 4, cached  # reused: at most a few stray pages
    assert undone >= 3 * PAGES_PER_ROUND, undone  # a later "system" run in the same process gets the defaults back
