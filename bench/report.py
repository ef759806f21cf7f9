"""The benchmarks page, generated from what the runs wrote to bench/results/*.json so that it cannot
drift from them: `python -m bench.report > docs/benchmarks.md` (`make bench` runs it last)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

from bench.report_rows import (
    ASYNC,
    CHAOS,
    CHAOS_RUNS,
    FAULTS,
    FUZZ,
    GPU,
    GPU_SECTIONS_ALONE,
    KEPT_TARGETS,
    MULTI_TURN,
    QUALITY,
    ROWS,
    SCALE,
    SEED_ZERO_VARIANTS,
    SERVING,
    WEIGHT_PLANE,
    Row,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MAKEFILE = ROOT / "Makefile"
PROTOS = ROOT / "protos" / "rlmesh"
FUZZED_CONTRACTS = {
    "manager": "manager/v1/manager.proto",
    "relay": "manager/v1/relay.proto",
    "rollout": "rollout/v1/rollout.proto",
    "weights": "weights/v1/weights.proto",
    "trainer": "trainer/v1/trainer.proto",
}
"""The services whose every RPC the fuzzer sends generated requests to (tests/fuzz/harness.py), and
the contract each is read from."""
NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()


@cache
def load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"bench/results/{name}.json: no such results, named by bench/report_rows.py")
    return json.loads(path.read_text())


def lookup(node, path: str, where: str):
    """The value at `path` in `node`: keys (or a list's indices) joined by dots, a key itself
    holding dots (`qwen2.5-0.5b`) matched whole before it is split."""
    rest = path
    while rest:
        if isinstance(node, list):
            index, _, rest = rest.partition(".")
            node = node[int(index)]
            continue
        if not isinstance(node, dict):
            raise KeyError(f"{where}: {path!r} goes through a value that holds no keys")
        key = next((k for k in sorted(node, key=len, reverse=True) if rest == k or rest.startswith(k + ".")), None)
        if key is None:
            raise KeyError(f"{where}: no {path!r} (no key {rest.split('.')[0]!r} among {sorted(node)})")
        node, rest = node[key], rest[len(key) + 1 :]
    return node


def section_of(row: Row):
    result = load(row.result)
    return lookup(result, row.section, f"bench/results/{row.result}.json") if row.section else result


def significant(value: float, digits: int) -> str:
    if value == 0:
        return "0"
    places = digits - 1 - math.floor(math.log10(abs(value)))
    return f"{value:,.{places}f}" if places > 0 else f"{round(value, places):,.0f}"


def formatted(value, spec: str) -> str:
    """`sN`: N significant digits; `%N`, `+%N`: a fraction as a percentage with N decimals (signed);
    `eN`: N decimals and an exponent; `len`: how many; `code`: a code span each (none: the defaults);
    anything else as Python formats it. A list is formatted item by item."""
    if spec == "len":
        return str(len(value))
    if spec == "code":
        items = value if isinstance(value, list) else [value]
        return ", ".join(f"`{item}`" for item in items) or "the default settings"
    if isinstance(value, list):
        return ", ".join(formatted(item, spec) for item in value)
    if spec.startswith("s"):
        text = significant(value, int(spec[1:]))
    elif spec.lstrip("+").startswith("%"):
        sign, decimals = ("+" if spec.startswith("+") else ""), spec.lstrip("+")[1:]
        text = f"{value * 100:{sign}.{decimals}f}"
    elif spec.startswith("e"):
        mantissa, exponent = f"{value:.{spec[1:]}e}".split("e")
        text = f"{mantissa}e{int(exponent)}"
    else:
        text = format(value, spec or ("," if isinstance(value, int) else ".3g"))
    return text.replace("-", "−")


PLACEHOLDER = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def fill(template: str, row: Row) -> str:
    node = section_of(row)
    where = f"bench/results/{row.result}.json" + (f" ({row.section})" if row.section else "")
    return PLACEHOLDER.sub(lambda m: formatted(lookup(node, m.group(1), where), m.group(2) or ""), template)


def met(row: Row) -> bool:
    """Whether the run met every target the row is judged by: the run's own verdict where it wrote
    one, else its figure against the target's value (`>= 100`, `0`, `true`)."""
    node = section_of(row)
    written = {} if row.section else node.get("targets", {})
    kept = KEPT_TARGETS.get(".".join(filter(None, (row.result, row.section))), {})
    verdicts = []
    for key in row.judged_by:
        if isinstance(written.get(key), bool):
            verdicts.append(written[key])
        elif key in written:
            part = "ratios" if key in node.get("ratios", {}) else "figures"
            verdicts.append(compared(lookup(node, f"{part}.{key}", row.result), written[key]))
        elif key in kept:
            verdicts.append(compared(lookup(node, key, row.result), kept[key]))
        else:
            raise KeyError(f"bench/results/{row.result}.json: no target {key!r} among {sorted({**written, **kept})}")
    return all(verdicts)


def compared(measured, target) -> bool:
    """A figure against a target written as a value (`0`, `true`) or as `>= 0.8 ...`."""
    if not isinstance(target, str):
        return measured == target
    operator, threshold = re.match(r"\s*(>=|<=|<|>|==)\s*([-\d.]+)", target).groups()
    threshold = float(threshold)
    return {
        ">=": measured >= threshold,
        "<=": measured <= threshold,
        "<": measured < threshold,
        ">": measured > threshold,
        "==": measured == threshold,
    }[operator]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def run_date(row: Row) -> str:
    """The day (UTC) of the run: its results' `when` or `date`; for results that record neither,
    the day of the commit that brought the figures the row reads (a later commit may have changed
    a section of the same file that other rows read)."""
    node = section_of(row)
    stamp = node.get("when") or node.get("date")
    if stamp:
        return stamp[:10]
    others = {other.section for other in ROWS if other.result == row.result and other.section != row.section}

    def own_part(result: dict):
        return result.get(row.section) if row.section else {k: v for k, v in result.items() if k not in others}

    relative, day = f"bench/results/{row.result}.json", None
    for line in git("log", "--format=%H %cs", "--", relative).splitlines():
        commit, committed = line.split()
        if own_part(json.loads(git("show", f"{commit}:{relative}"))) != own_part(load(row.result)):
            break
        day = committed
    if day is None:
        raise ValueError(f"{relative}: its figures record no 'when' and are not committed; commit them to date them")
    return day


def table(rows: tuple[Row, ...]) -> list[str]:
    lines = ["| results | measures | figure | baseline | ratio | target | met | run |", "|" + "---|" * 8]
    for row in rows:
        verdict = ("yes" if met(row) else "**no**") if row.judged_by else "reported"
        texts = (row.measures, row.figure, row.baseline, row.ratio, row.target)
        cells = [f"`{row.result}`", *(fill(text, row) for text in texts), verdict, run_date(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def fault_table() -> list[str]:
    """Per chaos run, each kind of fault: how many hit, and the time each cost."""
    lines = ["| results | " + " | ".join(FAULTS.values()) + " |", "|---|" + "---|" * len(FAULTS)]
    for name in CHAOS_RUNS:
        figures = load(name)["figures"]
        cells = [
            f"{figures[f'{kind}/faults']} × {formatted(figures[f'{kind}/mean_seconds_lost'], '.1f')} s"
            for kind in FAULTS
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def bench_modules() -> list[str]:
    """The benchmarks `make bench` runs, in order, read from its recipe (whose last line writes this page)."""
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", MAKEFILE.read_text(), re.MULTILINE)
    if recipe is None:
        raise ValueError("Makefile: no `bench:` target with a recipe")
    pages = ("bench.report", "bench.scale_page")
    return [module for module in re.findall(r"-m (bench\.\w+)", recipe.group(1)) if module not in pages]


def contract_rpcs() -> set[str]:
    """The RPCs of the fuzzed services' contracts, as `service.Rpc`."""
    rpcs = set()
    for service, path in FUZZED_CONTRACTS.items():
        proto = (PROTOS / path).read_text()
        rpcs |= {f"{service}.{name}" for name in re.findall(r"^\s*rpc\s+(\w+)\s*\(", proto, re.MULTILINE)}
    return rpcs


def fuzz_note() -> str:
    """Which RPCs the contracts gained after the latest `make fuzz` run."""
    unfuzzed = sorted(contract_rpcs() - set(load("fuzz")["rpcs"]))
    if not unfuzzed:
        return "The RPC run covered every RPC the contracts have now."
    by_service = {
        service: [rpc.partition(".")[2] for rpc in unfuzzed if rpc.startswith(service + ".")]
        for service in FUZZED_CONTRACTS
    }
    names = "; ".join(
        f"the {service}'s " + ", ".join(f"`{name}`" for name in names) for service, names in by_service.items() if names
    )
    return (
        f"The RPC run predates {names}; the fuzzer reads the RPCs from the contracts, so `make test`'s bounded "
        "run covers them."
    )


def page() -> str:
    modules = bench_modules()
    count = NUMBER_WORDS[len(modules)] if len(modules) < len(NUMBER_WORDS) else str(len(modules))
    cores = sorted({load(row.result).get("machine", {}).get("cpus") for row in ROWS} - {None})
    variants = ", ".join(f"`{name}`" for name in SEED_ZERO_VARIANTS)
    parts = [
        "# Benchmarks",
        "",
        "Each row: a run's figure, the baseline it measured, their ratio, the target, met or not, and the day "
        "(UTC); `bench/results/<results>.json` holds the whole run, git history earlier ones. "
        f"Measured on {' or '.join(map(str, cores))} cores, no GPU, except [on a GPU](#on-a-gpu). "
        "Generated by `python -m bench.report`.",
        "",
        "## Latest figures",
        "",
        f"`make bench` runs all {count} (`python -m bench.<results>`).",
        "",
        *table(SERVING + WEIGHT_PLANE),
        "",
        "### Async training",
        "",
        *table(ASYNC),
        "",
        "### Async quality",
        "",
        "Row one: the target's settings; row two: the defaults ([Algorithms](algorithms.md)); one-seed variants: "
        f"{variants}.",
        "",
        *table(QUALITY),
        "",
        "### Multi-turn tasks",
        "",
        *table(MULTI_TURN),
        "",
        "### [Scale and cost](scale.md)",
        "",
        *table(SCALE),
        "",
        "## The chaos suite",
        "",
        "`make chaos` ([Faults](faults.md#the-chaos-suite)): random faults during a job; below, each kind's count × "
        "its cost over the median step.",
        "",
        *table(CHAOS),
        "",
        *fault_table(),
        "",
        "## Fuzzing",
        "",
        f"`make fuzz` ([Testing](testing.md#fuzzing)). {fuzz_note()}",
        "",
        *table(FUZZ),
        "",
        "## On a GPU",
        "",
        f"`make test-gpu` on one {load('gpu')['machine']['gpu']} ([On a GPU](gpu.md)); run alone: "
        + ", ".join(f"`{name}`" for name in GPU_SECTIONS_ALONE)
        + ".",
        "",
        *table(GPU),
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(page())
