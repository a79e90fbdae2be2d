"""`vitrain --help`, each command's --help and a bad --set answer without importing torch (seconds on
every call): the command modules import the training stack inside their handlers. Each case runs in a
fresh interpreter, since this one has imported torch long ago."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from vitrain.cli import COMMANDS

PROBE = """
import contextlib, io, json, sys
from vitrain.cli import main

def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    return {"code": code, "out": out.getvalue(), "err": err.getvalue(), "torch": "torch" in sys.modules}

print(json.dumps([run(argv) for argv in json.loads(sys.argv[1])]))
"""


def _probe(*argvs: list[str]) -> list[dict]:
    """main(argv) for each argv in turn in one fresh interpreter: exit code, output, and whether torch
    had been imported by then."""
    command = [sys.executable, "-c", PROBE, json.dumps(argvs)]
    return json.loads(subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout)


def test_help_lists_every_command_without_importing_torch():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "vitrain", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "vitrain.cli" in imported and "torch" not in imported
    choices = re.search(r"\{([a-z,-]+)\}", result.stdout)[1].split(",")
    assert sorted(choices) == sorted(COMMANDS)
    for name in COMMANDS:  # each with its line of help
        assert re.search(rf"^    {re.escape(name)}\b", result.stdout, re.MULTILINE), name


def test_every_command_help_without_importing_torch():
    results = _probe(*([name, "--help"] for name in COMMANDS))
    for name, result in zip(COMMANDS, results, strict=True):
        assert result["code"] == 0 and result["out"].startswith(f"usage: vitrain {name} "), name
    assert not results[-1]["torch"]


def test_an_unknown_config_key_is_refused_before_torch_is_imported():
    results = _probe(
        ["train", "--set", "train.nosuch=1"],
        ["show-config", "--set", "train.nosuch=1"],
        ["doctor", "--set", "train.nosuch=1"],
        ["label", "--teacher", "runs/t", "--out", "labels", "--set", "train.nosuch=1"],
        ["slurm", "--nodes", "1", "--gpus-per-node", "1", "--", "--set", "train.nosuch=1"],
    )
    for result in results:
        assert result["code"] == 2 and result["out"] == ""
        assert result["err"].startswith("vitrain: error: unknown config key 'train.nosuch'")
        assert result["err"].count("\n") == 1
    assert not results[-1]["torch"]
