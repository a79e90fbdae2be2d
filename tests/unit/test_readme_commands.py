"""The README's "Train on your images" section, run as written on a generated folder of ten classes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from tests.unit.test_your_images import write_class_folders
from vitrain.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Train on your images"
TEST_BUDGET = "10s"
"""Every --budget of the section becomes this one: the commands as written, in seconds instead of minutes."""


def section_commands(text: str) -> list[list[str]]:
    """The shell commands of the README's section: each line of its ```bash blocks, comments dropped."""
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end > 0 else None]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def test_the_section_s_commands_run_on_a_folder_of_images(tmp_path, monkeypatch, capsys):
    commands = section_commands(README.read_text())
    assert commands and all(words[0] == "vitrain" for words in commands), commands
    assert any("--data" in words and "--budget" in words for words in commands)
    assert any(words[1] == "predict" for words in commands)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VITRAIN_CACHE_DIR", str(tmp_path / "cache"))
    names = tuple(f"class{index}" for index in range(10))
    write_class_folders(tmp_path / "my-images", per_class=12, side=16, classes=names)
    (tmp_path / "photo.jpg").write_bytes((tmp_path / "my-images" / "class3" / "000.jpg").read_bytes())
    for words in commands:
        argv = [
            TEST_BUDGET if before == "--budget" else word for before, word in zip(["", *words], words, strict=False)
        ]
        argv = argv[1:] + (["--set", "data.num_workers=0"] if words[1] == "train" else [])
        assert main(argv) == 0, " ".join(words)
        out = capsys.readouterr().out
        if words[1] == "train" and "--dry-run" in words:
            assert "# chosen: localvit_tiny6_convstem_patch8 at 32 px" in out and "in 10 classes" in out
        elif words[1] == "train":
            assert 0.0 <= json.loads(out.strip().splitlines()[-1])["final_top1"] <= 100.0
    run = next(Path(words[words.index("--out") + 1]) for words in commands if "--out" in words)
    held = json.loads((run / "val_split.json").read_text())
    assert len(held["images"]) == 10 and all(path.split("/")[0] in names for path in held["images"])
    assert main(["predict", str(run), "photo.jpg", "--json"]) == 0
    assert {entry["class"] for entry in json.loads(capsys.readouterr().out)["top"]} <= set(names)
