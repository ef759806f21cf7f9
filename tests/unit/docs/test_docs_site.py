"""The docs site builds as `mkdocs build --strict` builds it, and README.md links to every page.

A link or anchor that points nowhere, in the pages or in README.md, fails here, so `make test`
catches it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

from tests.support.paths import REPO_ROOT

MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def strict_config(site_dir: Path):
    """The configuration `mkdocs build --strict --site-dir site_dir` builds with."""
    return load_config(config_file=str(REPO_ROOT / "mkdocs.yml"), strict=True, site_dir=str(site_dir))


def build_strictly(site_dir: Path) -> None:
    """What `mkdocs build --strict` runs: plugins started, the build, plugins shut down."""
    config = strict_config(site_dir)
    config.plugins.on_startup(command="build", dirty=False)
    try:
        build(config)
    finally:
        config.plugins.on_shutdown()


def nav_pages(nav) -> list[str]:
    """Every page of a mkdocs nav, as paths relative to docs/."""
    pages = []
    for entry in nav:
        for target in entry.values() if isinstance(entry, dict) else [entry]:
            pages.extend(nav_pages(target) if isinstance(target, list) else [target])
    return pages


def readme_link_targets() -> list[str]:
    """The targets of README.md's markdown links that are not web addresses."""
    text = (REPO_ROOT / "README.md").read_text()
    return [t for t in MARKDOWN_LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def built_page(site_dir: Path, page: str) -> Path:
    """The HTML file a docs page becomes (mkdocs' directory URLs: a.md -> a/index.html)."""
    stem = Path(page).with_suffix("")
    return site_dir / ("index.html" if stem.name == "index" else stem / "index.html")


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    build_strictly(site)
    return site


def test_the_site_builds_strictly_with_every_page_of_the_nav(site_dir: Path) -> None:
    pages = nav_pages(strict_config(site_dir)["nav"])
    assert "reference/configuration.md" in pages
    for page in pages:
        assert built_page(site_dir, page).is_file(), page


@pytest.mark.parametrize(
    "link", ["[the missing page](missing.md)", "[a missing heading](#missing)"], ids=["page", "anchor"]
)
def test_mkdocs_yml_makes_a_link_that_points_nowhere_fail_the_build(tmp_path: Path, link: str) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\nSee {link}.\n")
    (tmp_path / "mkdocs.yml").write_text((REPO_ROOT / "mkdocs.yml").read_text().split("\nnav:")[0])
    config = load_config(config_file=str(tmp_path / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    with pytest.raises(Abort, match="strict mode"):
        build(config)


def test_every_relative_link_in_the_readme_reaches_a_file_and_its_anchor(site_dir: Path) -> None:
    targets = readme_link_targets()
    assert targets
    for target in targets:
        path, _, anchor = target.partition("#")
        assert (REPO_ROOT / path).is_file(), f"README.md links to {target}, which does not exist"
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            html = built_page(site_dir, path.removeprefix("docs/")).read_text()
            assert f'id="{anchor}"' in html, f"README.md links to {target}: no heading has that anchor"


def test_the_readme_links_to_every_page_of_the_site(site_dir: Path) -> None:
    linked = {target.partition("#")[0] for target in readme_link_targets()}
    pages = nav_pages(strict_config(site_dir)["nav"])
    missing = [page for page in pages if page != "index.md" and f"docs/{page}" not in linked]
    assert not missing, f"README.md does not link to {missing}"
