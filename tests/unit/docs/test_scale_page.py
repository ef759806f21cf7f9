"""The scale and cost page is bench/scale_page.py's output from bench/results/scale.json,
capacity.json, cost.json and relay_shards.json: results rerun without regenerating the page fail
here, and so does a page that leaves out one of their targets."""

from bench.report import ROOT
from bench.scale_page import load, page

PAGE = ROOT / "docs" / "scale.md"


def test_the_committed_page_is_what_the_results_generate():
    assert PAGE.read_text() == page(), "docs/scale.md is stale: run `python -m bench.scale_page > docs/scale.md`"


def test_every_target_of_both_runs_is_on_the_page_with_its_verdict():
    text = PAGE.read_text()
    for name in ("scale", "capacity", "cost", "relay_shards"):
        for target, met in load(name)["targets"].items():
            line = next((line for line in text.splitlines() if target in line), None)
            assert line is not None, f"{name}: target {target!r} is not on the page"
            assert ("**not met**" in line) == (not met), line


def test_the_page_shows_the_plots_it_names():
    text = PAGE.read_text()
    for image in ("images/scale.png", "images/cost.png"):
        assert f"]({image})" in text
        assert (ROOT / "docs" / image).is_file(), image
