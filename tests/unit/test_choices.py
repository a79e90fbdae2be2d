"""The cache of measured choices keeps only answers measured on a machine that left the measurement its cores:
other processes' CPU time is read from /proc, and a busy measurement serves its run without being cached."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from vitrain.train import choices

BURN = [sys.executable, "-c", "while True: pass"]


@pytest.fixture
def burner():
    """A process beside this one that keeps a core busy."""
    process = subprocess.Popen(BURN)
    time.sleep(0.2)  # started, spinning
    yield process
    process.kill()
    process.wait()


def _others_during(seconds: float, spin: bool = False) -> float:
    start = choices.other_processes_cpu_s()
    end_s = time.perf_counter() + seconds
    while time.perf_counter() < end_s:
        if not spin:
            time.sleep(0.05)
    return choices.other_processes_cpu_s() - start


@pytest.mark.skipif(choices.other_processes_cpu_s() is None, reason="no /proc on this system: nothing to read")
def test_other_processes_cpu_time_counts_a_busy_neighbour_and_not_this_process(burner, monkeypatch):
    listdir = choices.os.listdir
    seen = {str(os.getpid()), str(burner.pid)}  # the processes of this test, not the host's others
    monkeypatch.setattr(choices.os, "listdir", lambda path: [name for name in listdir(path) if name in seen])
    assert _others_during(0.6) >= 0.3  # the neighbour's core, while this process sleeps
    burner.kill()
    burner.wait()
    assert _others_during(0.5, spin=True) == 0.0  # this process spins: its own time is left out


def _fake_load(monkeypatch, others_cores: float, cores: int, threads: int) -> None:
    readings = iter([100.0, 100.0 + others_cores * 1.0])
    clock = iter([10.0, 11.0])
    monkeypatch.setattr(choices, "other_processes_cpu_s", lambda: next(readings))
    monkeypatch.setattr(choices.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(choices, "usable_cores", lambda: cores)
    monkeypatch.setattr(choices.torch, "get_num_threads", lambda: threads)


@pytest.mark.parametrize(
    ("others_cores", "cores", "threads", "busy"),
    [
        (0.1, 2, 2, False),  # a shell, a logger: quiet
        (1.0, 2, 2, True),  # a job on one of the two cores this process computes on
        (2.0, 8, 4, False),  # the job runs on cores this process leaves free
        (4.5, 8, 4, True),
    ],
)
def test_the_watch_counts_a_measurement_busy_when_others_take_the_cores_it_needs(
    monkeypatch, others_cores, cores, threads, busy
):
    _fake_load(monkeypatch, others_cores, cores, threads)
    with choices.LoadWatch() as load:
        pass
    assert load.others_cores == pytest.approx(others_cores) and load.busy is busy


def test_a_busy_measurement_serves_the_run_uncached_and_the_next_run_measures_again(
    tmp_path, monkeypatch, caplog, burner
):
    monkeypatch.setenv("VITRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choices, "usable_cores", lambda: 1)  # the neighbour takes this process's only core
    calls = []

    def measure():
        calls.append(1)
        time.sleep(0.5)
        return {"chosen": "bf16 o2", "img_s": {"bf16 o2": 169.0}}

    with caplog.at_level(logging.WARNING, logger="vitrain"):
        entry, cached = choices.measured_entry("precision | test key", measure)
    assert entry["chosen"] == "bf16 o2" and not cached
    assert not (tmp_path / choices.CACHE_NAME).exists()
    (warning,) = [record.getMessage() for record in caplog.records if "not cached" in record.getMessage()]
    assert "other processes kept" in warning and "precision was measured" in warning
    burner.kill()
    burner.wait()
    monkeypatch.setattr(choices, "other_processes_cpu_s", lambda: 0.0)  # quiet now
    assert choices.measured_entry("precision | test key", measure) == (entry, False) and len(calls) == 2
    assert choices.measured_entry("precision | test key", measure) == (entry, True) and len(calls) == 2
    assert json.loads((tmp_path / choices.CACHE_NAME).read_text())["precision | test key"] == entry
