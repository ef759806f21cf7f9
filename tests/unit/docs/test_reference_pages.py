"""The generated reference pages are what their generators print from today's code and contracts."""

from __future__ import annotations

import pytest

from rlmesh.reference import codemap, contracts, extensions
from tests.support.paths import REPO_ROOT

PAGES = {
    "reference/contracts.md": lambda: contracts.render(contracts.descriptor_set()),
    "reference/extension-points.md": extensions.render,
    "code-map.md": codemap.render,
}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_committed_page_is_what_its_generator_prints(page):
    committed = (REPO_ROOT / "docs" / page).read_text()
    assert committed == PAGES[page](), (
        f"docs/{page} is stale: regenerate it (`make docs-reference`), do not edit it by hand"
    )


def test_every_rpc_of_every_contract_is_on_the_contracts_page():
    files = contracts.descriptor_set()
    page = (REPO_ROOT / "docs" / "reference" / "contracts.md").read_text()
    methods = [method.name for file in files.file for service in file.service for method in service.method]
    assert len(methods) >= 38
    assert [name for name in methods if f"| `{name}` |" not in page] == []
