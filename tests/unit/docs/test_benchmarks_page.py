"""The benchmarks page is bench/report.py's output from bench/results/*.json: results rerun without
regenerating the page fail here, and so does a figure edited by hand, since every number on the
page must be a value of those files or a rounding of one."""

from __future__ import annotations

import json
import re
import subprocess

from bench.report import ROOT, bench_modules, page
from bench.report_rows import GPU_SECTIONS_ALONE, ROWS, SEED_ZERO_VARIANTS

PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
CODE_OR_LINK_TARGET = re.compile(r"`[^`]*`|\]\([^)]*\)")
NUMBER_ON_PAGE = re.compile(r"(?<![\w.])([+−-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[−-]?\d+)?)(?![\w]|\.\d)(\s?%)?")
"""A number as the page writes it (not one inside a word: `p99`, `bf16`), and its percent sign."""
NUMBER_IN_TEXT = re.compile(r"\d+(?:\.\d+)?(?:e-?\d+)?")


def results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def values(node) -> set[float]:
    """Every number in results: values, the numbers written in keys and strings, and how many
    items each list or mapping holds."""
    found: set[float] = set()
    if isinstance(node, bool):
        return found
    if isinstance(node, (int, float)):
        found.add(float(node))
    elif isinstance(node, str):
        found.update(float(text) for text in NUMBER_IN_TEXT.findall(node))
    elif isinstance(node, (list, dict)):
        found.add(float(len(node)))
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            found |= values(key) | values(value)
    return found


def shown(text: str) -> tuple[float, float]:
    """A number as the page shows it (`425,600`, `−0.015`, `4.8e−6`) and half the unit of its last
    digit: the distance within which it is a rounding of a value."""
    plain = text.replace(",", "").replace("−", "-")
    mantissa, _, exponent = plain.partition("e")
    digits = mantissa.lstrip("+-")
    if "." in digits:
        unit = 10.0 ** -len(digits.split(".")[1])
    else:
        unit = 10.0 ** (len(digits) - len(digits.rstrip("0"))) if digits.strip("0") else 1.0
    scale = 10.0 ** int(exponent) if exponent else 1.0
    return float(mantissa) * scale, unit * scale / 2


def unexplained(text: str, pool: set[float]) -> list[str]:
    """The numbers in `text` (outside code spans, link targets and dates) that are no value of
    `pool` nor a rounding of one; a percentage is read as the fraction it shows."""
    bare = DATE.sub(" ", CODE_OR_LINK_TARGET.sub(" ", text))
    strays = []
    for match in NUMBER_ON_PAGE.finditer(bare):
        value, half = shown(match.group(1))
        if match.group(2):
            value, half = value / 100, half / 100
        if not any(abs(value - known) <= half * (1 + 1e-9) for known in pool):
            strays.append(match.group(0).strip())
    return strays


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def strays_on(text: str) -> dict[str, list[str]]:
    """Per line of a page, the numbers no results file explains: a table row's against the results
    its first cell names, every other line against all of them."""
    every = set().union(*(values(results(path.stem)) for path in RESULTS.glob("*.json")))
    lines = text.splitlines()
    found = {}
    for number, line in enumerate(lines):
        following = lines[number + 1] if number + 1 < len(lines) else ""
        if line.startswith("|") and not line.startswith("|---") and not following.startswith("|---"):
            name = re.match(r"`([^`]+)`", cells(line)[0])
            assert name, f"a table row names no results in its first cell: {line}"
            strays = unexplained(line, values(results(name.group(1))))
        elif not line.startswith(("#", "|---")):
            strays = unexplained(line, every)
        else:
            strays = []
        if strays:
            found[line] = strays
    return found


def test_the_committed_page_is_what_the_results_generate():
    assert PAGE.read_text() == page(), "regenerate it: python -m bench.report > docs/benchmarks.md"


def test_every_number_on_the_page_comes_from_the_results():
    assert strays_on(PAGE.read_text()) == {}


def test_a_figure_edited_by_hand_is_caught():
    text = page()
    row = next(line for line in text.splitlines() if line.startswith("| `relay` |"))
    figure = cells(row)[2]
    stray = f"{int(max(values(results('relay'))) * 10) + 7:,}"
    edited = row.replace(f"| {figure} |", "| " + NUMBER_ON_PAGE.sub(stray, figure, count=1) + " |")
    assert edited != row
    assert list(strays_on(text.replace(row, edited)).values()) == [[stray]]


def test_each_run_is_dated_by_its_results_or_else_their_commit():
    for line in PAGE.read_text().splitlines():
        if not line.startswith("| `") or not DATE.fullmatch(cells(line)[-1]):
            continue
        name = re.match(r"`([^`]+)`", cells(line)[0]).group(1)
        parts = [results(name), *(value for value in results(name).values() if isinstance(value, dict))]
        stamps = {str(stamp)[:10] for stamp in (part.get("when") or part.get("date") for part in parts) if stamp}
        if not stamps:
            log = ["git", "log", "--format=%cs", "--", f"bench/results/{name}.json"]
            stamps = set(subprocess.run(log, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split())
        assert cells(line)[-1] in stamps, line


def test_every_results_file_and_every_benchmark_of_make_bench_is_on_the_page():
    shown_results = {row.result for row in ROWS} | set(SEED_ZERO_VARIANTS) | set(GPU_SECTIONS_ALONE)
    assert {path.stem for path in RESULTS.glob("*.json")} <= shown_results
    assert {module.removeprefix("bench.") for module in bench_modules()} <= shown_results
    assert len(bench_modules()) >= 13, "the Makefile's bench recipe was not read"


def test_the_page_stays_under_8_kib():
    assert len(PAGE.read_bytes()) < 8000
