"""Prints uv's flags for the package sources pip is configured with (find-links, indexes), so
`uv pip install` takes the same wheels pip would: a local mirror or PyTorch's CPU index where pip is
configured with one, PyPI otherwise."""

import subprocess
import sys

# pip's config keys and the uv flag each becomes; pip's own environment variables (PIP_*) show up
# in `pip config list` as ":env:." keys and win over the files, as they do for pip.
UV_FLAGS = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url"}


def pip_sources() -> dict[str, list[str]]:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    sources: dict[str, tuple[int, list[str]]] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if name not in UV_FLAGS:
            continue
        rank = 1 if scope == ":env:" else 0
        if rank >= sources.get(name, (-1, []))[0]:
            sources[name] = (rank, value.strip().strip("'\"").split())
    return {name: values for name, (_, values) in sources.items()}


def main() -> None:
    # Several indexes (the local mirror, PyPI) may each hold some versions of a package: take the
    # best match among all of them, as pip does.
    flags = ["--index-strategy", "unsafe-best-match"]
    for name, values in pip_sources().items():
        for value in values:
            flags += [UV_FLAGS[name], value]
    print(" ".join(flags))


if __name__ == "__main__":
    main()
