"""`vitrain plot`: the learning curves of real run folders as PNG, SVG and HTML, and its refusals."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SMALL_SYNTHETIC_RUN
from vitrain.cli import main

pytest.importorskip("matplotlib", reason="vitrain plot needs matplotlib (the plot extra)")


def _set(settings):
    return [arg for setting in settings for arg in ("--set", setting)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 2-epoch synthetic runs, the second with a weight EMA (dashed curves)."""
    base = tmp_path_factory.mktemp("plot")
    for name, extra in (("plain", []), ("ema", ["train.ema.decay=0.9"])):
        settings = [*SMALL_SYNTHETIC_RUN, "train.epochs=2", "train.log_every_steps=2", f"train.out_dir={base / name}"]
        assert main(["train", *_set([*settings, *extra])]) == 0
    return base / "plain", base / "ema"


def test_one_run_as_png(runs, tmp_path, capsys):
    out = tmp_path / "one.png"
    assert main(["plot", str(runs[0]), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000  # eight panels of curves, not an empty canvas


def test_several_runs_as_svg_and_html_carry_their_names_and_summaries(runs, tmp_path):
    svg, page = tmp_path / "two.svg", tmp_path / "two.html"
    for out in (svg, page):
        assert main(["plot", *map(str, runs), "--names", "baseline", "with-ema", "--out", str(out)]) == 0
    text = svg.read_text()
    assert "baseline" in text and "with-ema" in text and "with-ema (EMA weights)" in text
    html = page.read_text()
    summary = json.loads((runs[1] / "summary.json").read_text())
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and "with-ema" in html
    assert f"{summary['final_top1']:.4g}" in html


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{tmp}", "--out", "{tmp}/x.png"], "is not a run folder (no metrics.jsonl)"),
        (["{run}", "--out", "{tmp}/x.pdf"], "write a .png, .svg, .html file"),
        (["{run}", "--names", "a", "b", "--out", "{tmp}/x.png"], "1 runs but 2 names"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(runs, tmp_path, capsys, arguments, message):
    argv = [argument.format(tmp=tmp_path, run=runs[0]) for argument in arguments]
    assert main(["plot", *argv]) == 2
    assert message in capsys.readouterr().err
