"""The repository's root, for tests that read its files (docs, examples, deploy) or run commands in it."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
